"""Benchmark the speculative engine against HF generate, AR, prompt lookup and the oracle.

    python jobs/benchmark.py --prompts humaneval --num-prompts 8 --max-new-tokens 64 \
        --methods hf_generate,ar,prompt_lookup,oracle --block-size 16 --out runs/bench/engine.json

All logic lives in harness/bench.py (measuring: specdec/bench.py); this file parses flags, prints,
writes files.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download at run time
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness/ sits beside jobs/

import transformers  # noqa: E402

from harness.bench import DEFAULT_METHODS, METHODS, BenchConfig, format_report, run_benchmark  # noqa: E402
from pipelines.report import write_report  # noqa: E402
from specdec.bench import BenchError  # noqa: E402


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target dir, .gguf or id (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--drafter", default=None, help="DFlash drafter directory (enables the dflash method); "
                    "default: the packaged reference drafter of the embedded target; 'none': no drafter")
    ap.add_argument("--prompts", default="humaneval", help="humaneval | sharegpt | longctx (1K-8K-token documents + a question) | path to a JSONL (messages or prompt)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=None,
                    help="default: the drafter's own block size (16 without a drafter)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma list of {','.join(METHODS)} (default: {','.join(DEFAULT_METHODS)})")
    ap.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: exactly --max-new-tokens)")
    ap.add_argument("--prompt-lookup-tokens", type=int, default=10, help="HF prompt_lookup's draft length")
    ap.add_argument("--lookup-block", type=int, default=8,
                    help="our lookup and dflash_lookup: lookup drafts up to this block size (the drafter keeps "
                         "--block-size)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--save-outputs", action="store_true", help="store generated token ids in the JSON")
    ap.add_argument("--out", default=None, help="write X.json and X.png")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    return BenchConfig(**vars(ap.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    transformers.utils.logging.disable_progress_bar()  # keep stderr for our own one-line errors
    try:
        cfg = parse_args(argv)
        report = run_benchmark(cfg)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    if cfg.out:
        js, png = write_report(report, cfg.out)
        print(f"wrote {js} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
