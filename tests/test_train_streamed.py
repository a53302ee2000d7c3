"""Streamed features (``train.streamed``, pipelines/train/streamed.py): target actors of their
own compute the features and stream them into the Ray Train workers. Training from them
equals training from the stored features of the same rows, step for step; the recipe's
errors name the field; the capacity plan names the mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from pipelines.config import ConfigError
from pipelines.train.config import parse_recipe
from tests.test_train import LAYERS, cluster, features, fit, recipe  # noqa: F401  (fixtures)

STEPS = 4


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("streamed")


def test_stream_recipe_errors_name_the_field():
    base = {"features": {"output": "x"}}
    cases = [
        ({"run_name": "r", "streamed": True, "online": True},
         r"^train\.streamed: cannot be combined with train\.online"),
        ({"run_name": "r", "stream": {"actors": 0}}, r"^train\.stream\.actors: expected int > 0, got 0"),
        ({"run_name": "r", "stream": {"num_gpus": -1}}, r"^train\.stream\.num_gpus: expected number >= 0"),
        ({"run_name": "r", "stream": {"gpus": 1}}, r"^train\.stream\.gpus: unknown key"),
        ({"run_name": "r", "streamed": True, "feature_cache": "c"}, r"^train\.feature_cache: caches online"),
    ]
    for train, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            parse_recipe({**base, "train": train})
    ok = parse_recipe({**base, "train": {"run_name": "r", "streamed": True, "sequences": "s.jsonl",
                                         "stream": {"actors": 3, "num_gpus": 1}}})
    assert ok.train.from_target and not ok.train.online and ok.train.stream.actors == 3
    # scaling the actors does not change what is trained; choosing streamed does
    more = parse_recipe({**base, "train": {"run_name": "r", "streamed": True, "sequences": "s.jsonl"}})
    assert ok.config_hash() == more.config_hash()
    assert ok.config_hash() != parse_recipe({**base, "train": {"run_name": "r", "online": True,
                                                               "sequences": "s.jsonl"}}).config_hash()


def test_plan_names_streamed_and_sizes_its_actors():
    from pipelines.train.capacity import PlanOptions, format_plan, make_plan
    from pipelines.train.config import load_train_recipe

    repo = Path(__file__).resolve().parents[1]
    stored = make_plan(load_train_recipe(repo / "configs/qwen3-8b.yaml"), PlanOptions(gpu="a100-40gb"))
    assert stored.recommend == "streamed"  # 50 TB of features, and 16 GB of target do not fit beside the drafter
    streamed = make_plan(load_train_recipe(repo / "configs/qwen3-8b.yaml",
                                           ["train.streamed=true", "train.stream.actors=1", "train.stream.num_gpus=1"]),
                         PlanOptions(gpu="a100-40gb"))
    assert streamed.mode == "streamed" and streamed.memory["target"] == stored.memory["target"]  # embed + head only
    assert "target_tflop" not in streamed.step  # the trainers never run the target
    need = streamed.data["stream_actors"]
    assert need > 1 and any(w.startswith(f"train.stream.actors: 1 target actor") for w in streamed.warnings)
    assert f"{need} target actors" in format_plan(streamed)


@pytest.mark.slow
def test_streamed_features_train_like_stored_ones(cluster, work, target_dir, features):  # noqa: F811
    """Same rows, same order (preserve_order, no shuffle, one trainer), same layout: the
    per-step training losses and every held-out evaluation agree. The streamed run's features
    come from two target actors, not from its trainer (not online: it loads only the target's
    embedding and head)."""
    ctx = ray.data.DataContext.get_current()
    before, ctx.execution_options.preserve_order = ctx.execution_options.preserve_order, True
    try:
        common = dict(max_steps=STEPS, epochs=1, eval_every=1, log_every=1, shuffle_buffer=0)
        stored = fit(recipe(work, Path(target_dir), "stored", **common), "registry.register=false")
        streamed = fit(recipe(work, Path(target_dir), "streamed", streamed=True,
                              stream={"actors": 2, "num_cpus": 0.5, "batch_size": 3}, **common),
                       "registry.register=false", f"drafter.layer_ids={LAYERS}")
    finally:
        ctx.execution_options.preserve_order = before
    steps = [h["step"] for h in stored.history]
    assert steps == [h["step"] for h in streamed.history] == list(range(STEPS + 1))
    for a, b in zip(stored.history, streamed.history):
        assert a["samples"] == b["samples"] and a["holdout_rows"] == b["holdout_rows"]
        # measured 2026-12-04: 6e-8 apart (the padding of the target's batches differs); features
        # shifted by 0.01 move them 3e-4 to 1e-2
        assert b["holdout_loss"] == pytest.approx(a["holdout_loss"], rel=1e-5)
        assert b["holdout_tau"] == pytest.approx(a["holdout_tau"], abs=1e-5)
        if a["step"]:  # the logged training loss is rounded to 5 decimals
            assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5, abs=1e-5)
    losses = [h["train_loss"] for h in stored.history[1:]]
    assert len(set(losses)) == len(losses)  # different batches each step: equal losses mean equal rows
    assert streamed.extra["streamed_features"] is True and streamed.extra["online_features"] is False
