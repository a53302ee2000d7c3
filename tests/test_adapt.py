"""The traffic-adaptation loop (pipelines/adapt.py, jobs/adapt_drafter.py) for real at tiny scale:
serve_app's capture writer leaves the cyclic target's own answers in a loopback S3 API (moto);
a pass turns the window into a feature run (nothing generated), fine-tunes the registered
@champion on it with Ray Train, and the promotion job judges the new version against it on
held-out captured traffic and a standard set side by side, in a real MLflow registry (sqlite);
the state (in S3) records the window and the watermark, so the next pass with no new traffic
does nothing and says so; a pass that died after training resumes its window without training
again. A bad adapt: section names the field. About 1 minute alone (two feature runs, a fit, two
promotions), about 1.5 in 2 lanes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray
import yaml

from pipelines import adapt, registry
from pipelines import promote as P
from pipelines.config import ConfigError

BLOCK, LAYERS, MASK = 4, [1, 2], 16  # the copy-anchor champion's shape (specdec.tiny)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("adapt")


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 << 20,
             logging_level="warning", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def s3():
    from s3_helpers import loopback_s3

    with loopback_s3("adapt") as options:
        yield options


class Killed(Exception):
    """A pass dying mid-way (its process killed)."""


@pytest.fixture(scope="module")
def loop(cluster, work, target_dir, target, s3):
    """The champion (v1, the copy-anchor drafter), 40 captured requests in S3, and the recipe."""
    from specdec.checkpoint import save_drafter
    from specdec.tiny import copy_anchor_drafter

    options = s3
    db = f"sqlite:///{work}/mlflow.db"
    champion = copy_anchor_drafter(target, block_size=BLOCK, target_layer_ids=LAYERS, mask_token_id=MASK)
    champion.config.extra = {"target_model": str(target_dir), "target_identity": target.identity}
    _, v1, _ = P.register_directory(db, "dflash-cyclic-target", save_drafter(champion, work / "champion"))
    registry.client(db).set_registered_model_alias("dflash-cyclic-target", "champion", v1)

    capture = "s3://adapt/capture"
    write_traffic(target, capture, options, range(40))
    standard = work / "standard.jsonl"
    standard.write_text("".join(json.dumps({"id": f"s{i}", "prompt": q}) + "\n" for i, q in enumerate(["hi", "go go"])))
    recipe = {
        "adapt": {"captures": [capture], "state": "s3://adapt/state", "min_prompts": 10, "holdout_fraction": 0.25,
                  "standard_prompts": str(standard), "num_prompts": 2, "max_new_tokens": 12, "metric": "tau",
                  "margin": 0.0, "tolerance": 0.5},
        "features": {"output": "s3://adapt/features", "target": {"model": str(target_dir)}, "layer_ids": LAYERS,
                     "prompts": {"max_prompt_tokens": 80}, "generation": {"max_new_tokens": 24},
                     "extract": {"batch_size": 8}, "storage": {"samples_per_shard": 16, "options": options}},
        "drafter": {"num_layers": 1, "block_size": BLOCK, "layer_ids": LAYERS, "mask_token_id": MASK},
        "train": {"run_name": "traffic", "storage_path": str(work / "runs"), "epochs": 1, "batch_size": 4,
                  "num_anchors": 8, "holdout_fraction": 0.2, "lr": 1e-3, "threads_per_worker": 1, "log_every": 5},
        "registry": {"tracking_uri": db},
    }
    path = work / "adapt.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return {"path": path, "db": db, "v1": v1, "options": options, "capture": capture, "target": target}


def write_traffic(target, capture: str, options: dict, ids) -> None:
    """What serving replicas capture: the target's greedy answers to chat prompts."""
    from serve_app.capture import CaptureWriter
    from serve_app.config import CaptureSettings
    from specdec.engine import Engine, Request

    prompts = [target.encode_chat([{"role": "user", "content": f"traffic {i}: " + "go " * (i % 7)}]) for i in ids]
    answers = [r.tokens for r in Engine(target).generate([Request(p, 24) for p in prompts])]
    writer = CaptureWriter(CaptureSettings(uri=capture, flush_s=0.05), f"replica-{min(ids)}", storage_options=options)
    for i, (p, a) in zip(ids, zip(prompts, answers)):
        assert writer.offer({"request_id": f"r{i}", "time": time.time() - 5, "model": "cyclic", "drafter_source": "",
                             "drafter_version": "1", "prompt_ids": p, "answer_ids": a, "temperature": 0.0,
                             "top_p": 1.0, "top_k": 0, "max_tokens": 24, "finish_reason": "length", "accepted": []})
    writer.close()
    assert writer.stats()["captured"] == len(list(ids))


def test_a_pass_adapts_the_champion_and_the_next_one_waits_for_traffic(loop):
    first = adapt.adapt_once(str(loop["path"]))
    assert first.action in ("promoted", "refused"), first.message
    w = first.window
    state = adapt.read_state("s3://adapt/state", loop["options"])
    assert state["pending"] is None and state["watermark"] == w["until"] and state["windows"] == [w]
    assert w["k"] == 1 and w["since"] is None and w["version"] == str(int(loop["v1"]) + 1)
    assert w["init_from"] == "models:/dflash-cyclic-target@champion" and w["features_uri"].endswith("window-0001")
    assert 10 <= w["prompts"] == w["samples"] < 40  # the held-out quarter of the prompts is not trained on
    assert set(w["sets"]) == {"standard", "captured"}  # judged on both, side by side
    tags = registry.client(loop["db"]).get_model_version("dflash-cyclic-target", w["version"]).tags
    assert tags["parent_version"] == loop["v1"] and tags["eval.prompts"] == "standard,captured"
    assert tags["promotion.decision"] == w["decision"]

    again = adapt.adapt_once(str(loop["path"]))
    assert again.action == "nothing" and "0 new prompts captured since " + w["until"] in again.message
    assert adapt.read_state("s3://adapt/state", loop["options"])["watermark"] == w["until"]


def test_a_pass_that_died_after_training_resumes_its_window(loop, monkeypatch):
    """New traffic, a pass killed before its promotion decided: the next pass takes the same
    window up where it stopped (no second fit, no second version) and records it once."""
    write_traffic(loop["target"], loop["capture"], loop["options"], range(100, 130))
    monkeypatch.setattr(P, "promote", lambda cfg: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        adapt.adapt_once(str(loop["path"]))
    pending = adapt.read_state("s3://adapt/state", loop["options"])["pending"]
    assert pending["k"] == 2 and pending["version"] and pending["features_uri"].endswith("window-0002")
    monkeypatch.undo()

    import pipelines.train as T

    monkeypatch.setattr(T, "fit", lambda recipe: pytest.fail("the window's version exists: no second fit"))
    out = adapt.adapt_once(str(loop["path"]))
    state = adapt.read_state("s3://adapt/state", loop["options"])
    assert out.window["version"] == pending["version"] and [w["k"] for w in state["windows"]] == [1, 2]
    assert state["pending"] is None and state["watermark"] == pending["until"]


def test_adapt_errors_name_the_field(loop, work):
    data = yaml.safe_load(loop["path"].read_text())
    for change, message in [({"captures": []}, r"^adapt\.captures: expected the serving apps' capture\.uri"),
                            ({"holdout_fraction": 1.0}, r"^adapt\.holdout_fraction: expected number in \(0, 1\)"),
                            ({"min_prompts": 0}, r"^adapt\.min_prompts: expected int > 0")]:
        bad = work / "bad.yaml"
        bad.write_text(yaml.safe_dump({**data, "adapt": {**data["adapt"], **change}}))
        with pytest.raises(ConfigError, match=message):
            adapt.load_adapt_recipe(str(bad))
    bad.write_text(yaml.safe_dump({k: v for k, v in data.items() if k != "adapt"}))
    with pytest.raises(ConfigError, match=r"^adapt: section missing"):
        adapt.load_adapt_recipe(str(bad))
