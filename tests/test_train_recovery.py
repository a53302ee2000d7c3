"""Ray Train recovery and the other strategies on the tiny cyclic target
(specdec.tiny.save_cyclic_target), over the feature run tests/train_helpers.py makes:
DeepSpeed ZeRO-2 on two CPU workers; a worker killed mid-run resumed from its checkpoint and
the same run name run again; online features from token sequences. About 2.5 minutes in 2 lanes
(3 fits and a restart), moved from tests/test_train.py so that neither passes 180 s: the split adds
about half a minute to the suite (a second Ray cluster and feature run)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from train_helpers import BATCH, cluster, features, fit, recipe, train_rows, work  # noqa: F401 (fixtures)


# ---------------------------------------------------------------------------- DeepSpeed
@pytest.mark.slow
def test_deepspeed_zero2_on_two_cpu_workers(cluster, work, target_dir, features, target):
    from specdec.checkpoint import load_drafter

    res = fit(recipe(work, target_dir, "zero2", strategy="deepspeed", zero_stage=2, num_workers=2, max_steps=3,
                     eval_every=2), "drafter.draft_vocab_size=20")
    assert res.steps == 3 and [h["step"] for h in res.history] == [0, 2, 3]
    assert res.history[-1]["samples"] == 3 * BATCH * 2
    latest = sorted(Path(res.run_uri).glob("checkpoint-step*"))[-1]
    shards = sorted(p.name for p in (latest / "deepspeed").iterdir())
    assert "mp_rank_00_model_states.pt" in shards
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= set(shards)
    assert json.loads((latest / "state.json").read_text())["strategy"] == "deepspeed"
    # a reduced draft vocabulary from the stored runs' response tokens (held-out rows left
    # out) plus the stop tokens; it travels with the exported drafter
    vocab = load_drafter(res.drafter_dir, target=target).draft_vocab.tolist()
    responses = {t for f in sorted(Path(features, "shards").glob("*.parquet"))
                 for r in pq.read_table(f, columns=["input_ids", "loss_mask"]).to_pylist()
                 for t, m in zip(r["input_ids"], r["loss_mask"]) if m}
    assert set(target.stop_token_ids()) <= set(vocab) and len(vocab) <= 20 + len(target.stop_token_ids())
    assert len(set(vocab) & responses) >= min(20, len(responses)) - len(target.stop_token_ids())


# ---------------------------------------------------------------------------- failures and resume
@pytest.mark.slow
def test_killed_worker_resumes_and_the_same_name_continues(cluster, work, target_dir, features, monkeypatch):
    per_epoch = -(-train_rows(features) // BATCH)
    path = recipe(work, target_dir, "killed", epochs=1, eval_every=2)
    marker = work / "killed.marker"
    monkeypatch.setenv("DFLASH_FAIL_AT_STEP", "3")
    monkeypatch.setenv("DFLASH_FAIL_MARKER", str(marker))
    res = fit(path)
    assert marker.exists()  # the worker did die at step 3 ...
    assert res.resumed_from_step == 2  # ... and the restarted group resumed from the step-2 checkpoint
    assert res.steps == per_epoch and res.samples == train_rows(features)
    steps = [h["step"] for h in res.history]
    assert steps == sorted(set(steps)) and steps[-1] == per_epoch

    monkeypatch.delenv("DFLASH_FAIL_AT_STEP")
    again = fit(path, "train.epochs=2")  # the same run name: picks up where it stopped
    assert again.resumed_from_step == per_epoch and again.steps == 2 * per_epoch
    assert again.mlflow_run_id == res.mlflow_run_id and int(again.model_version) == int(res.model_version) + 1
    assert [h["step"] for h in again.history][: len(steps)] == steps


# ---------------------------------------------------------------------------- online features
@pytest.mark.slow
def test_online_features_from_token_sequences(cluster, work, target_dir, features, target):
    from specdec.checkpoint import load_drafter

    rows = [r for f in sorted(Path(features, "shards").glob("*.parquet"))
            for r in pq.read_table(f, columns=["id", "input_ids", "prompt_tokens"]).to_pylist()]
    seq = work / "sequences.jsonl"
    seq.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # online: any layers; distillation from the target's law computed in the worker; dropout
    res = fit(recipe(work, target_dir, "online", online=True, sequences=str(seq), max_steps=10, eval_every=5,
                     distill=0.5, dropout=0.1), "drafter.layer_ids=[1, 3]", "drafter.draft_vocab_size=16")
    assert res.steps == 10 and res.history[-1]["holdout_loss"] < res.history[0]["holdout_loss"]
    cfg = json.loads((Path(res.drafter_dir) / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3] and cfg["dflash_ray"]["online_features"] is True
    assert cfg["dflash_ray"]["draft_vocab_size"] == len(load_drafter(res.drafter_dir).draft_vocab) >= 16
    assert cfg["dflash_ray"]["features_manifest_sha256"] is None and cfg["dflash_ray"]["features_uri"] == str(seq)
