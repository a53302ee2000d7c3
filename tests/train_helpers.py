"""Shared by the Ray Train modules (tests/test_train.py, tests/test_train_recovery.py; this module
holds no tests): the module's Ray cluster, a committed feature run of 24 prompts from the real
feature pipeline, and recipes over it. A module imports the fixtures by name."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray
import yaml

from pipelines.train.config import load_train_recipe
from pipelines.train.data import holdout_mask

LAYERS = [1, 2]
BLOCK = 4
BATCH = 4
HOLDOUT = 0.2


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def cluster():
    started = not ray.is_initialized()
    if started:  # 4 logical CPUs, more than this machine's 2: two training workers of 1 CPU plus
        # Ray Data's read tasks must be schedulable at once (not a user's serving setup)
        ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=300 << 20, logging_level="warning",
                 log_to_driver=False)
    yield
    if started and ray.is_initialized():
        ray.shutdown()


def features_section(work: Path, target_dir: Path) -> dict:
    return {"output": str(work / "features"), "target": {"model": str(target_dir)}, "layer_ids": LAYERS,
            "prompts": {"source": str(work / "prompts.jsonl"), "split": "all", "max_prompt_tokens": 80},
            "generation": {"max_new_tokens": 32, "batch_size": 12}, "extract": {"batch_size": 12},
            "storage": {"samples_per_shard": 12}}


@pytest.fixture(scope="module")
def features(cluster, work, target_dir) -> str:
    """A committed feature run of 24 prompts made by the feature pipeline."""
    from pipelines.config import load_features_config
    from pipelines.features import run_features

    # prompt lengths spread over a whole cycle: the drafter must follow the anchor token, not
    # learn where in the sequence the cycle happens to be
    rows = [{"id": f"q{i}", "prompt": f"Question {i}: " + " ".join(["why"] * (i % 16)) + " what?"}
            for i in range(24)]
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = work / "features.yaml"
    path.write_text(yaml.safe_dump({"features": features_section(work, target_dir)}))
    summary = run_features(load_features_config(path))
    assert summary["num_samples"] == 24
    return summary["uri"]


def train_rows(features_uri: str) -> int:
    """Rows in the training split (the rest of the id-hash holdout)."""
    ids = [i for f in sorted(Path(features_uri, "shards").glob("*.parquet"))
           for i in pq.read_table(f, columns=["id"]).column("id").to_pylist()]
    return int((~holdout_mask(ids, HOLDOUT)).sum())


def recipe(work: Path, target_dir: Path, name: str, registry: dict | None = None, **train) -> Path:
    data = {
        "features": features_section(work, target_dir),
        "drafter": {"num_layers": 1, "block_size": BLOCK},
        "train": {"run_name": name, "storage_path": str(work / "runs"), "epochs": 8, "batch_size": BATCH,
                  "num_anchors": 16, "max_length": 256, "holdout_fraction": HOLDOUT, "lr": 3e-3, "warmup": 0.05,
                  "log_every": 5, "keep_best": 2, "threads_per_worker": 1, **train},
        "registry": registry or {"tracking_uri": f"sqlite:///{work}/mlflow.db"},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def fit(path: Path, *overrides: str):
    from pipelines.train import fit as run

    return run(load_train_recipe(path, list(overrides)))
