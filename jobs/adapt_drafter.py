"""Adapt the served drafter to the traffic it serves: one pass of capture -> features -> training
-> promotion (logic: pipelines/adapt.py).

    ray job submit --working-dir . -- python jobs/adapt_drafter.py --config configs/smollm2-135m-adapt.yaml
    python jobs/adapt_drafter.py --config configs/smollm2-135m-adapt.yaml --set adapt.min_prompts=50

Run it on a schedule (cluster/adapt-rayjob.yaml, a KubeRay RayJob for a CronJob; or cron and
`ray job submit`). Each pass takes the traffic captured since the last one; with too little it
does nothing and says so. A pass that fails resumes its window when run again. Exit codes: 0 a
version was promoted or there was nothing to do; 1 the new version was refused (the champion
stays); 2 a usage, data or registry error.
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
    ap.add_argument("--config", required=True, help="a training recipe with an adapt: section")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe value, e.g. adapt.min_prompts=50 or train.epochs=2 (repeatable)")
    ap.add_argument("--json", action="store_true", help="print the outcome as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)

    from pipelines import adapt
    from pipelines import promote as P
    from pipelines.config import ConfigError

    try:
        adapt.load_adapt_recipe(args.config, args.set)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    import ray

    ray.init()  # joins the job's cluster under `ray job submit` / RAY_ADDRESS, else starts a local one
    try:
        outcome = adapt.adapt_once(args.config, args.set)
    except (ConfigError, *P.ERRORS) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        ray.shutdown()
    print(json.dumps(adapt.outcome_dict(outcome), indent=2, default=str) if args.json else outcome.message)
    return 1 if outcome.action == "refused" else 0


if __name__ == "__main__":
    sys.exit(main())
