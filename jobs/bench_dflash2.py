"""DFlash vs DFlash2 on the same data, same epochs: train both, then measure side by side
(held-out simulated tau, engine tau, exactness, draft / verify / overhead cost per cycle in
AR steps, each one's training wall-clock). Logic: harness/dflash2_bench.py.

    python jobs/generate_features.py --config configs/smollm2-135m-reference.yaml \
        --set features.prompts.limit=480 --set features.output=runs/features/dflash2-bench
    python jobs/bench_dflash2.py --config configs/smollm2-135m-reference.yaml \
        --features runs/features/dflash2-bench --epochs 5 --set train.eval_every=0 \
        --out runs/bench/dflash2.json
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/smollm2-135m-reference.yaml", help="training recipe (both archs)")
    ap.add_argument("--features", required=True, help="a committed feature run of the recipe's target")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override (both runs)")
    ap.add_argument("--prefix", default="dflash2-bench", help="run names: PREFIX-dflash, PREFIX-dflash2")
    ap.add_argument("--num-prompts", type=int, default=16, help="held-out ShareGPT prompts for the engine")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="runs/bench/dflash2.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from harness.dflash2_bench import format_summary, run

    result = run(args.config, args.features, args.epochs, args.num_prompts, args.max_new_tokens, args.out,
                 args.prefix, args.set)
    print(format_summary(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
