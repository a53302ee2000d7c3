"""DFlash vs DFlash2 side by side on the same data (logic of ``jobs/bench_dflash2.py``).

One recipe (the reference recipe by default), one committed feature run, the same epochs:
a DFlash drafter and a DFlash2 drafter (``drafter.arch: dflash2``) are trained one after the
other (each one's wall-clock reported), then measured side by side by the promotion harness
(``pipelines.evaluate.measure``: the target alone and both drafters on the same held-out
prompts, greedy, interleaved): held-out simulated tau (training's evaluation), engine tau,
exactness, and the cost of a cycle in AR steps (r_d draft, r_v verify, r_o overhead).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

ARCHS = ("dflash", "dflash2")


def train_both(config: str, features: str, epochs: int, prefix: str, overrides: list[str]) -> dict[str, dict]:
    """Train one drafter per architecture on ``features``; per arch: wall-clock, held-out
    simulated tau (best evaluation) and its curve, the exported drafter directory."""
    from pipelines.train import fit
    from pipelines.train.config import load_train_recipe

    out = {}
    for arch in ARCHS:
        recipe = load_train_recipe(config, [f"train.features={features}", f"train.epochs={epochs}",
                                            "registry.register=false", *overrides,
                                            f"train.run_name={prefix}-{arch}", f"drafter.arch={arch}"])
        t0 = time.perf_counter()
        res = fit(recipe)
        out[arch] = {"train_wall_s": time.perf_counter() - t0, "steps": res.steps,
                     "holdout_tau": res.holdout_tau, "best_step": res.best_step,
                     "curve": [(h["step"], h["holdout_tau"]) for h in res.history],
                     "drafter_dir": res.drafter_dir}
    return out


def measure_both(trained: dict[str, dict], num_prompts: int, max_new_tokens: int, prompts: str = "sharegpt",
                 target=None) -> dict:
    """Both drafters and the target alone side by side (``pipelines.evaluate.measure``)."""
    from pipelines import evaluate
    from specdec.bench import load_prompt_ids
    from specdec.checkpoint import load_drafter
    from specdec.target import load_target

    target = target or load_target(None)
    cands = []
    for role, arch in zip(("champion", "challenger"), ARCHS):
        d = load_drafter(trained[arch]["drafter_dir"], target=target)
        cands.append(evaluate.Candidate(f"{arch}", role, arch, d, d.config.block_size))
    ids, ps = load_prompt_ids(target, prompts, num_prompts)
    return evaluate.measure(target, cands, ps, ids, max_new_tokens, prompts)


def summary(trained: dict[str, dict], report: dict) -> dict:
    """Per arch: train wall-clock, simulated and engine tau, exactness, r_d / r_v / r_o; and
    DFlash2's ratios to DFlash (the issue's goals: tau >= 1.1x, draft cost within 10%)."""
    rows = {}
    for arch in ARCHS:
        res = next(r for r in report["results"] if r["method"] == arch)
        cost = report["cost_terms"].get(arch, {})
        rows[arch] = {"train_wall_s": round(trained[arch]["train_wall_s"], 1), "steps": trained[arch]["steps"],
                      "holdout_tau_simulated": trained[arch]["holdout_tau"], "engine_tau": res["tau_mean"],
                      "exact": report["exactness"]["equal"][arch], "speedup_vs_ar": res["speedup_vs_ar"],
                      **{k: cost.get(k) for k in ("r_d", "r_v", "r_o")}}
    a, b = rows["dflash"], rows["dflash2"]
    ratio = lambda x, y: (y / x) if x and y is not None else None  # noqa: E731
    return {"rows": rows, "dflash2_over_dflash": {
        "holdout_tau_simulated": ratio(a["holdout_tau_simulated"], b["holdout_tau_simulated"]),
        "engine_tau": ratio(a["engine_tau"], b["engine_tau"]), "r_d": ratio(a["r_d"], b["r_d"]),
        "train_wall_s": ratio(a["train_wall_s"], b["train_wall_s"])}}


def run(config: str, features: str, epochs: int, num_prompts: int, max_new_tokens: int, out: str,
        prefix: str = "dflash2-bench", overrides: list[str] | None = None) -> dict:
    """Train both, measure both, write ``out`` (JSON: summary, curves, the full report)."""
    trained = train_both(config, features, epochs, prefix, list(overrides or []))
    report = measure_both(trained, num_prompts, max_new_tokens)
    result = {"summary": summary(trained, report), "trained": trained, "report": report,
              "settings": {"config": config, "features": features, "epochs": epochs, "num_prompts": num_prompts,
                           "max_new_tokens": max_new_tokens, "overrides": list(overrides or [])}}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2, default=str))
    return result


def format_summary(result: dict) -> str:
    """A table of the summary rows and the ratios."""
    s = result["summary"]
    keys = ("train_wall_s", "steps", "holdout_tau_simulated", "engine_tau", "exact", "speedup_vs_ar", "r_d", "r_v",
            "r_o")
    lines = [f"{'':8}" + "".join(f"{k:>22}" for k in keys)]
    for arch, row in s["rows"].items():
        lines.append(f"{arch:8}" + "".join(f"{_fmt(row[k]):>22}" for k in keys))
    lines.append("dflash2 / dflash: " + ", ".join(f"{k} {_fmt(v)}" for k, v in s["dflash2_over_dflash"].items()))
    return "\n".join(lines)


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)
