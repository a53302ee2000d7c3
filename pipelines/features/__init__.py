"""The feature stage (Ray Data): prompts -> target answers -> teacher-forced hidden states
-> sharded Parquet + manifest. ``pipeline.py`` drives a run, ``plan.py`` cuts it into shards,
``manifest.py`` commits and verifies it, ``reader.py`` reads it back; ``workers.py`` holds the
Ray Data actors (``vllm_regen.py`` the vllm backend's) over ``shards.py`` (a shard's rows),
``target_pass.py`` (the target's teacher-forced pass) and ``writer.py`` (a shard's files);
``format.py`` is the shard format other tools read (its benchmark: ``harness/features_bench.py``).

The names below load on first use (pipelines/lazy.py says why)."""

from pipelines.lazy import lazy_exports

_NAMES = {"MANIFEST": "manifest", "committed_shards": "manifest", "load_manifest": "manifest",
          "verify_features": "manifest", "check_target_early": "pipeline", "run_features": "pipeline",
          "plan_shards": "plan", "RunPart": "reader", "has_holdout_shards": "reader", "read_features": "reader",
          "read_runs": "reader", "response_token_counts": "reader"}
__all__ = sorted(_NAMES)
__getattr__ = lazy_exports(__name__, _NAMES)
