"""Ray Train drafter training end to end on a tiny target whose continuation is learnable
(specdec.tiny.save_cyclic_target): features from the real feature pipeline (tests/train_helpers.py),
a DDP run that learns, registers in MLflow and exports a drafter the engine serves exactly; the
same run refused another shape on resume; several feature runs fine-tuning the parent as one.
DeepSpeed, a killed worker, the same run name again and online features:
tests/test_train_recovery.py. `ray job submit` of the training job against a real head (S3
checkpoints, MLflow server, lineage): tests/test_cluster.py::TestLocalStack::test_job_submit_tiny_training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipelines.config import ConfigError
from pipelines.train.config import load_train_recipe, parse_recipe
from pipelines.train.data import holdout_mask
from specdec.target import target_slug
from train_helpers import (BATCH, BLOCK, LAYERS, cluster, features, fit, recipe,  # noqa: F401 (fixtures)
                           train_rows, work)

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- config
def test_recipe_errors_name_the_field():
    base = {"features": {"output": "x"}, "train": {"run_name": "r"}}
    cases = [
        ({"train": {"run_name": "r", "num_workers": [3, 1]}},
         r"^train\.num_workers: expected an int >= 1 or \[min, max\]"),
        ({"train": {"run_name": "r", "strategy": "fsdp"}}, r"^train\.strategy: expected one of 'ddp', 'deepspeed'"),
        ({"train": {"run_name": "r", "zero_stage": 1}}, r"^train\.zero_stage: expected one of 2, 3"),
        ({"train": {"run_name": "r", "lr": -1}}, r"^train\.lr: expected number > 0"),
        ({"train": {"run_name": "r", "lrr": 1}}, r"^train\.lrr: unknown key"),
        ({"train": {"run_name": "r", "dropout": 1.0}}, r"^train\.dropout: expected number in \[0, 1\), got 1\.0"),
        ({"train": {"run_name": "bad name!"}}, r"^train\.run_name: expected letters"),
        ({"train": {"run_name": "r", "sequences": "x.jsonl"}},
         r"^train\.sequences: token sequences need train\.online"),
        ({"train": {"run_name": "r", "feature_cache": "c"}}, r"^train\.feature_cache: caches online features"),
        ({"train": {"run_name": "r", "online": True, "sequences": "x", "feature_cache": "s3://b/c"}},
         r"^train\.feature_cache: a local directory"),
        ({"train": {}}, r"^train\.run_name: required"),
        ({"train": {"run_name": "r", "features": []}}, r"^train\.features: expected a feature run \(string\) or"),
        ({"train": {"run_name": "r", "features": ["a", "a"]}}, r"^train\.features: a feature run is listed twice"),
        ({"train": {"run_name": "r", "replay": {"features": "a", "share": 1.0}}},
         r"^train\.replay\.share: expected number in \(0, 1\), got 1\.0"),
        ({"train": {"run_name": "r", "replay": {"features": []}}}, r"^train\.replay\.features: expected a feature run"),
        ({"train": {"run_name": "r", "features": ["a", "b"], "replay": {"features": ["b"]}}},
         r"^train\.replay\.features: \['b'\] is also in train\.features"),
        ({"train": {"run_name": "r", "online": True, "sequences": "x", "replay": {"features": "a"}}},
         r"^train\.replay\.features: replays stored feature runs"),
        ({"drafter": {"block_size": 1}}, r"^drafter\.block_size: expected int >= 2, got 1"),
        ({"drafter": {"num_layers": "two"}}, r"^drafter\.num_layers: expected int, got 'two'"),
        ({"registry": {"register": "yes"}}, r"^registry\.register: expected true or false"),
    ]
    for change, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            parse_recipe({**base, **change})
    with pytest.raises(ConfigError, match=r"^train: section missing"):
        parse_recipe({"features": {"output": "x"}})

    two = parse_recipe({**base, "train": {"run_name": "r", "features": ["a", "b"]}})
    assert two.feature_uris == ["a", "b"] and two.features_uri == "a,b"
    one = parse_recipe({**base, "train": {"run_name": "r", "features": ["a"]}})
    assert one.train.features == "a" and one.config_hash() == parse_recipe(
        {**base, "train": {"run_name": "r", "features": "a"}}).config_hash()  # same data, same lineage
    replayed = parse_recipe({**base, "train": {"run_name": "r", "features": "a", "replay": {"features": ["p"]}}})
    assert replayed.train.replay.uris == ["p"] and replayed.config_hash() != one.config_hash()
    elastic = parse_recipe({**base, "train": {"run_name": "r", "num_workers": [1, 4]}})
    assert elastic.train.num_workers == (1, 4) and elastic.model_name == "dflash-smollm2-135m"
    from ray.train import ScalingConfig

    assert ScalingConfig(num_workers=elastic.train.num_workers).elasticity_enabled
    from pipelines.adapt import load_adapt_recipe

    for path in sorted((REPO / "configs").glob("*.yaml")):  # every shipped recipe is valid
        r = load_train_recipe(path)
        if "adapt:" in path.read_text():  # and a loop's recipe as each window's
            load_adapt_recipe(str(path))
        assert r.model_name == f"dflash-{target_slug(r.features.target.model)}", path  # what serving looks up
        assert path.stem.startswith(target_slug(r.features.target.model)), path
    assert target_slug("/models/Qwen3-8B/") == "qwen3-8b" and target_slug(None) == "smollm2-135m"


def test_lr_schedule_warms_up_then_follows_a_cosine():
    from pipelines.train import lr_at

    lr = lambda p: lr_at(p, 6e-4, 0.04, 0.1)  # noqa: E731
    assert lr(0.0) == 0.0 and lr(0.02) == pytest.approx(3e-4) and lr(0.04) == pytest.approx(6e-4)
    assert lr(0.52) == pytest.approx(6e-4 * (0.1 + 0.9 * 0.5))
    assert lr(1.0) == pytest.approx(6e-5) and lr(2.0) == pytest.approx(6e-5)
    assert all(lr(a / 100) >= lr(b / 100) for a, b in zip(range(4, 100), range(5, 101)))


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_collate_pads_cuts_and_decodes_stored_rows(dtype):
    from pipelines.features.format import FeatureLayout
    from pipelines.train.data import Collate

    layout = FeatureLayout(dtype, (1, 2), 8)
    g = torch.Generator().manual_seed(0)
    rows, feats = [], []
    for n in (5, 9):
        f = torch.randn(n, 16, generator=g)
        data, scales = layout.encode(f)
        feats.append(f)
        rows.append({"id": f"r{n}", "input_ids": list(range(10, 10 + n)), "loss_mask": [0, 0] + [1] * (n - 2),
                     "num_tokens": n, "features": data, "scales": scales})
    batch = Collate(layout.as_dict(), max_length=7)(pa.Table.from_pylist(rows))
    assert batch.input_ids.shape == (2, 7) and batch.features.shape == (2, 7, 16)
    assert batch.lengths.tolist() == [5, 7] and batch.ids == ["r5", "r9"]
    assert batch.input_ids[0].tolist() == [10, 11, 12, 13, 14, 0, 0] and batch.loss_mask[1].sum() == 5
    tol = 2e-3 if dtype == "float16" else 3 / 254
    torch.testing.assert_close(batch.features[1], feats[1][:7], atol=tol * 4, rtol=tol)
    assert batch.features[0, 5:].abs().sum() == 0
    assert batch.seed(0) == Collate(layout.as_dict(), 7)(pa.Table.from_pylist(rows[::-1])).seed(0)


def test_collate_decodes_teacher_logprobs_and_tolerates_rows_without_them():
    from pipelines.features.format import FeatureLayout
    from pipelines.train.data import Collate

    layout = FeatureLayout("float16", (1,), 4, teacher_topk=2)
    rows = []
    for n in (3, 4):
        data, _ = layout.encode(torch.zeros(n, 4))
        t_ids = torch.arange(2 * n).view(1, n, 2)
        (ti, tl), = layout.encode_teacher(t_ids, torch.full((1, n, 2), -0.5), [n])
        rows.append({"id": f"r{n}", "input_ids": [1] * n, "loss_mask": [1] * n, "num_tokens": n, "features": data,
                     "scales": None, "teacher_ids": ti, "teacher_logprobs": tl})
    rows.append(dict(rows[0], id="old", teacher_ids=None, teacher_logprobs=None))  # a holdout run without them
    batch = Collate(layout.as_dict(), max_length=8)(pa.Table.from_pylist(rows))
    assert batch.teacher_ids.shape == (3, 4, 2) and batch.teacher_ids[1].flatten().tolist() == list(range(8))
    assert batch.teacher_logprobs[0, :3].eq(-0.5).all() and batch.teacher_logprobs[0, 3].eq(-1e4).all()
    assert batch.teacher_logprobs[2].eq(-1e4).all()  # no teacher mass: the loss keeps the plain CE there
    moved = batch.to("cpu")
    assert torch.equal(moved.teacher_ids, batch.teacher_ids)


def test_holdout_split_is_stable_and_close_to_the_fraction():
    ids = [f"sample-{i}" for i in range(4000)]
    mask = holdout_mask(ids, 0.05)
    assert 0.04 < mask.mean() < 0.06 and (holdout_mask(ids, 0.05) == mask).all()
    assert not holdout_mask(ids, 0.0).any() and (holdout_mask(ids[:10], 0.05) == mask[:10]).all()


@pytest.mark.parametrize("family", ["llama", "gemma"])  # untied head; tied head with a scaled embedding
def test_embed_and_head_alone_equal_the_full_target(tmp_path, family):
    from specdec.frozen import load_embed_and_head
    from specdec.target import load_target
    from specdec.tiny import save_tiny_target

    path = save_tiny_target(tmp_path / family, family=family, num_layers=4)
    # the same (MKL) kernels on both sides: packed oneDNN inference kernels round differently
    full, head = load_target(str(path), fast_kernels=False), load_embed_and_head(str(path), identity="abc")
    ids = torch.tensor([[1, 5, 900, 49000]])
    torch.testing.assert_close(head.embed(ids), full.embed(ids), rtol=0, atol=0)
    h = torch.randn(1, 3, full.hidden_size)
    torch.testing.assert_close(head.logits(h), full.logits(h), rtol=0, atol=0)
    assert head.identity == "abc" and head.layers[0].mlp.down_proj.weight.is_meta  # the decoder was never loaded


# ---------------------------------------------------------------------------- DDP end to end
@pytest.fixture(scope="module")
def ddp_run(cluster, work, target_dir, features):
    return fit(recipe(work, target_dir, "ddp"))


@pytest.mark.slow
def test_ddp_run_learns_and_registers_with_lineage(ddp_run, work, features, target):
    from mlflow import MlflowClient

    res = ddp_run
    hist = res.history
    assert hist[0]["step"] == 0 and hist[0]["samples"] == 0  # the untrained baseline
    per_epoch = -(-train_rows(features) // BATCH)
    assert res.steps == 8 * per_epoch and [h["step"] for h in hist] == [k * per_epoch for k in range(9)]
    assert hist[-1]["holdout_loss"] < 0.5 * hist[0]["holdout_loss"]
    assert hist[-1]["train_loss"] < hist[1]["train_loss"]
    assert res.holdout_tau == max(h["holdout_tau"] for h in hist[1:]) > hist[0]["holdout_tau"] + 0.5
    assert len(hist[-1]["holdout_acc"]) == BLOCK - 1

    client = MlflowClient(res.tracking_uri)
    mv = client.get_model_version("dflash-cyclic-target", res.model_version)
    manifest_sha = __import__("hashlib").sha256((Path(features) / "manifest.json").read_bytes()).hexdigest()
    assert mv.tags["target_identity"] == target.identity
    assert mv.tags["features_uri"] == features and mv.tags["features_manifest_sha256"] == manifest_sha
    assert mv.tags["config_sha256"] == load_train_recipe(work / "ddp.yaml").config_hash()
    assert mv.tags.get("git_commit") == res.extra["git_commit"]  # absent when not run from a git checkout
    assert mv.tags["mlflow_run_id"] == res.mlflow_run_id and float(mv.tags["holdout_tau"]) == res.holdout_tau
    run = client.get_run(res.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.params["train.num_anchors"] == "16"
    taus = [m.value for m in client.get_metric_history(res.mlflow_run_id, "holdout_tau")]
    assert taus == [h["holdout_tau"] for h in hist]  # logged live from rank 0, once per evaluation
    assert client.get_metric_history(res.mlflow_run_id, "train_loss")
    assert {a.path for a in client.list_artifacts(res.mlflow_run_id, "drafter")} == {
        "drafter/config.json", "drafter/model.safetensors"}
    kept = sorted(p.name for p in Path(res.run_uri).glob("checkpoint-step*"))
    assert len(kept) <= 3 and Path(res.checkpoint).name in kept  # best 2 by tau, plus the latest
    assert (Path(res.run_uri) / "eval" / "learning_curve.png").is_file()


@pytest.mark.slow
def test_exported_drafter_is_exact_in_the_engine(ddp_run, target):
    from specdec.checkpoint import load_drafter
    from specdec.engine import Engine, Request
    from specdec.proposers import DFlashProposer

    cfg = json.loads((Path(ddp_run.drafter_dir) / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["target_layer_ids"] == LAYERS
    assert cfg["dflash_ray"]["target_identity"] == target.identity and "embed_tokens.weight" not in json.dumps(cfg)
    drafter = load_drafter(ddp_run.drafter_dir, target=target)  # checks identity, widths, layers
    prompts = [target.encode_chat([{"role": "user", "content": q}]) for q in ("hi", "what is 3 + 4?", "name a cat")]
    requests = lambda: [Request(p, 24) for p in prompts]  # noqa: E731
    ar = Engine(target).generate(requests())
    spec = Engine(target, DFlashProposer(drafter, target), width=BLOCK).generate(requests())
    assert [r.tokens for r in spec] == [r.tokens for r in ar]
    assert all(r.stats.tau > 1.5 for r in spec)  # the trained drafter is accepted, not just harmless


@pytest.mark.slow
def test_resuming_with_another_drafter_shape_is_refused(ddp_run, work, target_dir):
    with pytest.raises(ConfigError, match=r"^drafter\.num_layers: run 'ddp' at .* was trained with "
                                          r"num_hidden_layers=1, the recipe now gives 2"):
        fit(recipe(work, target_dir, "ddp"), "drafter.num_layers=2")


@pytest.mark.slow
def test_several_feature_runs_fine_tune_the_parent_as_one(ddp_run, work, target_dir, features):
    """train.features as a list: the runs' rows are read as one training set (an epoch
    covers both), with both runs in the lineage; runs of another layout are refused.
    drafter.init_from (one fit for all three, a fit's fixed cost being most of its time): the
    new run's untrained baseline is the parent's held-out tau (the copy holds the same
    held-out rows), not an untrained drafter's; the parent is in the lineage. train.replay:
    the parent's rows chosen by their ids' replay hash join the epoch, named in the lineage."""
    import hashlib

    from pipelines.train.data import replay_mask

    second, parents = work / "features-second", work / "features-parent"
    shutil.copytree(features, second)
    shutil.copytree(features, parents)  # the parent's data, replayed (a copy: another run)
    path = recipe(work, target_dir, "two-runs", epochs=1, features=[features, str(second)],
                  replay={"features": str(parents), "share": 0.25})
    res = fit(path, f"drafter.init_from={ddp_run.drafter_dir}", "registry.register=false")
    ids = [i for f in sorted(Path(parents, "shards").glob("*.parquet")) for i in pq.read_table(f, columns=["id"])
           .column("id").to_pylist()]
    fraction = res.extra["replay_fraction"]
    replayed = int(replay_mask(ids, fraction).sum())
    assert 0 < fraction < 1 and 0 < replayed < len(ids)  # a share of the parent's rows, not all of them
    assert res.extra["replay_features_uri"] == str(parents) and res.extra["replay_share"] == 0.25
    new = 2 * train_rows(features)
    assert res.samples == new + replayed and res.steps == -(-(new + replayed) // BATCH)
    shas = [hashlib.sha256((Path(f) / "manifest.json").read_bytes()).hexdigest() for f in (features, second)]
    assert res.extra["features_uri"] == f"{features},{second}"
    assert res.extra["features_manifest_sha256"] == hashlib.sha256(",".join(shas).encode()).hexdigest()
    assert res.history[0]["step"] == 0 and res.history[0]["holdout_tau"] == pytest.approx(ddp_run.holdout_tau, abs=0.05)
    assert res.extra["parent_drafter"] == ddp_run.drafter_dir
    assert res.extra["parent_mlflow_run_id"] == ddp_run.mlflow_run_id
    with pytest.raises(ConfigError, match=r"^drafter\.init_from: .* has block_size=4 but the recipe builds 6"):
        fit(path, f"drafter.init_from={ddp_run.drafter_dir}", "drafter.block_size=6", "train.run_name=ft2")
    with pytest.raises(ConfigError, match=r"^drafter\.init_from: .* is not a drafter directory"):
        fit(path, f"drafter.init_from={work}", "train.run_name=ft3")

    other = work / "features-bf16"
    shutil.copytree(features, other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "dtype": "bfloat16"}))
    with pytest.raises(ConfigError, match=r"^train\.features: the feature run .*features-bf16 stores "
                                          r"FeatureLayout\(dtype='bfloat16'.* runs trained on together need"):
        fit(recipe(work, target_dir, "bad-runs", max_steps=1, features=[features, str(other)]))
    with pytest.raises(ConfigError, match=r"^train\.replay\.features: the feature run .*features-bf16 stores "
                                          r"FeatureLayout\(dtype='bfloat16'.* a replay needs the same layers"):
        fit(recipe(work, target_dir, "bad-replay", max_steps=1, replay={"features": str(other)}))


def test_distill_needs_a_feature_run_with_teacher_logprobs(cluster, work, target_dir, features):
    with pytest.raises(ConfigError, match=r"^train\.distill: 0\.5 needs the target's log-probs, which the feature "
                                          r"run .* does not store; make it with features\.storage\.teacher_topk"):
        fit(recipe(work, target_dir, "distill", max_steps=1), "train.distill=0.5")
