"""Learning curves of training runs: held-out tau against training samples, as JSON and
PNG (written at the end of every run, and by ``jobs/bench_train.py curve`` for any run)."""

from __future__ import annotations

import json
from pathlib import Path


def write_learning_curve(history: list[dict], out_dir: str | Path, title: str = "held-out tau") -> dict:
    """``learning_curve.json`` (one point per evaluation) and ``learning_curve.png``
    (held-out and training tau against training samples) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = ("step", "epoch", "samples", "holdout_tau", "holdout_loss", "holdout_acc", "train_tau", "train_loss",
            "block_tokens_per_s", "train_seconds")
    points = [{k: rec.get(k) for k in keys} for rec in history]
    (out / "learning_curve.json").write_text(json.dumps({"title": title, "points": points}, indent=1))
    paths = {"json": str(out / "learning_curve.json")}
    if points:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
        xs = [p["samples"] for p in points]
        ax.plot(xs, [p["holdout_tau"] for p in points], "o-", label="held-out tau")
        train = [(p["samples"], p["train_tau"]) for p in points if p.get("train_tau") is not None]
        if train:
            ax.plot(*zip(*train), "s--", alpha=0.6, label="training tau (since previous eval)")
        ax.set_xlabel("training samples")
        ax.set_ylabel("tau (accepted tokens / cycle)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "learning_curve.png")
        plt.close(fig)
        paths["png"] = str(out / "learning_curve.png")
    return paths


def run_history(run_uri: str, storage_options: dict | None = None) -> list[dict]:
    """The evaluation history of a run, from its newest checkpoint."""
    from pipelines.train.runner import latest_checkpoint_state

    state, _ = latest_checkpoint_state(run_uri, storage_options or {})
    if state is None:
        raise FileNotFoundError(f"no checkpoint under {run_uri}")
    return state.history
