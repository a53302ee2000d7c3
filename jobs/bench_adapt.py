"""Traffic-adaptation benchmark: serve a domain the reference drafter never saw (code questions
from Python's standard library) with capture on, adapt the drafter to the captured traffic with
one pass of jobs/adapt_drafter.py, then measure reference and adapted drafter side by side.

    python jobs/bench_adapt.py --out runs/bench/adapt                       # the goal's run (<= 2 h here)
    python jobs/bench_adapt.py --requests 64 --holdout 8 --eval-prompts 4 --out runs/bench/adapt-smoke \
        --set train.epochs=1 --set train.num_anchors=64                    # a few minutes: the wiring

Prints a table (tau and speedup vs AR per prompt set and drafter, the goal's ratios, seconds per
stage), writes X.json and X.png under --out. Logic: harness/adapt_bench.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.adapt_bench import AdaptBenchConfig, AdaptBenchError, format_table, plot, run_adapt_bench  # noqa: E402
from pipelines.report import write_report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/adapt", help="work folder; X.json and X.png are written here")
    ap.add_argument("--requests", type=int, default=1500, help="served and captured requests")
    ap.add_argument("--holdout", type=int, default=24, help="code questions never served (the domain set)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--backend", default="vllm", choices=("hf", "vllm"))
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--eval-tokens", type=int, default=96)
    ap.add_argument("--port", type=int, default=8013)
    ap.add_argument("--recipe", default="configs/smollm2-135m-adapt.yaml", help="the adaptation recipe")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override the adaptation recipe, e.g. train.epochs=2 (repeatable)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the progress
    for name in ("requests", "holdout", "concurrency", "max_tokens", "eval_prompts", "eval_tokens"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    cfg = AdaptBenchConfig(Path(args.out).absolute(), requests=args.requests, holdout=args.holdout,
                           concurrency=args.concurrency, max_tokens=args.max_tokens, backend=args.backend,
                           eval_prompts=args.eval_prompts, eval_tokens=args.eval_tokens, port=args.port,
                           adapt_sets=args.set, recipe=args.recipe)
    try:
        report = run_adapt_bench(cfg)
    except AdaptBenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(report))
    files = write_report(report, cfg.out / "bench_adapt", plot)
    print(f"wrote {files[0]} and {files[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
