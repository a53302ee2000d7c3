"""Recipe benchmark: held-out tau (real engine, ShareGPT holdout and HumanEval) of trained
drafters against the wall-clock hours their data and training took; one line per variant.

    python jobs/bench_recipe.py --variant "regenerated=runs/train/smollm2-135m-ref" \
        --variant "cpu-recipe=runs/train/smollm2-135m-cpu" --out runs/bench/recipe

Each variant is a finished training run directory. Prints a table, writes X.json and X.png
(tau vs hours), and logs both to MLflow (experiment recipe-bench). Logic: harness/recipe_bench.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.recipe_bench import (RecipeBenchConfig, RecipeBenchError, Variant, format_table,  # noqa: E402
                                  log_to_mlflow, plot, run_recipe_bench)
from pipelines.report import write_report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], help="NAME=RUN_DIR (repeatable)")
    ap.add_argument("--prompts", default="sharegpt,humaneval", help="comma list of prompt sets")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--checkpoints", default="kept", help="kept (every kept checkpoint) | best (exported drafter)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tracking-uri", default=None, help="MLflow (default: $MLFLOW_TRACKING_URI or sqlite here)")
    ap.add_argument("--no-mlflow", action="store_true")
    ap.add_argument("--out", default="runs/bench/recipe", help="write X.json and X.png")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        cfg = RecipeBenchConfig([Variant.parse(v) for v in args.variant],
                                [p.strip() for p in args.prompts.split(",") if p.strip()],
                                num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                                checkpoints=args.checkpoints, threads=args.threads, tracking_uri=args.tracking_uri,
                                progress=sys.stderr.isatty())
        report = run_recipe_bench(cfg)
    except RecipeBenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(report))
    files = write_report(report, args.out, plot)
    print(f"wrote {files[0]} and {files[1]}")
    if not args.no_mlflow:
        print(f"MLflow run {log_to_mlflow(report, args.tracking_uri, files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
