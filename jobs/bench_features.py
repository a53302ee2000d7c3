"""Feature-stage benchmark (logic: harness/features_bench.py).

    python jobs/bench_features.py --out runs/bench/features.json

Reports extraction throughput as a fraction of a bare batched teacher-forced forward of
the same model (measured in the same run), stored bytes per token against
tokens x layers x hidden x bytes, and the storage projection for Qwen3-8B at 800K samples.
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
    args = ap.parse_args(argv)

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
