"""Evaluation by context length (the logic of ``jobs/bench_longctx.py``).

For each context bucket of the embedded long-context set (``longctx`` holdout prompts:
long documents followed by a question, about 1K/2K/4K/8K tokens) every drafter variant
runs side by side with plain AR through the one benchmark harness
(``specdec.bench.measure_methods``), greedy, so each variant's output is checked
token-identical to AR. Per bucket and variant: tau, speedup vs AR, draft time per cycle
(what sliding-window draft attention keeps flat) and the most draft K/V memory held.

Variants are named drafters (``short=specdec/drafters/smollm2-135m``, ``long=models:/...``)
and, with ``window``, each of them again with sliding-window draft attention of that size
(``short+w1024``): same weights, context bounded to the last W positions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench import BenchError, engine_method, load_drafter_for, load_target_checked, measure_methods, summarise
from specdec.longctx import BUCKETS, longctx_bucket
from specdec.proposers import DFlashProposer
from specdec.sampling import GREEDY

#: the plot's panels: (result key, axis label)
PANELS = (("tau", "tau (accepted tokens per cycle)"), ("speedup", "speedup vs AR"),
          ("draft_ms_per_cycle", "draft ms per cycle"), ("draft_kv_mb", "peak draft K/V (MB)"))


@dataclass
class ContextBenchConfig:
    drafters: dict[str, str]  # variant name -> drafter directory or models:/ URI
    target: str | None = None  # None: the embedded SmolLM2
    window: int | None = None  # also run every drafter with this sliding window
    buckets: list[int] = field(default_factory=lambda: list(BUCKETS))  # thousands of tokens
    # "longctx" (the embedded set, holdout split) or any prompt source (a LongAlign JSONL of
    # 16K-64K conversations on a GPU...): prompts go to bucket b when b/2 K < tokens <= b K
    prompts: str = "longctx"
    prompts_per_bucket: int = 2
    max_new_tokens: int = 64
    block_size: int | None = None  # None: the first drafter's own B
    tracking_uri: str | None = None  # for models:/ drafters
    threads: int | None = None
    progress: bool = False

    def __post_init__(self):
        if not self.drafters:
            raise BenchError("give at least one drafter (NAME=DIR or NAME=models:/name@alias)")
        bad = [b for b in self.buckets if b not in BUCKETS]
        if bad and self.prompts == "longctx":
            raise BenchError(f"buckets {bad} are not in the long-context set's {list(BUCKETS)} (thousands of tokens); "
                             "bring longer prompts with --prompts FILE")
        if any(not isinstance(b, int) or b < 1 for b in self.buckets):
            raise BenchError(f"buckets must be positive ints (thousands of tokens), got {self.buckets}")
        if self.prompts_per_bucket < 1 or self.max_new_tokens < 1:
            raise BenchError("--prompts-per-bucket and --max-new-tokens must be >= 1")


def load_variants(cfg: ContextBenchConfig, target) -> dict:
    """name -> drafter, with the windowed copies when ``cfg.window`` is set."""
    from specdec.drafter import with_window

    out = {}
    for name, source in cfg.drafters.items():
        if source.startswith("models:/"):
            from pipelines import registry

            try:
                source = str(registry.resolve_drafter(registry.resolve_tracking_uri(cfg.tracking_uri), source)[0])
            except Exception as e:  # noqa: BLE001 - NotFound, unreachable server: one line
                raise BenchError(f"drafter {name}: {e}") from None
        out[name] = load_drafter_for(source, target)
    if cfg.window:
        for name in list(out):
            try:
                out[f"{name}+w{cfg.window}"] = with_window(out[name], cfg.window)
            except ValueError as e:
                raise BenchError(f"--window: {e}") from None
    return out


def bucket_prompts(target, buckets: list[int], n: int, source: str = "longctx",
                   ) -> dict[int, tuple[list[str], list[list[int]]]]:
    """The first ``n`` prompts of each bucket, templated: the embedded set's held-out
    prompts by their bucket, or any source's by length (b/2 K < tokens <= b K)."""
    from specdec.prompts import load_prompts

    try:
        prompts = load_prompts(source, split="holdout" if source == "longctx" else "all",
                               max_prompt_chars=None)
    except (FileNotFoundError, ValueError) as e:
        raise BenchError(f"cannot read prompts {source!r}: {e}") from None
    out: dict[int, tuple[list[str], list[list[int]]]] = {b: ([], []) for b in buckets}
    for p in prompts:
        if all(len(ids) >= n for ids, _ in out.values()):
            break
        b = longctx_bucket(p.id) if source == "longctx" else None
        if source == "longctx" and (b not in out or len(out[b][0]) >= n):
            continue  # a bucket not asked for, or full: not worth templating
        tokens = target.encode_chat(p.messages)
        if source != "longctx":
            b = next((b for b in buckets if b * 512 < len(tokens) <= b * 1024), None)
        if b is None or len(out[b][0]) >= n or len(tokens) >= target.max_positions:
            continue
        out[b][0].append(p.id)
        out[b][1].append(tokens)
    empty = [b for b, (ids, _) in out.items() if not ids]
    if empty:
        raise BenchError(f"no prompts of {source!r} in the bucket(s) {empty}K (that fit the target's context "
                         f"of {target.max_positions})")
    return out


def run_context_bench(cfg: ContextBenchConfig) -> dict:
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    target = load_target_checked(cfg.target)
    variants = load_variants(cfg, target)
    K = cfg.block_size or int(next(iter(variants.values())).config.block_size)
    stop = frozenset()  # every method makes exactly max_new_tokens (same work, comparable rates)
    proposers: dict[str, list[DFlashProposer]] = {}

    def factory(name, drafter):
        def make():
            proposers.setdefault(name, []).append(DFlashProposer(drafter, target))
            return proposers[name][-1]
        return make

    methods = {"ar": engine_method(target, GREEDY, None, K, stop)}
    methods.update({name: engine_method(target, GREEDY, factory(name, d), K, stop) for name, d in variants.items()})
    prompts = bucket_prompts(target, cfg.buckets, cfg.prompts_per_bucket, cfg.prompts)
    # warm up once, on the shortest prompt: a warm-up per bucket would prefill 8K tokens per method
    first = min((p for _, ps in prompts.values() for p in ps), key=len)
    measure_methods(methods, [first], 4, warmup_tokens=0)
    rows = []
    for b, (ids, batch) in prompts.items():
        proposers.clear()
        report = summarise(measure_methods(methods, batch, cfg.max_new_tokens, 1, 0, warmup_tokens=0,
                                           progress=cfg.progress), greedy=True)
        by = {r["method"]: r for r in report["results"]}
        for name in variants:
            terms = report["cost_terms"].get(name, {})
            cycles = terms.get("cycles") or 0
            rows.append({
                "bucket_k": b, "variant": name, "prompts": ids,
                "context_tokens": sum(map(len, batch)) / len(batch),
                "tau": by[name]["tau_mean"], "speedup": by[name]["speedup_vs_ar"],
                "tokens_per_s": by[name]["tokens_per_s"], "ar_tokens_per_s": by["ar"]["tokens_per_s"],
                "draft_ms_per_cycle": 1000 * by[name]["draft_s"] / cycles if cycles else None,
                "draft_kv_mb": max(p.peak_kv_bytes for p in proposers.get(name, [])) / 2**20
                if proposers.get(name) else None,
                "exact": report["exactness"]["equal"].get(name),
            })
    return {"config": {"drafters": cfg.drafters, "window": cfg.window, "buckets": cfg.buckets, "prompts": cfg.prompts,
                       "prompts_per_bucket": cfg.prompts_per_bucket, "max_new_tokens": cfg.max_new_tokens,
                       "block_size": K, "target": target.model_id, "greedy": True},
            "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}


def format_table(report: dict) -> str:
    head = ["bucket", "context tok", "variant", "tau", "x AR", "draft ms/cycle", "draft KV MB", "exact"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    for r in report["rows"]:
        lines.append(" | ".join([f"{r['bucket_k']}K", f"{r['context_tokens']:.0f}", r["variant"], f(r["tau"], 3),
                                 f(r["speedup"]), f(r["draft_ms_per_cycle"], 1), f(r["draft_kv_mb"], 1),
                                 "yes" if r["exact"] else "NO"]))
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    variants = list(dict.fromkeys(r["variant"] for r in report["rows"]))
    for ax, (key, label) in zip(axes.flat, PANELS):
        for i, name in enumerate(variants):
            pts = [(r["context_tokens"], r[key]) for r in report["rows"] if r["variant"] == name and r[key] is not None]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", color=f"C{i}", ls="--" if "+w" in name else "-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes.flat[1].axhline(1.0, color="gray", lw=0.8)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"by context length: {report['config']['target']}, B={report['config']['block_size']}, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def log_to_mlflow(report: dict, tracking_uri: str | None, files: tuple[Path, Path]) -> str:
    """One run in experiment ``context-bench``: a metric per variant, bucket and quantity."""
    from pipelines import registry

    metrics = {f"{r['variant']}.{r['bucket_k']}k.{key}": r[key] for r in report["rows"]
               for key, _ in PANELS if isinstance(r.get(key), (int, float))}
    return registry.log_benchmark(tracking_uri, "context-bench", metrics, files, params=report["config"])
