"""A benchmark report's files: the JSON and a PNG beside it. Every benchmark writes its
files through :func:`write_report` (promotion's evaluation, ``pipelines/evaluate.py``, and
the harness's benchmarks); :func:`plot_report` is the default plot, for reports in the
engine benchmark's schema (``results`` with ``tokens_per_s`` and ``tau_hist``)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path


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
    """Throughput per method beside the accepted-length histogram of each drafting method."""
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
