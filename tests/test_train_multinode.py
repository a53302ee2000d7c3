"""Training on two nodes that share nothing but object storage (``ray.cluster_utils.Cluster``
on one machine: separate caches and temp dirs per node; features, checkpoints and the export
on the loopback S3 server): DeepSpeed ZeRO-2 with one worker per node loses a node
mid-epoch, resumes from the latest checkpoint on a replacement node, ends at exactly the
planned step count and registers the drafter with its lineage."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml
from node_helpers import node_env, two_node_cluster

pytestmark = pytest.mark.slow

STEPS, EVERY = 24, 4


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    from s3_helpers import loopback_s3

    root = tmp_path_factory.mktemp("multinode")
    with loopback_s3("dflash") as options:
        # 3 logical CPUs a node: one training worker (2) fits per node, 1 is left for Ray Data's reads
        with two_node_cluster(root, 3) as (c, node):
            yield {"cluster": c, "node": node, "root": root, "s3": options}


def _recipe(root: Path, target_dir: Path, s3: dict) -> Path:
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Question {i}: " + "why " * (i % 16) + "what?"})
                               + "\n" for i in range(24)))
    data = {
        "features": {"output": "s3://dflash/features/cyclic", "target": {"model": str(target_dir)}, "layer_ids": [1, 2],
                     "prompts": {"source": str(prompts), "split": "all", "max_prompt_tokens": 80},
                     "generation": {"max_new_tokens": 32, "batch_size": 12}, "extract": {"batch_size": 12},
                     "storage": {"samples_per_shard": 12, "options": s3}},
        "drafter": {"num_layers": 1, "block_size": 4},
        "train": {"run_name": "two-nodes", "storage_path": "s3://dflash/train", "storage_options": s3,
                  "epochs": 100, "max_steps": STEPS, "eval_every": EVERY, "batch_size": 2, "num_anchors": 8,
                  "max_length": 256, "holdout_fraction": 0.2, "lr": 3e-3, "num_workers": 2, "cpus_per_worker": 2,
                  "threads_per_worker": 1, "strategy": "deepspeed", "zero_stage": 2, "max_failures": 3},
        "registry": {"tracking_uri": f"sqlite:///{root}/mlflow.db"},
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _lose_a_node_after_a_checkpoint(env: dict, fs, run: str) -> int:
    """Once a checkpoint past the first is in storage, remove node B (its raylet and every
    worker on it die) and add a replacement node with fresh local directories (from the
    main thread: Ray starts a node's processes with signal handlers). Returns the step of the
    newest checkpoint at that moment."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        done = [int(p.rsplit("step", 1)[1]) for p in (fs.ls(run, refresh=True) if fs.exists(run) else [])
                if "checkpoint-step" in p]
        if done and max(done) >= EVERY * 2:
            env["cluster"].remove_node(env["node"])
            # logical CPUs of a simulated node, not this machine's: like the nodes it replaces, it
            # holds a training worker plus Ray Data's read tasks (the resize is what is tested)
            env["cluster"].add_node(num_cpus=3, env_vars=node_env(env["root"], "node-c"))
            return max(done)
        time.sleep(0.2)
    raise AssertionError("no checkpoint past the first within 600 s")


def test_deepspeed_run_survives_losing_a_node(two_nodes, tmp_path):
    from mlflow import MlflowClient

    from pipelines import storage
    from pipelines.config import load_features_config
    from pipelines.features import run_features
    from pipelines.train import fit
    from pipelines.train.config import load_train_recipe
    from specdec.tiny import save_cyclic_target

    env = two_nodes
    path = _recipe(env["root"], save_cyclic_target(tmp_path / "cyclic-target"), env["s3"])
    run_features(load_features_config(path))
    fs, run = storage.filesystem("s3://dflash/train/two-nodes", env["s3"])
    out: list = []
    training = threading.Thread(target=lambda: out.append(fit(load_train_recipe(path))), daemon=True)
    training.start()
    lost_at = _lose_a_node_after_a_checkpoint(env, fs, run)
    training.join(timeout=900)
    assert out, "training did not finish"
    res = out[0]

    assert lost_at < STEPS, "the run ended before a node could be lost"
    # resumed from the newest checkpoint Ray Train had committed (one being uploaded when the
    # node died does not count), never from scratch
    assert res.resumed_from_step is not None and EVERY <= res.resumed_from_step <= lost_at
    assert res.steps == STEPS  # exactly the planned steps: none lost, none repeated
    steps = [h["step"] for h in res.history]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS
    assert res.drafter_dir.startswith("s3://dflash/train/two-nodes/")
    mv = MlflowClient(f"sqlite:///{env['root']}/mlflow.db").get_model_version(res.model_name, res.model_version)
    assert mv.tags["features_uri"] == "s3://dflash/features/cyclic"
    assert mv.tags["checkpoint"].startswith("s3://dflash/train/two-nodes/checkpoint-step")
