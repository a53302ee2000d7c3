"""The feature stage (Ray Data): prompts -> target answers -> teacher-forced hidden states
-> sharded Parquet + manifest. ``pipeline.py`` drives a run, ``workers.py`` holds the Ray
Data actors, ``format.py`` the shard format other tools read (its benchmark: ``harness/features_bench.py``)."""

from pipelines.features.pipeline import (MANIFEST, check_target_early, committed_shards, has_holdout_shards,
                                         load_manifest, plan_shards, read_features, response_token_counts,
                                         run_features, verify_features)

__all__ = ["MANIFEST", "check_target_early", "committed_shards", "has_holdout_shards", "load_manifest",
           "plan_shards", "read_features", "response_token_counts", "run_features", "verify_features"]
