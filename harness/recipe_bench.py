"""Recipe benchmark: held-out acceptance of trained drafters, measured by the real engine,
against the wall-clock hours spent on their data and training (the logic of
``jobs/bench_recipe.py``).

A recipe variant is a finished training run (``<storage_path>/<run_name>``, local). Its
cost is read from what the pipeline recorded: the feature run's wall time (``run.json``
``started_at`` to ``manifest.json`` ``created_at``; for a run resumed after a pause this
includes the pause) and, per checkpoint, the training seconds in ``state.json``. Its
quality is measured here, for each kept checkpoint (Ray Train keeps the best few by
simulated held-out tau, and the latest): the engine benchmark (``harness.bench``, the
same harness as ``jobs/benchmark.py``) runs AR and the drafter side by side on the
ShareGPT holdout and on HumanEval, greedy, and reports tau, exactness and speedup. The
simulated held-out tau of every evaluation (the learning curve) is plotted beside it.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from pipelines.train import CHECKPOINT_PREFIX

log = logging.getLogger(__name__)


class RecipeBenchError(ValueError):
    """A user error (missing run, bad variant spec), shown as one line."""


@dataclass
class Variant:
    name: str
    run: Path  # a training run directory

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        """``NAME=RUN_DIR`` or just ``RUN_DIR`` (named after the directory)."""
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        run = Path(path).expanduser()
        if not run.is_dir():
            raise RecipeBenchError(f"training run not found: {run}")
        return cls(name or run.name, run)


@dataclass
class RecipeBenchConfig:
    variants: list[Variant]
    prompt_sets: list[str] = field(default_factory=lambda: ["sharegpt", "humaneval"])
    num_prompts: int = 10
    max_new_tokens: int = 64
    checkpoints: str = "kept"  # "kept": every kept checkpoint; "best": the exported drafter only
    threads: int | None = None
    target: str | None = None  # None: the embedded SmolLM2
    tracking_uri: str | None = None  # log the table to MLflow (experiment "recipe-bench")
    progress: bool = True

    def __post_init__(self):
        if not self.variants:
            raise RecipeBenchError("give at least one --variant NAME=RUN_DIR")
        if self.checkpoints not in ("kept", "best"):
            raise RecipeBenchError(f"--checkpoints must be 'kept' or 'best', got {self.checkpoints!r}")
        if self.num_prompts < 1 or self.max_new_tokens < 1:
            raise RecipeBenchError("--num-prompts and --max-new-tokens must be >= 1")


# ---------------------------------------------------------------------------- costs
def _ts(s: str) -> float:
    return datetime.fromisoformat(s).timestamp()


def data_cost(features_uri: str | None) -> dict:
    """What the feature run(s) cost and hold (a lineage's ``features_uri`` is comma-separated
    when several runs were trained on together); zeros when one cannot be read, e.g. online runs."""
    out = {"features": features_uri, "data_hours": 0.0, "samples": None, "response_tokens": None}
    if not features_uri or "://" in features_uri:
        return out
    hours = samples = tokens = 0
    for root in map(Path, features_uri.split(",")):
        try:
            manifest = json.loads((root / "manifest.json").read_text())
            run = json.loads((root / "run.json").read_text())
        except (OSError, ValueError):
            return out
        hours += max(0.0, _ts(manifest["created_at"]) - _ts(run["started_at"])) / 3600
        samples += manifest.get("num_samples") or 0
        tokens += manifest.get("num_response_tokens") or 0
    out.update(data_hours=hours, samples=samples, response_tokens=tokens)
    return out


def _states(run: Path) -> list[tuple[Path, dict]]:
    """Every readable checkpoint of a run with its ``state.json``, oldest first."""
    out = []
    for d in sorted(run.glob(f"{CHECKPOINT_PREFIX}*")):
        try:
            out.append((d, json.loads((d / "state.json").read_text())))
        except (OSError, ValueError):
            continue  # a checkpoint being written or deleted
    return out


def checkpoints(run: Path, which: str = "kept", states: list[tuple[Path, dict]] | None = None) -> list[dict]:
    """``[{step, train_hours, sim_tau, drafter}]`` of a run, oldest first."""
    found = []
    for d, state in states if states is not None else _states(run):
        rec = next((h for h in reversed(state.get("history", [])) if h["step"] == state["step"]), {})
        found.append({"step": state["step"], "train_hours": state.get("train_seconds", 0.0) / 3600,
                      "sim_tau": rec.get("holdout_tau"), "drafter": str(d / "drafter")})
    if which == "best":
        exported = run / "drafter"
        if not (exported / "config.json").is_file():
            raise RecipeBenchError(f"{run} has no exported drafter (did the run finish?)")
        step = json.loads((exported / "config.json").read_text()).get("dflash_ray", {}).get("best_step")
        match = [c for c in found if c["step"] == step]
        best = match[0] if match else {"step": step, "train_hours": None, "sim_tau": None}
        return [dict(best, drafter=str(exported))]
    if not found:
        raise RecipeBenchError(f"{run} holds no checkpoint")
    return found


# ---------------------------------------------------------------------------- the benchmark
def run_recipe_bench(cfg: RecipeBenchConfig) -> dict:
    from harness.bench import BenchConfig, run_benchmark
    from specdec.bench import load_target_checked

    t0 = time.perf_counter()
    target = load_target_checked(cfg.target)
    rows, curves = [], {}
    for v in cfg.variants:
        exported = v.run / "drafter" / "config.json"
        lineage = json.loads(exported.read_text()).get("dflash_ray", {}) if exported.is_file() else {}
        cost = data_cost(lineage.get("features_uri"))
        states = _states(v.run)  # the newest one's history is the whole learning curve
        history = states[-1][1].get("history", []) if states else []
        curves[v.name] = {"data_hours": cost["data_hours"], "history": history}
        for ck in checkpoints(v.run, cfg.checkpoints, states):
            row = {"variant": v.name, "step": ck["step"], **cost, "train_hours": ck["train_hours"],
                   "sim_tau": ck["sim_tau"]}
            row["hours"] = cost["data_hours"] + (ck["train_hours"] or 0.0)
            for prompts in cfg.prompt_sets:
                log.info("%s step %s on %s", v.name, ck["step"], prompts)
                report = run_benchmark(BenchConfig(target=cfg.target, drafter=ck["drafter"], prompts=prompts,
                                                   num_prompts=cfg.num_prompts, max_new_tokens=cfg.max_new_tokens,
                                                   methods=["ar", "dflash"], threads=cfg.threads,
                                                   progress=cfg.progress), target=target)
                res = {r["method"]: r for r in report["results"]}["dflash"]
                key = prompt_label(prompts)
                row[f"{key}_tau"] = res["tau_mean"]
                row[f"{key}_speedup"] = res["speedup_vs_ar"]
                row[f"{key}_exact"] = report["exactness"]["equal"]["dflash"]
            rows.append(row)
    return {"config": {"variants": {v.name: str(v.run) for v in cfg.variants}, "prompt_sets": cfg.prompt_sets,
                       "num_prompts": cfg.num_prompts, "max_new_tokens": cfg.max_new_tokens,
                       "checkpoints": cfg.checkpoints, "greedy": True},
            "rows": rows, "curves": curves, "seconds": round(time.perf_counter() - t0, 1)}


def prompt_label(source: str) -> str:
    """A short name for a prompt set: ``sharegpt``, ``humaneval`` or a file's stem."""
    return source if source in ("sharegpt", "humaneval") else Path(source).stem


def format_table(report: dict) -> str:
    sets = [prompt_label(p) for p in report["config"]["prompt_sets"]]
    head = ["variant", "step", "data h", "train h", "total h", "sim tau"]
    head += [f"{s} tau" for s in sets] + [f"{s} x AR" for s in sets] + ["exact"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    f = lambda x, p=3: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    for r in report["rows"]:
        cells = [r["variant"], str(r["step"]), f(r["data_hours"], 2), f(r["train_hours"], 2), f(r["hours"], 2),
                 f(r["sim_tau"])]
        cells += [f(r[f"{s}_tau"]) for s in sets] + [f(r[f"{s}_speedup"], 2) for s in sets]
        cells.append("yes" if all(r[f"{s}_exact"] for s in sets) else "NO")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    sets = [prompt_label(p) for p in report["config"]["prompt_sets"]]
    for i, (name, curve) in enumerate(report["curves"].items()):
        color = f"C{i}"
        hist = [h for h in curve["history"] if h.get("holdout_tau") is not None]
        if hist:
            ax.plot([curve["data_hours"] + h.get("train_seconds", 0) / 3600 for h in hist],
                    [h["holdout_tau"] for h in hist], color=color, alpha=0.4, ls="--", label=f"{name}: simulated")
        mine = sorted((r for r in report["rows"] if r["variant"] == name), key=lambda r: r["hours"])
        for s, marker in zip(sets, "os^v"):
            pts = [(r["hours"], r[f"{s}_tau"]) for r in mine if r[f"{s}_tau"] is not None]
            if pts:
                ax.plot(*zip(*pts), color=color, marker=marker, label=f"{name}: engine, {s}")
    ax.set_xlabel("wall-clock hours on this machine (data + training)")
    ax.set_ylabel("held-out tau (accepted tokens per cycle)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def log_to_mlflow(report: dict, tracking_uri: str | None, files: tuple[Path, Path]) -> str:
    """One MLflow run in experiment ``recipe-bench``: a metric per variant/step/prompt set."""
    from pipelines import registry

    metrics = {}
    for r in report["rows"]:
        for key in [k for k in r if k.endswith(("_tau", "_speedup"))] + ["hours"]:
            if isinstance(r.get(key), (int, float)):
                metrics[f"{r['variant']}.step{r['step']}.{key}"] = r[key]
    return registry.log_benchmark(tracking_uri, "recipe-bench", metrics, files)
