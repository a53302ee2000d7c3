"""Feature data at scale on a tiny target and the loopback S3 server: shards are read a row
group at a time (each range checked against the manifest's digest), training starts after
reading the manifest, the held-out shards and about one row group per reader, and the
held-out share is written to shards of its own that evaluation reads without touching the
training shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import yaml

from pipelines import storage
from pipelines.config import load_features_config
from pipelines.features import RunPart, load_manifest, read_features, read_runs, run_features, verify_features
from pipelines.features.format import CorruptShardError

LAYERS = [0, 1, 2]
PROMPTS = 24
HOLDOUT = 0.2  # of the ids c0..c23, the id hash holds out c0, c4, c10, c18, c23


@pytest.fixture(scope="module")
def ray_session():
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=300 << 20, logging_level="warning",
                 log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("streaming")


@pytest.fixture(scope="module")
def tiny_dir(work) -> Path:
    from specdec.tiny import save_tiny_target

    return save_tiny_target(work / "tiny", num_layers=4)


@pytest.fixture(scope="module")
def s3_reads(ray_session):
    """(s3fs options, the list of (path, bytes) every object read appends to)."""
    from s3_helpers import loopback_s3

    reads: list = []
    with loopback_s3("features", reads=reads) as options:
        yield options, reads


def features_section(work: Path, tiny_dir: Path, output: str, options: dict) -> dict:
    """The dataset's own answers (no generation: cheap), 12 samples a shard, 2 a row group."""
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                         {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. " * (1 + i % 4)}]}
            for i in range(PROMPTS)]
    path = work / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"output": output, "target": {"model": str(tiny_dir)}, "layer_ids": LAYERS,
            "prompts": {"source": str(path), "split": "all", "max_prompt_tokens": 60},
            "generation": {"backend": "dataset", "max_new_tokens": 48}, "extract": {"batch_size": 2},
            "storage": {"samples_per_shard": 12, "holdout_fraction": HOLDOUT, "options": options}}


@pytest.fixture(scope="module")
def s3_run(s3_reads, work, tiny_dir):
    options, _ = s3_reads
    section = features_section(work, tiny_dir, "s3://features/runs/streamed", options)
    path = work / "features.yaml"
    path.write_text(yaml.safe_dump({"features": section}))
    summary = run_features(load_features_config(path))
    return summary["uri"], options, section


def test_held_out_share_is_written_to_shards_of_its_own(s3_run):
    uri, options, _ = s3_run
    m = load_manifest(uri, options)
    held = [s for s in m["shards"] if s.get("split") == "holdout"]
    train = [s for s in m["shards"] if "split" not in s]
    assert [s["shard_id"] for s in held] == ["h00000"] and [s["rows"] for s in train] == [12, 7]
    assert m["holdout"] == {"fraction": HOLDOUT, "num_samples": 5, "num_shards": 1}
    rows = read_features(uri, storage_options=options, split="holdout").take_all()
    assert sorted(r["id"] for r in rows) == ["c0", "c10", "c18", "c23", "c4"]
    train_ids = {r["id"] for r in read_features(uri, storage_options=options, split="train").take_all()}
    assert len(train_ids) == PROMPTS - 5 and not train_ids & {r["id"] for r in rows}
    assert verify_features(uri, options).ok
    # every row group is listed with its byte range and digest; the ranges tile the file
    for shard in m["shards"]:
        groups = shard["row_groups"]
        assert sum(g["rows"] for g in groups) == shard["rows"] and len(groups) == -(-shard["rows"] // 2)
        ends = [g["offset"] + g["length"] for g in groups]
        assert [g["offset"] for g in groups] == [0, *ends[:-1]] and shard["footer"]["offset"] == ends[-1]
        assert shard["footer"]["offset"] + shard["footer"]["length"] == shard["bytes"]


def test_runs_read_as_one_are_interleaved_by_progress_and_filtered_by_their_keep(s3_run):
    """read_runs (several training runs, a replay of the parent's): each run's shards spread over
    the stream by progress. Run A's training shards (12 and 7 rows: middles at 6/19 and 15.5/19
    of A) and run B's one shard (its middle at 1/2 of B) come A, B, A, whatever order the read
    tasks finish in; B's rows are those its keep (a replay share) passes."""
    import functools

    from pipelines.train.data import keep_replayed, replay_mask

    uri, options, _ = s3_run
    train_ids = {r["id"] for r in read_features(uri, storage_options=options, split="train").take_all()}
    held = ["c0", "c10", "c18", "c23", "c4"]
    kept = sorted(i for i, k in zip(held, replay_mask(held, 0.5)) if k)
    assert 0 < len(kept) < len(held)  # the keep refuses some rows and passes others
    ctx = ray.data.DataContext.get_current()
    before, ctx.execution_options.preserve_order = ctx.execution_options.preserve_order, True
    try:
        ids = [r["id"] for r in read_runs([RunPart(uri, "train"), RunPart(uri, "holdout", functools.partial(
            keep_replayed, fraction=0.5))], storage_options=options).take_all()]
    finally:
        ctx.execution_options.preserve_order = before
    assert sorted(ids[12:12 + len(kept)]) == kept
    assert set(ids[:12]) | set(ids[12 + len(kept):]) == train_ids and len(ids) == len(train_ids) + len(kept)


def test_training_starts_after_the_manifest_held_out_shards_and_a_row_group_per_reader(s3_run, s3_reads, work,
                                                                                       tiny_dir):
    """What a training run reads before its first step (the plan on the driver, then a
    worker's first batch): the manifest, the held-out shards, and of each training shard a
    reader opened its footer and at most 3 row groups (the one being consumed and the two
    Ray Data's streaming generator buffers ahead) of its 4-6."""
    from pipelines.train.config import load_train_recipe
    from pipelines.train.plan import prepare

    uri, options, section = s3_run
    _, reads = s3_reads
    m = load_manifest(uri, options)
    recipe_path = work / "train.yaml"
    recipe_path.write_text(yaml.safe_dump({
        "features": section, "drafter": {"num_layers": 1, "block_size": 4},
        "train": {"run_name": "first-step", "storage_path": str(work / "runs"), "batch_size": 2,
                  "max_length": 128, "eval_samples": 64},
        "registry": {"tracking_uri": f"sqlite:///{work}/mlflow.db"}}))
    reads.clear()
    plan = prepare(load_train_recipe(recipe_path))
    assert plan.train_rows == PROMPTS - 5 and plan.holdout.rows == 5 and set(plan.datasets) == {"train"}
    by_path = {s["path"]: s for s in m["shards"]}
    touched = {_rel(p) for p, _ in reads if _rel(p) in by_path}
    assert touched == {s["path"] for s in m["shards"] if s.get("split") == "holdout"}  # no training shard yet

    reads.clear()
    first = next(iter(plan.datasets["train"].streaming_split(1)[0].iter_batches(batch_size=2,
                                                                                batch_format="pyarrow")))
    assert first.num_rows == 2
    per_shard: dict[str, int] = {}
    for path, n in reads:
        if _rel(path) in by_path:
            per_shard[_rel(path)] = per_shard.get(_rel(path), 0) + n
    assert per_shard and all("split" not in by_path[p] for p in per_shard)
    for path, n in per_shard.items():
        shard = by_path[path]
        assert n <= shard["footer"]["length"] + 3 * max(g["length"] for g in shard["row_groups"]) < shard["bytes"]
    # readers: one per CPU at most (2 here) however many shards the run has
    assert len(per_shard) <= 2

    # each worker evaluates (and fetches) only its own held-out blocks; together, every row once
    held = plan.holdout
    for world in (1, 2, 3):
        owned = [held.owned(rank, world) for rank in range(world)]
        assert sorted(i for o in owned for i in o) == list(range(len(held.blocks)))
        ids = [[i for b in held.batches(o, 2) for i in b.column("id").to_pylist()] for o in owned]
        assert sorted(i for part in ids for i in part) == sorted(r["id"] for r in read_features(
            uri, storage_options=options, split="holdout").take_all())
        assert all(b.num_rows <= 2 for o in owned for b in held.batches(o, 2))
    # train.eval_samples cuts the set mid-block: only the rows kept are evaluated
    from pipelines.train.heldout import held_out_blocks

    cut = held_out_blocks(read_features(uri, storage_options=options, split="holdout").limit(3).materialize())
    assert cut.rows == 3 and sum(b.num_rows for b in cut.batches(list(range(len(cut.blocks))), 2)) == 3


def test_a_corrupt_row_group_is_named_before_its_rows_are_used(s3_run, work):
    uri, options, _ = s3_run
    m = load_manifest(uri, options)
    fs, root = storage.filesystem(uri, options)
    bad_root = storage.join(root.rsplit("/", 1)[0], "corrupt")
    for name in ["manifest.json"] + [s["path"] for s in m["shards"]]:
        fs.copy(storage.join(root, name), storage.join(bad_root, name))
    shard = m["shards"][1]
    group = shard["row_groups"][1]
    data = bytearray(fs.cat_file(storage.join(bad_root, shard["path"])))
    data[group["offset"] + group["length"] // 2] ^= 0xFF
    storage.write_bytes(fs, storage.join(bad_root, shard["path"]), bytes(data))
    bad_uri = uri.rsplit("/", 1)[0] + "/corrupt"
    with pytest.raises(Exception) as err:
        read_features(bad_uri, storage_options=options).take_all()
    assert shard["path"] in str(err.value) and "row group 1" in str(err.value)
    assert [where for where, _ in verify_features(bad_uri, options).problems] == [shard["path"]]
    assert issubclass(CorruptShardError, IOError)


def test_runs_written_before_row_group_digests_are_still_read(s3_run):
    uri, options, _ = s3_run
    m = load_manifest(uri, options)
    fs, root = storage.filesystem(uri, options)
    old_root = storage.join(root.rsplit("/", 1)[0], "schema-1")
    for shard in m["shards"]:
        fs.copy(storage.join(root, shard["path"]), storage.join(old_root, shard["path"]))
    old = {**m, "schema_version": 1, "shards": [{k: v for k, v in s.items() if k not in ("row_groups", "footer")}
                                                for s in m["shards"]]}
    storage.write_json(fs, storage.join(old_root, "manifest.json"), old)
    rows = read_features(uri.rsplit("/", 1)[0] + "/schema-1", storage_options=options).take_all()
    new = read_features(uri, storage_options=options).take_all()
    assert sorted((r["id"], r["features"]) for r in rows) == sorted((r["id"], r["features"]) for r in new)


def _rel(path: str) -> str:
    """'shards/<file>' of an S3 request path (or the path unchanged)."""
    parts = path.strip("/").split("/")
    return "/".join(parts[-2:])
