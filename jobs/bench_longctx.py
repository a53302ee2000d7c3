"""Evaluation by context length: tau, speedup vs AR, draft time per cycle and draft K/V
memory of drafters on the embedded long-context set (held-out prompts of about 1K, 2K, 4K
and 8K tokens), side by side with AR, greedy (every output checked identical to AR).

    python jobs/bench_longctx.py --drafter short=specdec/drafters/smollm2-135m \\
        --drafter long=runs/train/smollm2-135m-longalign/drafter --window 1024 --out runs/bench/longctx

--window W adds every drafter again with sliding-window draft attention of W positions
("short+w1024"). Prints a table, writes X.json and X.png, logs both to MLflow (experiment
context-bench). Logic: harness/context_bench.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download at run time
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.context_bench import ContextBenchConfig, format_table, log_to_mlflow, plot, run_context_bench  # noqa: E402
from pipelines.report import write_report  # noqa: E402
from specdec.bench import BenchError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", action="append", default=[], help="NAME=DIR or NAME=models:/name@alias (repeatable)")
    ap.add_argument("--target", default=None, help="target dir or id (default: embedded SmolLM2)")
    ap.add_argument("--window", type=int, default=None, help="also run each drafter with this sliding window")
    ap.add_argument("--buckets", default="1,2,4,8", help="context buckets, thousands of tokens")
    ap.add_argument("--prompts", default="longctx", help="longctx (embedded, 1K-8K) or a prompt file (a LongAlign "
                    "JSONL...): bucket b takes prompts of b/2 K to b K tokens, e.g. --buckets 16,32,64 on a GPU")
    ap.add_argument("--prompts-per-bucket", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=None, help="default: the first drafter's own")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tracking-uri", default=None, help="MLflow (default: $MLFLOW_TRACKING_URI or sqlite here)")
    ap.add_argument("--no-mlflow", action="store_true")
    ap.add_argument("--out", default="runs/bench/longctx", help="write X.json and X.png")
    args = ap.parse_args(argv)
    try:
        drafters = dict(_pair(s) for s in args.drafter) or {"reference": _reference()}
        cfg = ContextBenchConfig(drafters, args.target, args.window, [int(b) for b in args.buckets.split(",")],
                                 args.prompts, args.prompts_per_bucket, args.max_new_tokens, args.block_size,
                                 args.tracking_uri, args.threads, progress=sys.stderr.isatty())
        report = run_context_bench(cfg)
    except (BenchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(report))
    files = write_report(report, args.out, plot)
    print(f"wrote {files[0]} and {files[1]} ({report['seconds']:.0f} s)")
    if not args.no_mlflow:
        print(f"MLflow run {log_to_mlflow(report, args.tracking_uri, files)}")
    return 0


def _pair(spec: str) -> tuple[str, str]:
    name, sep, source = spec.partition("=")
    if not sep or not name or not source:
        raise BenchError(f"--drafter expects NAME=DIR or NAME=models:/..., got {spec!r}")
    return name, source


def _reference() -> str:
    from specdec.assets import reference_drafter_for

    ref = reference_drafter_for(None)
    if ref is None:
        raise BenchError("no --drafter given and no reference drafter is packaged")
    return str(ref)


if __name__ == "__main__":
    sys.exit(main())
