"""Training benchmarks (logic: harness/train_bench.py).

    python jobs/bench_train.py throughput --workers 1,2 --out runs/bench/train_throughput.json
    python jobs/bench_train.py curve --run runs/train/smollm2-135m-dflash --out runs/bench/curve

``throughput`` runs the real training loop (DDP on CPU) on synthetic rows in the SmolLM2
recipe's shapes (embedded target's embedding and LM head, 5 feature layers, 2 draft
layers, B=8, 32 anchors, 4 sequences of 280 tokens per worker step) with each worker
count, and reports block tokens/s and the time one epoch of the recipe (912 rows) takes.
``curve`` writes the learning curve (held-out tau against training samples) of a run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("throughput", help="block tokens/s of the training loop per worker count")
    t.add_argument("--workers", default="1,2", help="comma-separated worker counts (default: 1,2)")
    t.add_argument("--steps", type=int, default=4, help="measured steps per worker count (after as many warm-up)")
    t.add_argument("--batch-size", type=int, default=4)
    t.add_argument("--num-anchors", type=int, default=32)
    t.add_argument("--block-size", type=int, default=8)
    t.add_argument("--draft-layers", type=int, default=2)
    t.add_argument("--prompt-tokens", type=int, default=120)
    t.add_argument("--response-tokens", type=int, default=160)
    t.add_argument("--threads-per-worker", type=int, default=1)
    t.add_argument("--target", default=None, help="target dir (default: the embedded SmolLM2-135M-Instruct)")
    t.add_argument("--out", default="runs/bench/train_throughput.json")
    c = sub.add_parser("curve", help="learning curve (held-out tau vs training samples) of a run")
    c.add_argument("--run", required=True, help="<train.storage_path>/<train.run_name> (local or s3://)")
    c.add_argument("--out", default="runs/bench/curve")
    args = ap.parse_args(argv)

    from harness import train_bench
    from pipelines.train import curves

    if args.cmd == "curve":
        paths = curves.write_learning_curve(curves.run_history(args.run), args.out,
                                            title=f"{Path(args.run).name}: held-out tau")
        print(json.dumps(paths, indent=1))
        return 0

    import ray

    cfg = train_bench.ThroughputConfig(
        target=args.target, num_layers=args.draft_layers, block_size=args.block_size, num_anchors=args.num_anchors,
        batch_size=args.batch_size, prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens,
        steps=args.steps, workers=tuple(int(w) for w in args.workers.split(",")),
        threads_per_worker=args.threads_per_worker)
    ray.init(log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as storage:
        report = train_bench.measure_throughput(cfg, storage)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(train_bench.format_throughput(report))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
