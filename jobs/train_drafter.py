"""Train a DFlash drafter with Ray Train (logic: pipelines/train/trainer.py).

    python jobs/train_drafter.py --config configs/qwen3-8b.yaml --plan    # capacity plan: seconds, no GPU

    ray job submit --working-dir . -- python jobs/train_drafter.py --config configs/smollm2-135m.yaml
    python jobs/train_drafter.py --config configs/smollm2-135m.yaml --set train.max_steps=20 --set train.num_workers=2

Reads the recipe's drafter:, train: and registry: sections (and the target and feature
run from features:). Running the same train.run_name again resumes it from its latest
checkpoint. At the end the best checkpoint (held-out tau) is exported as a drafter
directory and registered in MLflow as a new version of dflash-<target>.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the (uploaded) working dir's packages
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download at run time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="recipe YAML (features:, drafter:, train:, registry:)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe value, e.g. train.max_steps=20 or train.num_workers=[1,4] (repeatable)")
    ap.add_argument("--json", action="store_true", help="print the full result (or plan) as JSON")
    plan = ap.add_argument_group("capacity plan (no weights, no GPU, no Ray: seconds)")
    plan.add_argument("--plan", action="store_true", help="print per-GPU memory, step time, data volume and the "
                      "recommended feature mode for this recipe, then exit")
    plan.add_argument("--gpu", default="h100-80gb", help="accelerator to plan for (h100-80gb, h200, a100-80gb, ...)")
    plan.add_argument("--samples", type=int, default=None, help="training sequences (default: prompts.limit, else 800K)")
    plan.add_argument("--tokens-per-sample", type=int, default=None, help="default: half of train.max_length")
    plan.add_argument("--cpus-per-gpu", type=float, default=8.0, help="CPUs a node has for each GPU")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)

    from pipelines.config import ConfigError
    from pipelines.train.config import load_train_recipe

    try:
        recipe = load_train_recipe(args.config, args.set)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.plan:
        return print_plan(recipe, args)

    import ray

    from pipelines.train import fit

    ray.init()  # joins the job's cluster under `ray job submit` / RAY_ADDRESS, else starts a local one
    try:
        result = fit(recipe)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.as_dict(), indent=1, default=str))
    resumed = f" (resumed from step {result.resumed_from_step})" if result.resumed_from_step else ""
    print(f"run {result.run_name}: {result.steps} steps, {result.samples} samples in {result.seconds:.0f} s{resumed}")
    print(f"best held-out tau {result.holdout_tau:.3f} at step {result.best_step}: {result.checkpoint}")
    print(f"drafter: {result.drafter_dir}")
    print(f"learning curve: {result.learning_curve}")
    print(f"MLflow: run {result.mlflow_run_id} at {result.tracking_uri}")
    if result.model_version:
        print(f"registered: models:/{result.model_name}/{result.model_version}")
    return 0


def print_plan(recipe, args) -> int:
    """``--plan``: the capacity plan of ``recipe`` (pipelines/train/capacity.py)."""
    from pipelines.train.capacity import PlanOptions, format_plan, make_plan

    try:
        plan = make_plan(recipe, PlanOptions(gpu=args.gpu, samples=args.samples,
                                             tokens_per_sample=args.tokens_per_sample, cpus_per_gpu=args.cpus_per_gpu))
    except (ValueError, FileNotFoundError) as e:
        print(f"plan error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.as_dict(), indent=1) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
