"""Adaptive speculation: each replica picks its block size, "off" included, per cycle.

Speculation pays when the tokens a cycle commits outweigh what the cycle costs. Both
sides are measured online:

* acceptance -- ``AcceptanceModel`` keeps, per draft position j, decayed counts of how
  often position j was accepted given that positions 1..j-1 were. Their running product
  is the survival curve P(A >= j), and the expected tokens per cycle for a block of k is
  ``tau(k) = 1 + sum_{j<k} P(A >= j)`` (the paper's tau = E[A + 1]).
* cost -- ``LinearCost`` fits cycle seconds as ``a + b * n``, n = rows x block tokens, by
  decayed least squares: one fit for the verify pass (the target forward, plus
  bookkeeping) and one for the drafter pass. Batch rows and block length trade off
  through n, so one model serves every concurrency.

``choose_block_size`` is then a pure function: the k in 1..K maximising
``tau(k) / (verify(rows * k) + draft(rows * k))``, where k = 1 means speculation off
(a plain AR step). A block only wins if it beats AR by ``margin``, so under doubt the
replica decodes at AR speed. While off, a cheap probe cycle runs now and then so that
acceptance keeps being measured; probes are spaced so that they cost at most
``probe_budget`` of throughput.

Timings on a shared machine have hiccups (a GC pause, a neighbour's burst, a cold first
pass), and that noise only ever adds time. Three rules keep one of them from switching
speculation off for long: a pass slower than ``clip`` times what the fit predicts counts as
``clip`` times the prediction; a pass twice as fast as predicted cuts the weight of the past
(it was slow); and while the drafter's cost rests on fewer passes than its fit needs to
clip, or its acceptance on fewer than ``min_evidence`` attempts, probes come every
``PROBE_LO`` cycles, so an early verdict of "off" is re-examined soon.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: Cost prior from docs/serving.md (SmolLM2 on CPU): verifying 16 tokens costs ~1.7 decode steps,
#: i.e. verify(n) ~ a * (1 + 0.047 * n). Only used until measurements pin the slope down.
VERIFY_SLOPE_PRIOR = 0.047
#: Before the first drafter pass is timed: a drafter pass costs this fraction of a verify.
DRAFT_FRACTION_PRIOR = 0.3


@dataclass
class AcceptanceModel:
    """Per-position conditional acceptance with exponentially decayed counts.

    ``decay`` is applied once per observed speculative cycle, so the model remembers
    roughly ``1 / (1 - decay)`` cycles. Positions with few attempts fall back on the
    estimate of the position before them (``prior`` for position 1), weighted as
    ``prior_weight`` pseudo-attempts.
    """

    max_drafts: int
    prior: float = 0.5
    prior_weight: float = 2.0
    decay: float = 0.995
    attempts: list[float] = field(default_factory=list)
    successes: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.attempts:
            self.attempts = [0.0] * self.max_drafts
            self.successes = [0.0] * self.max_drafts

    def observe(self, drafted: int | list[int], accepted: list[int]) -> None:
        """One cycle: row r drafted ``drafted`` (or ``drafted[r]``) tokens and accepted ``accepted[r]``."""
        per_row = drafted if isinstance(drafted, list) else [drafted] * len(accepted)
        if not accepted or max(per_row, default=0) <= 0:
            return
        self.attempts = [a * self.decay for a in self.attempts]
        self.successes = [s * self.decay for s in self.successes]
        for a, d in zip(accepted, per_row):
            # position j (1-based) was tried iff all earlier ones were accepted
            for j in range(1, min(a + 1, d, self.max_drafts) + 1):
                self.attempts[j - 1] += 1.0
                self.successes[j - 1] += 1.0 if a >= j else 0.0

    def conditional(self) -> list[float]:
        """P(position j accepted | positions < j accepted), j = 1..max_drafts."""
        out, prev = [], self.prior
        for att, succ in zip(self.attempts, self.successes):
            prev = (succ + self.prior_weight * prev) / (att + self.prior_weight)
            out.append(prev)
        return out

    def survival(self) -> list[float]:
        """P(A >= j), j = 1..max_drafts."""
        out, p = [], 1.0
        for c in self.conditional():
            p *= c
            out.append(p)
        return out

    def tau(self, k: int) -> float:
        """Expected tokens committed by one cycle of block size k (k = 1: AR, tau = 1)."""
        return expected_tau(self.survival(), k)


def expected_tau(survival: list[float], k: int) -> float:
    """1 + sum_{j=1}^{k-1} P(A >= j)."""
    return 1.0 + sum(survival[: max(0, k - 1)])


@dataclass
class LinearCost:
    """Seconds of a pass over n tokens: ``a + b * n``, fitted by decayed least squares.

    A small ridge term pulls the slope towards ``slope_ratio * a`` so that the fit is
    well-posed while every observation so far had the same n.
    """

    slope_ratio: float = VERIFY_SLOPE_PRIOR
    decay: float = 0.98
    ridge: float = 0.02
    clip: float = 3.0  # a pass counts as at most clip x the prediction once the fit holds min_weight
    min_weight: float = 3.0
    fast: float = 2.0  # a pass this many times faster than predicted says the past was slow ...
    forget: float = 0.25  # ... and leaves the past this share of its weight
    s0: float = 0.0  # sum w
    s1: float = 0.0  # sum w n
    s2: float = 0.0  # sum w n^2
    sy: float = 0.0  # sum w t
    sny: float = 0.0  # sum w n t

    def observe(self, n: int, seconds: float) -> None:
        d = self.decay
        if self.fitted:
            pred = max(self.predict(n), 1e-9)
            if self.s0 >= self.min_weight:  # a hiccup moves the fit by a bounded step, a lasting change by many
                seconds = min(seconds, self.clip * pred)
            if seconds * self.fast < pred:  # noise only ever adds time: the past was slow
                d *= self.forget
        self.s0, self.s1, self.s2 = d * self.s0 + 1, d * self.s1 + n, d * self.s2 + n * n
        self.sy, self.sny = d * self.sy + seconds, d * self.sny + n * seconds

    @property
    def fitted(self) -> bool:
        return self.s0 > 0

    def coefficients(self) -> tuple[float, float]:
        """(a, b) minimising sum w (t - a - b n)^2 + lam (b - rho a)^2."""
        if not self.fitted:
            return 0.0, 0.0
        rho = self.slope_ratio
        mean_n = self.s1 / self.s0
        lam = self.ridge * self.s0 * max(mean_n, 1.0) ** 2
        m00, m01, m11 = self.s0 + lam * rho * rho, self.s1 - lam * rho, self.s2 + lam
        det = m00 * m11 - m01 * m01
        a = (self.sy * m11 - m01 * self.sny) / det
        b = (m00 * self.sny - m01 * self.sy) / det
        if b < 0:  # noise; time never falls with more tokens
            a, b = self.sy / self.s0, 0.0
        return max(a, 0.0), b

    def predict(self, n: int) -> float:
        a, b = self.coefficients()
        return a + b * n


@dataclass
class CostModel:
    """Cycle time = verify(rows * k) + [k > 1] draft(rows * max(k, draft_width)), both
    measured online. ``draft_width``: the drafter denoises its whole trained block whatever k
    is verified (``DFlashProposer.propose``), so its pass costs the same for every k <= B."""

    verify: LinearCost = field(default_factory=LinearCost)
    draft: LinearCost = field(default_factory=lambda: LinearCost(slope_ratio=0.1))
    draft_width: int = 1

    def observe(self, rows: int, k: int, draft_s: float | None, verify_s: float) -> None:
        """``draft_s`` None: no drafter pass ran (a lookup-only step), nothing to learn about it."""
        self.verify.observe(rows * k, verify_s)
        if k > 1 and draft_s is not None:
            self.draft.observe(rows * max(k, self.draft_width), draft_s)

    def cycle_seconds(self, rows: int, k: int, drafter: bool = True) -> float:
        """Predicted seconds of a step of block k over ``rows`` rows (``drafter``: with a drafter pass)."""
        n = rows * k
        v = self.verify.predict(n) if self.verify.fitted else 1.0 + VERIFY_SLOPE_PRIOR * n
        if k == 1 or not drafter:
            return v
        nd = rows * max(k, self.draft_width)
        d = self.draft.predict(nd) if self.draft.fitted else DRAFT_FRACTION_PRIOR * v
        return v + d


def choose_block_size(survival: list[float], cost: CostModel, rows: int, max_block: int,
                      margin: float = 0.03) -> tuple[int, float]:
    """The block size in 1..max_block with the highest expected tokens/s, and its
    expected speedup over AR. k > 1 must beat AR by ``margin``; ties go to smaller k."""
    rows = max(rows, 1)
    ar_rate = 1.0 / max(cost.cycle_seconds(rows, 1), 1e-9)
    best_k, best_rate = 1, ar_rate
    for k in range(2, max_block + 1):
        rate = expected_tau(survival, k) / max(cost.cycle_seconds(rows, k), 1e-9)
        if rate > best_rate * (1.0 + 1e-9):
            best_k, best_rate = k, rate
    if best_k > 1 and best_rate < ar_rate * (1.0 + margin):
        best_k, best_rate = 1, ar_rate
    return best_k, best_rate / ar_rate


#: Probes between AR cycles: the fewest cycles apart, and the most.
PROBE_LO, PROBE_HI = 8, 400


def probe_interval(cost: CostModel, rows: int, probe_k: int, budget: float,
                   lo: int = PROBE_LO, hi: int = PROBE_HI) -> int:
    """Cycles between probes so that a probe's extra cost is ``budget`` of AR throughput
    (a probe commits at least one token, like the AR step it replaces)."""
    ar = cost.cycle_seconds(max(rows, 1), 1)
    extra = max(cost.cycle_seconds(max(rows, 1), probe_k) - ar, 0.0) / max(ar, 1e-9)
    return int(min(hi, max(lo, math.ceil(extra / max(budget, 1e-6)))))


class BlockSizeController:
    """Chooses the block size for the next engine step and learns from its outcome.

    ``mode``: the serving ``speculation`` as ``ServeConfig`` validated it: "auto"
    (adaptive), "off" (always AR) or N >= 2 (a fixed block, capped by the drafter's).
    ``max_block`` is the drafter's block size B (1 without a drafter, which forces "off").
    """

    def __init__(self, max_block: int, mode: str | int = "auto", cost: CostModel | None = None,
                 margin: float = 0.03, probe_budget: float = 0.01, probe_block: int = 4, lookup_block: int = 0,
                 min_evidence: float = 8.0):
        self.max_block = max(1, int(max_block))
        # prompt lookup beside the drafter: its own acceptance, its own block (1: off)
        self.lookup_block = lookup_block if lookup_block > 1 and self.max_block > 1 else 1
        self.lookup = AcceptanceModel(max_drafts=self.lookup_block - 1) if self.lookup_block > 1 else None
        self.match = [1.0, 2.0]  # decayed (rows whose context had a lookup match, rows looked at): prior 0.5
        self._probing = False
        self.mode = mode
        self.cost = cost or CostModel()
        self.cost.draft_width = self.max_block  # this drafter's pass always spans its block
        self.acceptance = AcceptanceModel(max_drafts=max(self.max_block - 1, 1))
        self.margin = margin
        self.probe_budget = probe_budget
        self.probe_block = max(2, min(probe_block, self.max_block))
        self.min_evidence = min_evidence
        self.expected_speedup = 1.0
        self._since_probe = 0

    def choose(self, rows: int) -> int:
        if self.max_block <= 1 or self.mode == "off":
            return 1
        if self.mode != "auto":
            return min(int(self.mode), self.max_block)
        k, self.expected_speedup = choose_block_size(self.acceptance.survival(), self.cost, rows,
                                                     self.max_block, self.margin)
        self._probing = False
        if k > 1:
            self._since_probe = 0
            return k
        self._since_probe += 1
        if self._since_probe >= self._probe_interval(rows):
            self._since_probe = 0
            self._probing = True
            return self.probe_block
        return 1

    @property
    def probing(self) -> bool:
        """Whether the last ``choose`` returned a probe (a block run to measure, not chosen)."""
        return self._probing

    def _probe_interval(self, rows: int) -> int:
        """The budgeted spacing, or the shortest while the drafter's cost or acceptance is thin."""
        draft = self.cost.draft
        thin = draft.s0 < draft.min_weight or self.acceptance.attempts[0] < self.min_evidence
        return PROBE_LO if thin else probe_interval(self.cost, rows, self.probe_block, self.probe_budget)

    @property
    def match_rate(self) -> float:
        """Recent fraction of rows whose context had a lookup match."""
        return self.match[0] / self.match[1]

    def choose_lookup(self, rows: int, k: int) -> int:
        """Block size for prompt-lookup drafts in a step whose drafter block is ``k`` (1 = no
        lookup drafts): the best expected rate over the whole batch, where only the matched
        share of rows (``match_rate``) drafts from lookup and every row pays the padded width
        max(k, k_l) in the verify pass; the whole ``lookup_block`` on probes and in fixed modes."""
        if self.lookup is None or self.mode == "off":
            return 1
        if self.mode != "auto" or self._probing:
            return self.lookup_block
        rows, m = max(rows, 1), self.match_rate
        s_look, s_draft = self.lookup.survival(), self.acceptance.survival()

        def rate(k_look: int) -> float:
            width = max(k, k_look)
            drafter = expected_tau(s_draft, width) if k > 1 else 1.0  # rows the drafter drafts for
            matched = expected_tau(s_look, k_look) if k_look > 1 else drafter
            tokens = m * matched + (1 - m) * drafter
            return tokens / max(self.cost.cycle_seconds(rows, width, drafter=k > 1), 1e-9)

        base = rate(1)
        best = max(range(2, self.lookup_block + 1), key=rate)
        return best if rate(best) > base * (1.0 + self.margin) else 1

    def observe(self, rows: int, k: int, accepted: list[int], draft_s: float, verify_s: float,
                drafted: list[tuple[str, int]] | None = None, matched: list[bool] | None = None) -> None:
        """Learn from one step: block size k actually run over ``rows`` rows, the accepted
        draft count of each row, and the measured drafter and verify seconds. With prompt
        lookup: ``drafted`` per row (source, tokens drafted), each source learning only from
        its own rows, and ``matched`` per row whether its context had a lookup match."""
        if rows <= 0:
            return
        if matched:
            d = self.lookup.decay if self.lookup is not None else 0.995
            self.match = [d * self.match[0] + sum(matched), d * self.match[1] + len(matched)]
        if not drafted:
            self.cost.observe(rows, k, draft_s, verify_s)
            if k > 1:
                self.acceptance.observe(k - 1, accepted)
            return
        ran = any(src == "dflash" for src, _ in drafted)
        self.cost.observe(rows, k, draft_s if ran else None, verify_s)
        for src, model in (("dflash", self.acceptance), ("lookup", self.lookup)):
            mine = [(n, a) for (s, n), a in zip(drafted, accepted) if s == src]
            if mine and model is not None:
                model.observe([n for n, _ in mine], [a for _, a in mine])
