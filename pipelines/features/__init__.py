"""The feature stage (Ray Data): prompts -> target answers -> teacher-forced hidden states
-> sharded Parquet + manifest. ``pipeline.py`` drives a run, ``plan.py`` cuts it into shards,
``manifest.py`` commits and verifies it, ``reader.py`` reads it back; ``workers.py`` holds the
Ray Data actors (``vllm_regen.py`` the vllm backend's) over ``shards.py`` (a shard's rows),
``target_pass.py`` (the target's teacher-forced pass) and ``writer.py`` (a shard's files);
``format.py`` is the shard format other tools read (its benchmark: ``harness/features_bench.py``)."""

from pipelines.features.manifest import MANIFEST, committed_shards, load_manifest, verify_features
from pipelines.features.pipeline import check_target_early, run_features
from pipelines.features.plan import plan_shards
from pipelines.features.reader import RunPart, has_holdout_shards, read_features, read_runs, response_token_counts

__all__ = ["MANIFEST", "RunPart", "check_target_early", "committed_shards", "has_holdout_shards", "load_manifest",
           "plan_shards", "read_features", "read_runs", "response_token_counts", "run_features", "verify_features"]
