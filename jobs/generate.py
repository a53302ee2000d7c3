"""Generate one completion with the speculative engine and print its stats.

    python jobs/generate.py --prompt "Write a haiku about caches." [--drafter DIR | --oracle]

Without --drafter (or --oracle) the engine runs plain autoregressive decoding; with one, prompt
lookup drafts beside it where the context repeats (--lookup-block 0: the drafter alone).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download at run time
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness/ sits beside jobs/

import transformers  # noqa: E402

from harness.bench import format_stats, generate_one  # noqa: E402
from specdec.bench import BenchError, load_drafter_for, load_target_checked  # noqa: E402
from specdec.checkpoint_format import check_block_size  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    transformers.utils.logging.disable_progress_bar()  # keep stderr for our own one-line errors
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--target", default=None, help="target dir, .gguf or id (default: embedded SmolLM2-135M-Instruct)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--drafter", default=None, help="DFlash drafter directory")
    src.add_argument("--oracle", action="store_true", help="propose the target's own AR continuation (engine ceiling)")
    ap.add_argument("--block-size", type=int, default=None, help="default: the drafter's own B (16 otherwise)")
    ap.add_argument("--lookup-block", type=int, default=8,
                    help="with --drafter: prompt lookup beside it, up to this block (0: the drafter alone)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                    help="render the prompt with the target's chat template (default) or feed it raw")
    args = ap.parse_args(argv)
    try:
        if args.max_new_tokens < 1:
            raise BenchError("--max-new-tokens must be >= 1")
        try:
            if args.block_size is not None:
                check_block_size(args.block_size, "--block-size")
            params = SamplingParams(args.temperature, args.top_p, args.top_k)
        except ValueError as e:
            raise BenchError(str(e)) from None
        if args.drafter and not os.path.isdir(args.drafter):  # fail before the slow target load
            raise BenchError(f"drafter directory not found: {args.drafter}")
        target = load_target_checked(args.target)
        drafter = load_drafter_for(args.drafter, target) if args.drafter else None
        if args.block_size is None:
            args.block_size = int(drafter.config.block_size) if drafter is not None else 16
        ids = target.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else target.encode(args.prompt)
        if not ids:
            raise BenchError("the prompt encodes to no tokens")
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result, wall = generate_one(target, ids, args.max_new_tokens, params, drafter=drafter, oracle=args.oracle,
                                block_size=args.block_size, seed=args.seed, lookup_block=args.lookup_block)
    mode = ("dflash+lookup" if args.lookup_block > 1 else "dflash") if drafter is not None else \
        "oracle" if args.oracle else "ar"
    print(target.decode(result.tokens))
    block = {"ar": "1", "dflash+lookup": f"{args.block_size}, lookup up to {max(args.block_size, args.lookup_block)}"}
    print(f"--- stats ({mode}, block {block.get(mode, args.block_size)}, prompt {len(ids)} tokens) ---")
    print(format_stats(result, wall))
    return 0


if __name__ == "__main__":
    sys.exit(main())
