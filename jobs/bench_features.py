"""Feature-stage benchmark (logic: harness/features_bench.py).

    python jobs/bench_features.py --out runs/bench/features.json
    python jobs/bench_features.py --scale --out runs/bench/features_scale.json

Reports extraction throughput as a fraction of a bare batched teacher-forced forward of
the same model (measured in the same run), stored bytes per token against
tokens x layers x hidden x bytes, and the storage projection for Qwen3-8B at 800K samples.
``--scale`` (harness/features_scale_bench.py) runs the whole vLLM feature job at 1x and 8x
prompts: work and wall per token, the driver's added RSS, and how far generation and
extraction overlap.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness/ sits beside jobs/


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-ray", action="store_true", help="skip the timing through a real Ray Data actor")
    ap.add_argument("--out", help="write the result JSON here too")
    ap.add_argument("--scale", action="store_true", help="the vLLM feature job at 1x and --factor x --prompts")
    ap.add_argument("--config", default="configs/smollm2-135m-reference.yaml", help="--scale: the recipe")
    ap.add_argument("--prompts", type=int, default=16, help="--scale: prompts at 1x")
    ap.add_argument("--factor", type=int, default=8, help="--scale: the larger run's multiple")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="--scale: tokens generated per prompt")
    ap.add_argument("--samples-per-shard", type=int, default=8, help="--scale: shard size")
    args = ap.parse_args(argv)
    if args.scale:
        from harness.features_scale_bench import run_scale, scale_table

        result = run_scale(args.config, args.prompts, args.factor, args.max_new_tokens, args.samples_per_shard)
        print(scale_table(result))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return 0

    from harness.features_bench import run_bench

    result = run_bench(args.sequences, args.max_tokens, args.batch_size, args.rounds, with_ray=not args.no_ray)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
