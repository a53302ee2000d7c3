"""Measuring side by side (no Ray here): the harness every comparison runs on, the engine
benchmark (``harness/bench.py``), promotion's evaluation (``pipelines/evaluate.py``), the
reference drafter's publishing (``pipelines/reference.py``) and the context-length bench.

* loading: :func:`load_target_checked`, :func:`load_drafter_for`, :func:`load_prompt_ids`
  (user errors become a one-line :class:`BenchError`);
* :func:`run_engine`: one static batch through our engine, timed;
* :func:`engine_method`: a method running our engine, for :func:`measure_methods`;
* :func:`measure_methods`: a warm-up first, then per batch every method in turn (the order
  rotates from batch to batch), so machine noise hits all methods alike; per-method totals;
* :func:`summarise`: the totals as ``results``, ``exactness`` (greedy identity with ``ar``)
  and ``cost_terms``; :func:`machine_info` for a report's config.

Time accounting for our engine: draft_s and verify_s come from the engine's Stats (one
value per batch, since every cycle runs all live rows at once); overhead_s is the rest
of the wall time (prefill, acceptance, bookkeeping), so the three add up to the wall.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.engine import Engine, Request, Result, length_histogram, tau_of
from specdec.sampling import SamplingParams
from specdec.target import Target


class BenchError(ValueError):
    """A user error (bad flag, missing file, mismatched drafter): shown as one line."""


# ---------------------------------------------------------------------- loading
def load_drafter_for(path: str | os.PathLike, target: Target):
    """Load a drafter directory checked against ``target``; errors become ``BenchError``."""
    from specdec.checkpoint import load_drafter

    if not Path(path).is_dir():
        raise BenchError(f"drafter directory not found: {path}")
    try:
        return load_drafter(path, target=target)
    except (FileNotFoundError, ValueError) as e:  # DrafterMismatchError is a ValueError
        raise BenchError(f"cannot use drafter {path}: {e}") from None


def load_target_checked(name_or_path: str | None, dtype: str = "float32") -> Target:
    """Load a target; a missing local path or a failed load becomes a one-line ``BenchError``."""
    from specdec.target import load_target

    if name_or_path and (name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path) \
            and not Path(name_or_path).expanduser().exists():
        raise BenchError(f"target not found: {name_or_path}")
    try:
        return load_target(name_or_path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot load target {name_or_path!r}: {str(e).splitlines()[0]}") from None


def load_prompt_ids(target: Target, source: str, n: int) -> tuple[list[str], list[list[int]]]:
    """``n`` prompts from ``source`` rendered with the target's chat template."""
    from specdec.prompts import load_prompts

    # built-in sets that training draws from (sharegpt; longctx, LongAlign adaptation): their holdout split
    split = "holdout" if source in ("sharegpt", "longctx") else "all"
    try:
        prompts = load_prompts(source, split=split, limit=n)
    except (FileNotFoundError, ValueError) as e:
        raise BenchError(f"cannot read prompts {source!r}: {e}") from None
    if not prompts:
        raise BenchError(f"no prompts in {source!r}")
    return [p.id for p in prompts], [target.encode_chat(p.messages) for p in prompts]


# ---------------------------------------------------------------------- one run
@dataclass
class Run:
    """What one method produced on one batch."""

    tokens: list[list[int]]
    wall_s: float
    draft_s: float | None = None
    verify_s: float | None = None
    cycles: int = 0  # engine steps for the whole batch
    prefill_s: float = 0.0  # part of the overhead
    accepted: list[int] = field(default_factory=list)  # A per row-cycle


def run_engine(target: Target, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams,
               proposer=None, width: int = 16, seed: int = 0, stop_ids: frozenset[int] | None = None,
               oracles: list[list[int]] | None = None) -> tuple[list[Result], Run]:
    """One static batch through our engine (verifying up to ``width`` tokens a cycle), timed."""
    reqs = [Request(p, max_new_tokens=max_new_tokens, params=params, stop_ids=stop_ids,
                    oracle=oracles[i] if oracles else None) for i, p in enumerate(prompts)]
    engine = Engine(target, proposer, width=width, seed=seed)
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    wall = time.perf_counter() - t0
    # every cycle runs all live rows together and adds its time to each of them; the
    # row that lived longest saw every cycle, so its totals are the batch's
    last = max(results, key=lambda r: r.stats.cycles)
    run = Run([r.tokens for r in results], wall, last.stats.draft_s, last.stats.verify_s, last.stats.cycles,
              last.stats.prefill_s, [a for r in results for a in r.stats.accepted])
    return results, run


# ---------------------------------------------------------------------- side by side
class _Acc:
    """Per-method totals over all batches."""

    def __init__(self):
        self.wall = self.tokens = 0.0
        self.draft = self.verify = None
        self.cycles = 0
        self.prefill = 0.0
        self.accepted: list[int] = []
        self.outputs: list[list[int]] = []

    def add(self, run: Run) -> None:
        self.wall += run.wall_s
        self.tokens += sum(len(t) for t in run.tokens)
        self.outputs += run.tokens
        if run.draft_s is not None:
            self.draft = (self.draft or 0.0) + run.draft_s
            self.verify = (self.verify or 0.0) + run.verify_s
        self.cycles += run.cycles
        self.prefill += run.prefill_s
        self.accepted += run.accepted


#: One method of a side-by-side run: (batch, max_new_tokens, seed, ar's outputs for the
#: batch or None) -> Run. ``ar`` itself must be one of the methods (the reference).
Method = Callable[[list[list[int]], int, int, "list[list[int]] | None"], Run]


def measure_methods(methods: dict[str, Method], prompts: list[list[int]], max_new_tokens: int,
                    batch_size: int = 1, seed: int = 0, warmup_tokens: int = 8,
                    progress: bool = False) -> dict[str, _Acc]:
    """The harness every comparison uses (benchmark, promotion, reference publishing):
    every method once on the first batch, short (allocator, kernels, lazy init), then per
    batch every method in turn, the order rotating from batch to batch so machine noise
    hits all methods alike. Returns per-method totals, for :func:`summarise`."""
    from tqdm import tqdm

    names = list(methods)
    first = prompts[:batch_size]
    warm = min(warmup_tokens, max_new_tokens)
    if warm > 0:  # 0: the caller warmed up already (long prompts make a warm-up costly)
        ar_warm = methods["ar"](first, warm, seed, None).tokens
        for m in names:
            if m != "ar":
                methods[m](first, warm, seed, ar_warm)
    acc = {m: _Acc() for m in names}
    batches = [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]
    bar = tqdm(batches, desc="benchmark", unit="batch", disable=not progress)
    for b, batch in enumerate(bar):
        batch_seed = seed + 1000 * b
        ar_out = None
        for m in _order(names, b):
            run = methods[m](batch, max_new_tokens, batch_seed, ar_out)
            if m == "ar":
                ar_out = run.tokens
            acc[m].add(run)
        bar.set_postfix({m: f"{a.tokens / a.wall:.1f}" for m, a in acc.items() if a.wall})
    return acc


def summarise(acc: dict[str, _Acc], greedy: bool) -> dict:
    """``results`` (one per method), ``exactness`` (greedy identity with ``ar``) and
    ``cost_terms`` (tau vs r_d + r_v + r_o per engine method that drafted)."""
    return {"results": [_result(m, acc) for m in acc], "exactness": _exactness(acc, greedy),
            "cost_terms": _cost_terms(acc)}


def engine_method(target: Target, params: SamplingParams, proposer_factory=None, width: int = 16,
                  stop_ids: frozenset[int] | None = None, oracle: bool = False) -> Method:
    """A method running our engine; ``proposer_factory()`` makes a fresh proposer per batch."""
    def run(batch, n, seed, ar_out):
        proposer = proposer_factory() if proposer_factory is not None else None
        return run_engine(target, batch, n, params, proposer, width, seed, stop_ids,
                          ar_out if oracle else None)[1]
    return run


def _order(methods: list[str], b: int) -> list[str]:
    """Rotate the method order per batch; the oracle always runs after ar (it replays it)."""
    r = b % len(methods)
    order = methods[r:] + methods[:r]
    if "oracle" in order and order.index("oracle") < order.index("ar"):
        order.remove("oracle")
        order.insert(order.index("ar") + 1, "oracle")
    return order


def _result(m: str, acc: dict[str, _Acc]) -> dict:
    """One method's row of ``results``: tokens/s, speedup vs ``ar``, tau and where the time went."""
    a = acc[m]
    tps = a.tokens / a.wall if a.wall else 0.0
    ar = acc.get("ar")
    ar_tps = ar.tokens / ar.wall if ar and ar.wall else None
    engine = a.draft is not None  # our engine (ar included: tau 1, one token a cycle)
    drafted = bool(a.accepted)  # our engine's drafting methods and vllm_dflash
    return {
        "method": m,
        "tokens_per_s": float(tps),
        "speedup_vs_ar": float(tps / ar_tps) if ar_tps else float("nan"),
        "tau_mean": tau_of(a.accepted) if drafted else None,
        "tau_hist": length_histogram(a.accepted) if drafted else None,
        "draft_s": float(a.draft) if engine else None,
        "verify_s": float(a.verify) if engine else None,
        "overhead_s": float(a.wall - a.draft - a.verify) if engine else None,
        # tokens over the wall minus prefill: the steady-state rate batching is about
        "decode_tokens_per_s": float(a.tokens / (a.wall - a.prefill)) if engine and a.wall > a.prefill else None,
    }


def _exactness(acc: dict[str, _Acc], greedy: bool) -> dict:
    """Greedy outputs must equal ``ar`` token for token; sampling makes this moot."""
    out = {"reference": "ar", "applicable": greedy and "ar" in acc, "equal": {}, "first_mismatch": {}}
    if not out["applicable"]:
        return out
    ref = acc["ar"].outputs
    for m, a in acc.items():
        if m == "ar":
            continue
        bad = [(i, next((j for j, (x, y) in enumerate(zip(o, r)) if x != y), min(len(o), len(r))))
               for i, (o, r) in enumerate(zip(a.outputs, ref)) if o != r]
        out["equal"][m] = not bad and len(a.outputs) == len(ref)
        out["first_mismatch"][m] = list(bad[0]) if bad else None  # [prompt index, token index]
    return out


def _cost_terms(acc: dict[str, _Acc]) -> dict:
    """docs/engine.md's S = tau * L_ar / (T_d + T_v + T_o) per cycle; r_x = T_x / L_ar, where
    L_ar is one ``ar`` engine step (for the whole batch) and T_o includes prefill (whose
    share is reported as r_prefill: long prompts with short outputs are prefill-bound)."""
    ar = acc.get("ar")
    if not ar or not ar.cycles:
        return {}
    L = ar.wall / ar.cycles
    out = {"L_ar_s": L}
    for m, a in acc.items():
        if m == "ar" or a.draft is None or not a.cycles:
            continue
        tau = tau_of(a.accepted)
        r_d, r_v = a.draft / a.cycles / L, a.verify / a.cycles / L
        r_o = (a.wall - a.draft - a.verify) / a.cycles / L
        out[m] = {"tau": tau, "r_d": r_d, "r_v": r_v, "r_o": r_o, "r_prefill": a.prefill / a.cycles / L,
                  "cycles": a.cycles, "predicted_speedup": tau / (r_d + r_v + r_o)}
    return out


def machine_info() -> dict:
    """Where the numbers were measured (a report's ``config.machine``)."""
    import transformers

    return {"cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "platform": platform.platform(), "cuda": torch.cuda.is_available()}
