"""Replace the packaged reference drafter (specdec/drafters/<slug>) by a trained one, only
if it wins: measured side by side with the current reference (or with the target alone
when there is none), greedy, on held-out ShareGPT prompts; the promotion rule decides.

    python jobs/publish_reference.py --drafter runs/train/smollm2-135m-b4/drafter --block-size 4

Exit codes: 0 published, 1 refused (the reason is printed), 2 usage errors.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.bench import format_report  # noqa: E402
from pipelines.reference import DEFAULT_MARGIN, publish_reference  # noqa: E402
from specdec.bench import BenchError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True, help="the candidate drafter directory")
    ap.add_argument("--slug", default="smollm2-135m")
    ap.add_argument("--prompts", default="sharegpt")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--margin", type=float, default=DEFAULT_MARGIN)
    ap.add_argument("--block-size", type=int, default=None,
                    help="measure (and publish) at this block size; default: each drafter's own")
    ap.add_argument("--command", default="", help="how the candidate was trained (kept in its lineage)")
    args = ap.parse_args(argv)
    if not Path(args.drafter).is_dir():
        print(f"error: drafter directory not found: {args.drafter}", file=sys.stderr)
        return 2
    try:
        decision, report = publish_reference(args.drafter, args.slug, args.prompts, args.num_prompts,
                                             args.max_new_tokens, args.margin,
                                             args.command or shlex.join(["python", *sys.argv]),
                                             block_size=args.block_size)
    except (BenchError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    print(("PUBLISHED: " if decision.promote else "refused: ") + decision.reason)
    return 0 if decision.promote else 1


if __name__ == "__main__":
    sys.exit(main())
