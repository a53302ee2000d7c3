"""The main job end to end on the embedded defaults (what `make demo` runs): local stack ->
features (ray job submit) -> the packaged reference drafter as first @champion -> training
(ray job submit, Ray Train) -> promotion vs @champion -> serve run (speculative app following
@champion beside the target alone) -> chat requests with the openai client -> summary JSON + PNG.
Stages and what each prints: harness/demo.py. Re-running reuses what is done.

    python jobs/demo.py [--prompts 256] [--max-new-tokens 64] [--steps 60] [--out runs/demo]
    python jobs/demo.py --stop          # make demo-stop: the served apps and the stack
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.demo import DemoConfig, DemoError, run_demo  # noqa: E402
from harness.demo_processes import stop  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    d = DemoConfig()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(d.out.relative_to(Path(__file__).resolve().parents[1])))
    ap.add_argument("--stop", action="store_true", help="stop the served apps and the stack, then exit")
    ap.add_argument("--config", default=d.config, help="recipe for features and training")
    ap.add_argument("--target", default=None, help="target model dir (default: the recipe's, embedded SmolLM2)")
    ap.add_argument("--prompts", type=int, default=d.prompts, help="ShareGPT prompts answered by the target")
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--steps", type=int, default=d.steps, help="training steps")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="extra recipe override for the features and training jobs (repeatable)")
    ap.add_argument("--reference", default=d.reference,
                    help="first @champion: auto (the packaged reference drafter of the target), a drafter dir, none")
    ap.add_argument("--metric", default=d.metric, choices=["speedup", "tau"], help="what promotion compares")
    ap.add_argument("--lookup-block", type=int, default=d.lookup_block,
                    help="promotion and serving: prompt lookup beside the drafter, up to this many tokens (0: off)")
    ap.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    ap.add_argument("--eval-tokens", type=int, default=d.eval_tokens)
    ap.add_argument("--chat-requests", type=int, default=d.chat_requests)
    ap.add_argument("--chat-tokens", type=int, default=d.chat_tokens)
    ap.add_argument("--port", type=int, default=None, help="HTTP port of the apps (default: 8000 when free)")
    args = ap.parse_args(argv)
    if args.stop:
        return stop(args.out)
    opts = {k: v for k, v in vars(args).items() if k != "stop"}
    try:
        run_demo(DemoConfig(**opts))
    except (DemoError, ValueError) as e:
        print(f"\n{e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
