"""The speculative engine: prefill -> draft -> verify -> accept -> commit.

One ``step`` runs one cycle for every live row at once: the proposer drafts K tokens per
row, the target verifies all rows' blocks in ONE forward pass (rows may hold different
numbers of committed tokens: see kvcache.py), each row keeps its own accepted prefix
and the caches drop every rejected position. ``generate`` is the static-batch loop;
``add`` + ``step`` give continuous batching to a server. The proposers are in proposers.py.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache

from specdec import kvcache
from specdec.sampling import GREEDY, SamplingParams, probs_from_logits, sample
from specdec.target import Target
from specdec.verify import greedy_accept, speculative_accept


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int = 128
    params: SamplingParams = GREEDY
    stop_ids: frozenset[int] | None = None  # None: the target's stop tokens
    id: object = None
    oracle: list[int] | None = None  # the target's own continuation, for OracleProposer


@dataclass
class Stats:
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0
    cycles: int = 0
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per cycle (A)

    @property
    def tau(self) -> float | None:
        """Mean tokens committed per cycle, E[A + 1]."""
        return tau_of(self.accepted)

    def add(self, cycle: "Cycle", accepted: int) -> None:
        self.cycles += 1
        self.accepted.append(accepted)
        self.draft_s += cycle.draft_s
        self.verify_s += cycle.verify_s
        self.overhead_s += cycle.overhead_s

    def as_dict(self) -> dict:
        return {"cycles": self.cycles, "tau": self.tau, "accepted": list(self.accepted),
                "prefill_s": self.prefill_s, "draft_s": self.draft_s, "verify_s": self.verify_s,
                "overhead_s": self.overhead_s}


def tau_of(accepted: list[int]) -> float | None:
    """tau = E[A + 1] from the accepted draft lengths A of a set of cycles (None: no cycle)."""
    return (sum(accepted) / len(accepted) + 1) if accepted else None


def length_histogram(accepted: list[int]) -> dict[str, int]:
    """Cycles per accepted length A + 1 (tokens committed per cycle), keys in order."""
    counts: dict[int, int] = {}
    for a in accepted:
        counts[a + 1] = counts.get(a + 1, 0) + 1
    return {str(k): counts[k] for k in sorted(counts)}


@dataclass
class Cycle:
    """What one ``Engine.step`` ran: its block length and where its time went."""

    k: int = 1  # anchor + drafts verified (1: a plain AR step)
    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0


class PhaseClock:
    """Times the phases of a cycle (``with clock("draft"): ...``) so the algorithm's lines
    carry no timing code; ``cycle(k)`` closes the cycle and starts the next one."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - t0

    def cycle(self, k: int) -> Cycle:
        t, self.times = self.times, {}
        return Cycle(k, t.get("draft", 0.0), t.get("verify", 0.0), t.get("overhead", 0.0))


@dataclass
class Result:
    request: Request
    tokens: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    stats: Stats = field(default_factory=Stats)


class Proposer(Protocol):
    """Drafts K tokens per live row. State is per row and follows the engine's row order.

    ``commit`` is called after every step, drafting or not (k = 1 steps still commit the
    target features of the token they accepted), so a proposer's context stays complete."""

    needs_features: bool
    layer_ids: list[int] | None  # target layers whose features it reads (None: none)

    def admit(self, engine: "Engine", rows: list[Result], features: torch.Tensor | None, lens: torch.Tensor) -> None: ...
    def propose(self, engine: "Engine", k: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...  # (B, <= k) drafts, q
    def commit(self, features: torch.Tensor | None, keep: torch.Tensor) -> None: ...
    def select(self, idx: torch.Tensor) -> None: ...


class Engine:
    def __init__(self, target: Target, proposer: Proposer | None = None, width: int = 16,
                 seed: int | None = None):
        """``width``: the most tokens one cycle verifies (anchor + drafts); a drafter's own
        trained block size is its config's ``block_size`` (``specdec/proposers.engine_width``)."""
        self.target = target
        self.proposer = proposer
        self.width = width
        self.generator = torch.Generator(device=target.device)
        self.generator.manual_seed(seed if seed is not None else torch.seed())
        self.default_stop = frozenset(target.stop_token_ids())
        self.layer_ids = proposer.layer_ids if proposer is not None and proposer.needs_features else None
        self.clock = PhaseClock()
        self.last_cycle = Cycle()  # what the latest step ran (serving's controller reads it)
        self.rows: list[Result] = []
        self.cache = DynamicCache()
        self.lens = torch.zeros(0, dtype=torch.long, device=target.device)
        self.anchors = torch.zeros(0, dtype=torch.long, device=target.device)

    # ------------------------------------------------------------------ public
    def generate(self, requests: list[Request], width: int | None = None) -> list[Result]:
        """Run ``requests`` as one batch to completion; results in request order."""
        done = self.add(requests)
        while self.rows:
            done += self.step(width)
        order = {id(r): i for i, r in enumerate(requests)}
        return sorted(done, key=lambda res: order[id(res.request)])

    def add(self, requests: list[Request]) -> list[Result]:
        """Prefill new requests and join them to the live batch; returns any already done."""
        if not requests:
            return []
        t0 = time.perf_counter()
        dev = self.target.device
        for r in requests:
            self.check(r)
        lens = torch.tensor([len(r.prompt) for r in requests], device=dev)
        P = int(lens.max())
        ids = torch.zeros(len(requests), P, dtype=torch.long, device=dev)
        for i, r in enumerate(requests):
            ids[i, : len(r.prompt)] = torch.tensor(r.prompt, device=dev)
        cache = DynamicCache()
        pos = torch.arange(P, device=dev)[None].expand(len(requests), -1)
        # causal alone suffices: a real query never sees the right padding after it
        mask = kvcache.attention_mask(lens, 0, P, causal=True)
        out = self.target(ids, pos, cache, mask, self.layer_ids)
        last = out.hidden[torch.arange(len(requests)), lens - 1][:, None]
        first = self._pick(self.target.logits(last), [r.params for r in requests])[:, 0]
        rows = [Result(r, []) for r in requests]
        if self.proposer is not None:
            self.proposer.admit(self, rows, out.features, lens)
        self.cache, self.lens = kvcache.concat([self.cache, cache], [self.lens, lens])
        self.anchors = torch.cat([self.anchors, first])
        self.rows += rows
        dt = time.perf_counter() - t0
        for row, tok in zip(rows, first.tolist()):
            row.stats.prefill_s = dt
            self._emit(row, [tok])
        return self._drop_finished()

    def check(self, request: Request) -> None:
        """Raise ValueError unless ``request`` can run here (a non-empty prompt that leaves
        room in the context); ``add`` checks every request before touching any state."""
        n = len(request.prompt)
        if n == 0:
            raise ValueError("empty prompt")
        if n >= self.target.max_positions:
            raise ValueError(f"prompt of {n} tokens exceeds the context length {self.target.max_positions}")

    def step(self, width: int | None = None) -> list[Result]:
        """One draft/verify cycle for every live row; returns rows that finished."""
        if not self.rows:
            return []
        clock = self.clock
        k = self._block_len(width or self.width) if self.proposer is not None else 1
        with clock("draft"):
            draft, q = torch.zeros(len(self.rows), 0, dtype=torch.long, device=self.anchors.device), None
            if k > 1:  # a proposer may draft fewer than k - 1 tokens (a lookup that found little)
                draft, q = self.proposer.propose(self, k - 1)
                k = draft.shape[1] + 1

        with clock("verify"):
            block = torch.cat([self.anchors[:, None], draft], dim=1)
            past = kvcache.physical_len(self.cache)
            pos = self.lens[:, None] + torch.arange(k, device=block.device)
            mask = kvcache.attention_mask(self.lens, past, k, causal=True)
            out = self.target(block, pos, self.cache, mask, self.layer_ids)
            logits = self.target.logits(out.hidden)
            params = [r.request.params for r in self.rows]
            if all(p.greedy for p in params):
                num_acc, toks = greedy_accept(draft, logits.argmax(-1))
            else:
                num_acc, toks = speculative_accept(draft, q, probs_from_logits(logits, params), self.generator)

        with clock("overhead"):
            keep = num_acc + 1  # the anchor and the accepted drafts enter the cache
            self.lens = kvcache.commit(self.cache, self.lens, past, keep)
            if self.proposer is not None:
                self.proposer.commit(out.features, keep)
            rows_idx = torch.arange(len(self.rows), device=toks.device)
            self.anchors = toks[rows_idx, num_acc]
            accepted = num_acc.tolist()
            for row, a, emitted in zip(self.rows, accepted, toks.tolist()):
                self._emit(row, emitted[: a + 1])
        self.last_cycle = clock.cycle(k)
        for row, a in zip(self.rows, accepted):
            row.stats.add(self.last_cycle, a)
        return self._drop_finished()

    def cancel(self, request: Request) -> Result | None:
        """Drop a live request (e.g. its client went away) and free its slot."""
        for i, row in enumerate(self.rows):
            if row.request is request:
                row.finish_reason = "cancelled"
                return self._drop_finished()[0]
        return None

    # ------------------------------------------------------------------ internals
    def _pick(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        if all(p.greedy for p in params):
            return logits.argmax(-1)
        return sample(probs_from_logits(logits, params), self.generator)

    def _block_len(self, k: int) -> int:
        """Shrink the block at the context limit and when no row needs that many tokens."""
        room = int((self.target.max_positions - self.lens).min())
        need = max(r.request.max_new_tokens - len(r.tokens) for r in self.rows)
        return max(1, min(k, room, need))

    def _emit(self, row: Result, tokens: list[int]) -> None:
        stop = row.request.stop_ids if row.request.stop_ids is not None else self.default_stop
        for t in tokens:
            row.tokens.append(t)
            if t in stop:
                row.finish_reason = "stop"
                return
            if len(row.tokens) >= row.request.max_new_tokens:
                row.finish_reason = "length"
                return
        if len(row.request.prompt) + len(row.tokens) >= self.target.max_positions:
            row.finish_reason = "length"

    def _drop_finished(self) -> list[Result]:
        done = [r for r in self.rows if r.finish_reason is not None]
        if done:
            keep = torch.tensor([i for i, r in enumerate(self.rows) if r.finish_reason is None],
                                dtype=torch.long, device=self.anchors.device)
            self.rows = [r for r in self.rows if r.finish_reason is None]
            self.lens = kvcache.select_rows(self.cache, keep, self.lens)
            self.anchors = self.anchors[keep]
            if self.proposer is not None:
                self.proposer.select(keep)
        return done
