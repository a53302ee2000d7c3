"""The feature job on two nodes that share nothing but object storage
(``ray.cluster_utils.Cluster`` on one machine, each node with its own cache and temp
directories; shards on the loopback S3 server): the driver and one node are killed mid-run,
a replacement node joins, the job resumes and the committed run holds every prompt exactly
once (0 lost, 0 duplicated)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipelines import storage
from node_helpers import node_env, two_node_cluster

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PROMPTS = 12


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    from s3_helpers import loopback_s3

    root = tmp_path_factory.mktemp("features-multinode")
    with loopback_s3("features") as options:
        # one CPU a node: the generating actor and the extracting actor land on different nodes
        with two_node_cluster(root, 1) as (c, node):
            yield {"cluster": c, "node": node, "root": root, "s3": options}


def _recipe(root: Path, s3: dict) -> Path:
    from specdec.tiny import save_tiny_target

    tiny = save_tiny_target(root / "tiny", num_layers=4)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Question {i}: what is {i} times {i + 1}?"})
                               + "\n" for i in range(PROMPTS)))
    features = {"output": "s3://features/runs/two-nodes", "target": {"model": str(tiny)}, "layer_ids": [0, 1, 2],
                "prompts": {"source": str(prompts), "split": "all", "max_prompt_tokens": 60},
                "generation": {"max_new_tokens": 24, "batch_size": 4, "num_cpus": 0.5},
                "extract": {"batch_size": 2, "num_cpus": 0.5},
                "storage": {"samples_per_shard": 2, "holdout_fraction": 0.2, "options": s3}}
    path = root / "features.yaml"
    path.write_text(yaml.safe_dump({"features": features}))
    return path


def test_feature_job_killed_with_a_node_resumes_exactly_once(two_nodes):
    from pipelines.config import load_features_config
    from pipelines.features import load_manifest, run_features, verify_features

    env, s3 = two_nodes, two_nodes["s3"]
    path = _recipe(env["root"], s3)
    uri = "s3://features/runs/two-nodes"
    fs, root = storage.filesystem(uri, s3)
    log = open(env["root"] / "job.log", "w")
    job = subprocess.Popen([sys.executable, str(REPO / "jobs" / "generate_features.py"), "--config", str(path)],
                           env={**os.environ, "RAY_ADDRESS": env["cluster"].address}, stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True)
    try:
        committed = _wait_for_records(fs, root, job)
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the driver, as its node would be lost
        job.wait()
    # node B goes too (its actors die with it); a replacement with fresh local directories joins
    env["cluster"].remove_node(env["node"])
    env["cluster"].add_node(num_cpus=1, env_vars=node_env(env["root"], "node-c"))
    assert not storage.exists(fs, storage.join(root, "manifest.json"))
    assert 1 <= committed < 6  # 4 training shards of 2 prompts, 2 held-out shards (p0, p7 | p9, p11)

    summary = run_features(load_features_config(path))
    assert summary["shards_skipped"] >= committed and summary["shards_run"] + summary["shards_skipped"] == 6
    m = load_manifest(uri, s3)
    records = storage.read_json_many(fs, storage.list_files(fs, storage.join(root, "progress"), ".json"))
    ids = [i for r in records for i in r["ids"]]
    assert sorted(ids) == sorted(f"p{i}" for i in range(PROMPTS))  # 0 lost, 0 duplicated
    assert m["num_samples"] == PROMPTS and m["holdout"]["num_samples"] == 4
    listed = {s["path"] for s in m["shards"]}
    stored = {f"shards/{p.rsplit('/', 1)[1]}" for p in storage.list_files(fs, storage.join(root, "shards"))}
    assert stored == listed  # no orphans of the killed attempts
    assert len({r["extract_pid"] for r in records}) >= 2  # written by actors before and after the loss
    report = verify_features(uri, s3)
    assert report.ok, report.summary()


def _wait_for_records(fs, root: str, job: subprocess.Popen, timeout: float = 240) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = storage.list_files(fs, storage.join(root, "progress"), ".json")
        if found:
            return len(found)
        if job.poll() is not None:
            pytest.fail(f"the job exited ({job.returncode}) before committing a shard")
        time.sleep(0.05)
    pytest.fail(f"no committed shard after {timeout} s")
