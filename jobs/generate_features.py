"""Generate target features into sharded object storage (logic: pipelines/features/pipeline.py).

    ray job submit -- python jobs/generate_features.py --config configs/smollm2-135m.yaml
    python jobs/generate_features.py --config configs/smollm2-135m.yaml --set features.prompts.limit=64
    python jobs/generate_features.py --verify runs/features/smollm2-135m [--config ... for S3 options]

Re-running the same command resumes an interrupted run; a committed run is left as is.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="recipe YAML with a features: section")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe value, e.g. features.prompts.limit=64 (repeatable)")
    ap.add_argument("--output", help="override features.output (local path or s3://bucket/prefix)")
    ap.add_argument("--verify", metavar="URI", help="re-check a committed run's counts and checksums, then exit")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)

    from pipelines.config import ConfigError, load_features_config
    from pipelines.features import run_features, verify_features

    overrides = args.set + ([f"features.output={args.output}"] if args.output else [])
    try:
        cfg = load_features_config(args.config, overrides) if args.config else None
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.verify:
        try:
            report = verify_features(args.verify, cfg.storage.options if cfg else None)
        except FileNotFoundError as e:
            print(f"BAD {e}")
            return 1
        print(report.summary())
        return 0 if report.ok else 1
    if cfg is None:
        ap.error("--config is required unless --verify is given")

    import ray

    ray.init()  # joins the job's cluster under `ray job submit` / RAY_ADDRESS, else starts a local one
    try:
        print(json.dumps(run_features(cfg), indent=1))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
