"""The training side of the LongAlign recipe: ``train.longalign`` (a LongAlign JSONL read
with the target's chat template, trained on as online sequences), length-bucketed
batches, gradient checkpointing of the draft layers, registry lineage of a drafter
fine-tuned from a registry version (``parent_version``, ``context: long``), and the
shipped recipe. The end-to-end runs use the tiny cyclic target (SmolLM2 tokenizer) and an
MLflow sqlite registry."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import ray
import torch
import yaml

from pipelines.config import ConfigError
from pipelines.train.config import load_train_recipe, parse_recipe

REPO = Path(__file__).resolve().parents[1]
LAYERS = [1, 2]
BLOCK = 4


# ---------------------------------------------------------------------------- config
def test_longalign_fields_are_validated_naming_the_field():
    base = {"features": {"output": "x"}}
    for other in ("sequences", "features"):
        with pytest.raises(ConfigError, match=rf"^train\.longalign: cannot be combined with train\.{other}"):
            parse_recipe({**base, "train": {"run_name": "r", "longalign": "a.jsonl", other: "b", "online": True}})
    r = parse_recipe({**base, "train": {"run_name": "r", "longalign": "a.jsonl"}})
    assert r.train.online is True  # implied: LongAlign rows are token sequences
    assert r.version_tags == {"context": "long"}  # derived from train.longalign
    r = parse_recipe({**base, "train": {"run_name": "r", "longalign": "a.jsonl"},
                      "registry": {"tags": {"context": "long-32k", "team": "x"}}})
    assert r.version_tags == {"context": "long-32k", "team": "x"}  # explicit tags merge over the derived one
    plain = parse_recipe({**base, "train": {"run_name": "r"}})
    assert plain.version_tags == {} and not plain.train.length_buckets and not plain.train.gradient_checkpointing
    for key, value, pattern in (("length_buckets", "yes", r"^train\.length_buckets: expected true or false"),
                                ("gradient_checkpointing", 3, r"^train\.gradient_checkpointing: expected true or false")):
        with pytest.raises(ConfigError, match=pattern):
            parse_recipe({**base, "train": {"run_name": "r", key: value}})
    with pytest.raises(ConfigError, match=r"^registry\.tags: expected"):
        parse_recipe({**base, "train": {"run_name": "r"}, "registry": {"tags": ["context"]}})


def test_longalign_recipe_matches_the_reference_drafter():
    recipe = load_train_recipe(REPO / "configs" / "smollm2-135m-longalign.yaml")
    ref = json.loads((REPO / "specdec" / "drafters" / "smollm2-135m" / "config.json").read_text())
    d, t = recipe.drafter, recipe.train
    # the shape it is published at (init_from requires it)
    assert d.num_layers == ref["num_hidden_layers"] and d.block_size == ref["block_size"] == 4
    assert d.layer_ids == ref["dflash_config"]["target_layer_ids"]
    assert d.draft_vocab_size == 8192 and d.init_from == "models:/dflash-smollm2-135m@champion"
    assert t.longalign and t.online and t.length_buckets and t.gradient_checkpointing and t.max_length == 8192
    assert t.export_dtype == "float16" and recipe.version_tags["context"] == "long"


def test_evaluation_deals_blocks_out_by_cost():
    """Held-out blocks go to the least loaded worker: with one 8K block among short ones the
    other worker takes the short ones (turn-taking by index gave worker 0 the long block AND
    half the rest); equal costs alternate; every worker computes the same owners."""
    from pipelines.train.heldout import HeldOut, take_turn

    held = HeldOut(blocks=tuple(range(6)), costs=(16000, 2000, 2000, 2000, 2000, 2000), rows=6)
    assert held.owned(0, 2) == [0] and held.owned(1, 2) == [1, 2, 3, 4, 5] and held.owned(0, 1) == list(range(6))
    load = [0, 0]
    assert [take_turn(load, c) for c in [16000, 2000, 2000, 2000, 2000, 2000]] == [0, 1, 1, 1, 1, 1]
    assert load == [16000, 10000]
    load = [0, 0, 0]
    assert [take_turn(load, 5) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


# ---------------------------------------------------------------------------- length buckets
def test_length_buckets_cut_padding_and_keep_every_row_once():
    from pipelines.train.data import bucket_window, bucketed, padding_fraction, simulated_padding

    rng = np.random.default_rng(0)  # a long-context mix: 300 to 8K tokens, most around 2-4K
    lengths = np.clip(rng.lognormal(np.log(3000), 0.6, 200), 300, 8192).astype(int)
    pad = simulated_padding(lengths, batch_size=2, shuffle_buffer=64)
    print(f"padding at batch 2: {pad['random']:.1%} random, {pad['bucketed']:.1%} bucketed (window {pad['window']})")
    assert pad["bucketed"] < 0.1 < 0.2 < pad["random"]
    assert padding_fraction([[4, 4], [2, 4]]) == pytest.approx(2 / 16)
    assert bucket_window(4, 0) == 32 and bucket_window(4, 50) == 52 and bucket_window(3, 64) == 66

    table = pa.table({"id": [f"s{i}" for i in range(10)],
                      "input_ids": pa.array([[1] * int(n) for n in rng.integers(1, 50, 10)], pa.list_(pa.int32()))})
    windows = [table.slice(0, 8), table.slice(8)]
    batches = list(bucketed(windows, 2, (0, 1)))
    assert [b.num_rows for b in batches] == [2, 2, 2, 2, 2]  # as many steps as without buckets
    assert sorted(i for b in batches for i in b.column("id").to_pylist()) == sorted(table.column("id").to_pylist())
    again = list(bucketed([table.slice(0, 8), table.slice(8)], 2, (0, 1)))
    assert [b.column("id").to_pylist() for b in again] == [b.column("id").to_pylist() for b in batches]  # seeded

    # two DDP workers' windows: their k-th batches hold the same length rank, so a step does not
    # pair one worker's shortest batch with the other's longest (measured: 88% vs 31% CPU before)
    a = pa.table({"input_ids": pa.array([[1] * n for n in (10, 500, 30, 900, 60, 200)], pa.list_(pa.int32()))})
    b = pa.table({"input_ids": pa.array([[1] * n for n in (950, 15, 480, 70, 220, 40)], pa.list_(pa.int32()))})
    mean = lambda t: np.mean([len(r) for r in t.column("input_ids").to_pylist()])  # noqa: E731
    ranks = [[sorted(map(mean, x)).index(mean(y)) for y in x] for x in
             (list(bucketed([a], 2, (0, 3))), list(bucketed([b], 2, (0, 3))))]
    assert ranks[0] == ranks[1]


# ---------------------------------------------------------------------------- gradient checkpointing
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny):
    from pipelines.train.data import Batch
    from pipelines.train.runner import DrafterLoss, enable_gradient_checkpointing
    from specdec.drafter import DFlashDrafter, drafter_config_for_target

    target = tiny("llama")
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config_for_target(target, num_hidden_layers=2, block_size=BLOCK,
                                                      target_layer_ids=[1, 3], mask_token_id=3)).to(target.dtype)
    ids = torch.randint(4, 128, (2, 48))
    mask = torch.zeros(2, 48, dtype=torch.bool)
    mask[:, 12:] = True
    lengths = torch.tensor([48, 30])
    ids[1, 30:] = 0
    mask[1, 30:] = False
    batch = Batch(ids, mask, lengths, None, ["a", "b"])

    def step(d):
        module = DrafterLoss(d, target, online=True, lam=None)
        out = module(batch, 12, torch.Generator().manual_seed(7))
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in d.named_parameters()}

    plain = copy.deepcopy(drafter)
    ckpt = enable_gradient_checkpointing(enable_gradient_checkpointing(copy.deepcopy(drafter)))  # twice: no-op
    calls = []
    for layer in ckpt.layers:  # the MLP runs inside the layer: once more per layer when it is recomputed
        layer.mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    loss0, grads0 = step(plain)
    loss1, grads1 = step(ckpt)
    assert len(calls) == 2 * len(ckpt.layers)
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys() and all(torch.equal(grads0[k], grads1[k]) for k in grads0)
    calls.clear()
    with torch.no_grad():  # evaluation: the layers run once, nothing is recomputed
        DrafterLoss(ckpt, target, online=True, lam=None)(batch, 12, torch.Generator().manual_seed(7))
    assert len(calls) == len(ckpt.layers)


# ---------------------------------------------------------------------------- feature cache
@pytest.mark.parametrize("distill", [0.0, 0.5])
def test_feature_cache_hit_trains_like_the_target_pass(tmp_path, tiny, distill):
    from pipelines.train.data import Batch
    from pipelines.train.feature_cache import FeatureCache
    from pipelines.train.runner import DrafterLoss
    from specdec.drafter import DFlashDrafter, drafter_config_for_target

    target = tiny("llama")
    drafter = DFlashDrafter(drafter_config_for_target(target, num_hidden_layers=1, block_size=BLOCK,
                                                      target_layer_ids=[1, 3], mask_token_id=3)).to(target.dtype)
    ids = torch.randint(4, 128, (2, 24))
    lengths = torch.tensor([24, 17])
    ids[1, 17:] = 0
    mask = torch.zeros(2, 24, dtype=torch.bool)
    mask[:, 6:] = True
    mask[1, 17:] = False
    batch = Batch(ids, mask, lengths, None, ["a", "b"])
    cache = FeatureCache(tmp_path, {"target": "t", "layer_ids": [1, 3]})
    module = DrafterLoss(drafter, target, True, None, distill=distill, cache=cache)
    first = module(batch, 8, torch.Generator().manual_seed(0))
    assert cache.misses == 2 and len(list(cache.dir.glob("*.safetensors"))) == 2

    calls = []
    forward = target.forward
    target.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    try:
        again = module(batch, 8, torch.Generator().manual_seed(0))
        swapped = Batch(ids.flip(0), mask.flip(0), lengths.flip(0), None, ["b", "a"])  # other order, same rows
        module(swapped, 8, torch.Generator().manual_seed(0))
        assert calls == [] and cache.hits == 4
        torch.testing.assert_close(again.loss, first.loss)  # a hit trains exactly like the target's pass
        changed = Batch(ids.clone(), mask, lengths, None, ["a", "b"])
        changed.input_ids[0, 3] += 1  # same id, other tokens: never read from the cache
        module(changed, 8, torch.Generator().manual_seed(0))
        assert calls == [1]
    finally:
        target.forward = forward
    other = FeatureCache(tmp_path, {"target": "t", "layer_ids": [1]})  # other features: another folder
    assert other.dir != cache.dir and not list(other.dir.glob("*.safetensors"))


# ---------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("longalign")


@pytest.fixture(scope="module")
def cluster():
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 << 20, logging_level="warning",
                 log_to_driver=False)
    yield
    if started and ray.is_initialized():
        ray.shutdown()


def conversation(i: int, words: int) -> dict:
    doc = " ".join(f"fact{(i * 7 + k) % 97} is about topic{k % 13}." for k in range(words // 5))
    return {"id": f"doc{i}", "messages": [
        {"role": "user", "content": f"Read this document.\n\n{doc}\n\nWhich topic comes first?"},
        {"role": "assistant", "content": f"The first topic is topic0, and document {i} then moves on to "
                                         "topic1 and topic2, in that order, every time."}]}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def longalign_recipe(work: Path, target_dir: Path, name: str, longalign: Path, **train) -> Path:
    data = {
        "features": {"output": str(work / "unused-features"), "target": {"model": str(target_dir)}},
        "drafter": {"num_layers": 1, "block_size": BLOCK, "layer_ids": LAYERS, "init_from_target": False},
        "train": {"run_name": name, "storage_path": str(work / "runs"), "longalign": str(longalign),
                  "holdout": str(work / "holdout.parquet"), "epochs": 1, "max_steps": 2, "batch_size": 2,
                  "num_anchors": 16, "max_length": 2048, "length_buckets": True, "gradient_checkpointing": True,
                  "lr": 1e-3, "log_every": 1, "threads_per_worker": 1, "export_dtype": "float16", **train},
        "registry": {"tracking_uri": f"sqlite:///{work}/mlflow.db"},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def parent(work, target):
    """A drafter of the recipe's shape registered as v1 of dflash-cyclic-target, @champion."""
    import tempfile

    from pipelines import registry
    from specdec.checkpoint import save_drafter
    from specdec.drafter import DFlashDrafter, drafter_config_for_target

    uri = f"sqlite:///{work}/mlflow.db"
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config_for_target(target, num_hidden_layers=1, block_size=BLOCK,
                                                      target_layer_ids=LAYERS)).to(target.dtype)
    run_id = registry.start_run(uri, "dflash-cyclic-target", "parent")
    drafter.config.extra = {"target_identity": target.identity, "run_name": "parent", "mlflow_run_id": run_id}
    with tempfile.TemporaryDirectory() as tmp:
        save_drafter(drafter, Path(tmp) / "drafter")
        source = registry.log_artifacts(uri, run_id, Path(tmp) / "drafter", "drafter")
    version = registry.register_drafter(uri, run_id, source, "dflash-cyclic-target",
                                        registry.lineage_tags(drafter.config.extra))
    registry.finish_run(uri, run_id)
    registry.client(uri).set_registered_model_alias("dflash-cyclic-target", "champion", version)
    return uri, version, run_id


@pytest.mark.slow
def test_longalign_fine_tune_from_a_registry_version(cluster, work, target_dir, target, parent, capsys, monkeypatch):
    from mlflow import MlflowClient

    from pipelines.longalign import read_longalign, write_sequences
    from pipelines.train import fit

    monkeypatch.setenv("DFLASH_CACHE", str(work / "cache"))  # where the parent version is downloaded
    uri, parent_version, parent_run = parent
    sizes = [200, 450, 700, 1000, 300, 2000]  # words (~390 to ~1700 tokens); the last one is > max_length
    path = write_jsonl(work / "train.jsonl", [conversation(i, n) for i, n in enumerate(sizes)])
    held = read_longalign(str(write_jsonl(work / "held.jsonl", [conversation(50 + i, 300) for i in range(2)])),
                          target.tokenizer, 2048)
    write_sequences(held.rows, str(work / "holdout.parquet"))
    recipe_path = longalign_recipe(work, target_dir, "long", path)
    recipe = load_train_recipe(recipe_path, ["drafter.init_from=models:/dflash-cyclic-target@champion",
                                             "train.feature_cache=feature-cache"])
    monkeypatch.chdir(work)  # a relative cache is the driver's directory, wherever the workers run

    res = fit(recipe)
    out = capsys.readouterr().out
    data = read_longalign(str(path), target.tokenizer, 2048)
    assert 300 <= min(len(r["input_ids"]) for r in data.rows) and max(len(r["input_ids"]) for r in data.rows) <= 2048
    assert f"longalign: {len(data.rows)} sequences, {data.tokens} tokens, 1 skipped (longer than max_length)" in out
    rows_file = Path(res.run_uri) / "longalign.parquet"
    assert rows_file.is_file() and res.steps == 2
    mv = MlflowClient(uri).get_model_version("dflash-cyclic-target", res.model_version)
    assert mv.tags["parent_version"] == parent_version and mv.tags["context"] == "long"
    assert mv.tags["parent_uri"] == "models:/dflash-cyclic-target@champion"
    assert res.extra["parent_mlflow_run_id"] == parent_run and res.extra["longalign_sequences"] == len(data.rows)
    assert res.extra["features_uri"] == str(rows_file)
    # online features kept once per row: the 2 held-out rows and the 3-4 of the 2 steps (length
    # buckets cut 5 rows into batches of 2, 2 and 1)
    (cached,) = (work / "feature-cache").iterdir()
    assert 5 <= len(list(cached.glob("*.safetensors"))) <= 6
    assert json.loads((cached / "key.json").read_text())["target"]["identity"] == target.identity

    from pipelines import promote as P  # the lineage shows in promote --list

    rows = {r["version"]: r for r in P.list_versions(uri, "dflash-cyclic-target")}
    assert rows[res.model_version]["context"] == "long" and rows[res.model_version]["parent"] == f"v{parent_version}"

    # the same run name again (resume): the rows file is reused as it is; a source whose rows
    # changed is refused (the driver's step, without another training run)
    from pipelines.train.longalign_rows import longalign_rows

    before = rows_file.stat().st_mtime_ns
    assert longalign_rows(recipe, target, res.run_uri)["longalign_sha256"] == res.extra["longalign_sha256"]
    assert rows_file.stat().st_mtime_ns == before
    write_jsonl(path, [conversation(i, n) for i, n in enumerate(sizes[:-2])])
    with pytest.raises(ConfigError, match=r"^train\.longalign: run 'long' was started on other rows"):
        longalign_rows(load_train_recipe(recipe_path), target, res.run_uri)


@pytest.mark.slow
def test_malformed_longalign_line_fails_before_anything_is_written(cluster, work, target_dir, parent):
    from mlflow import MlflowClient

    from pipelines.train import fit

    uri = parent[0]
    bad = write_jsonl(work / "bad.jsonl", [conversation(0, 100),
                                           {"messages": [{"role": "user", "content": "q"},
                                                         {"role": "assistant", "content": 7}]}])
    versions = len(MlflowClient(uri).search_model_versions("name='dflash-cyclic-target'"))
    with pytest.raises(ConfigError, match=r"^train\.longalign: .*bad\.jsonl:2: messages\[1\]\.content: expected a "
                                          r"string"):
        fit(load_train_recipe(longalign_recipe(work, target_dir, "bad", bad)))
    assert not (work / "runs" / "bad").exists()
    assert len(MlflowClient(uri).search_model_versions("name='dflash-cyclic-target'")) == versions
    assert not MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("dflash-cyclic-target")
                                              .experiment_id], "attributes.run_name = 'bad'")
    with pytest.raises(ConfigError, match=r"^drafter\.init_from: .*no version or alias|^drafter\.init_from: .*"
                                          r"(not found|does not exist|RESOURCE_DOES_NOT_EXIST)"):
        fit(load_train_recipe(longalign_recipe(work, target_dir, "bad2", work / "train.jsonl"),
                              ["drafter.init_from=models:/dflash-cyclic-target@nope"]))
