"""Feature pipeline pieces that need no Ray: recipe validation, storage helpers, the
stored encodings (8-bit error bound), shard planning and the vLLM processor config."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipelines import storage
from pipelines.config import ConfigError, FeaturesConfig, load_features_config, parse_section
from pipelines.features.format import (FeatureLayout, ManifestMismatchError, check_manifest, dequantize_int8,
                                      quantize_int8)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


def write_recipe(path: Path, features: dict, **other_sections) -> Path:
    path.write_text(yaml.safe_dump({"features": features, **other_sections}))
    return path


# ---------------------------------------------------------------------------- config
def test_shipped_recipe_loads_and_ignores_other_stages_sections(tmp_path):
    cfg = load_features_config(REPO / "configs" / "smollm2-135m.yaml")
    assert cfg.generation.backend == "vllm" and cfg.generation.num_gpus == 0 and cfg.storage.dtype == "float16"

    recipe = write_recipe(tmp_path / "r.yaml", {"output": "x"}, drafter={"anything": 1}, train={"lr": "?"})
    assert load_features_config(recipe).output == "x"


@pytest.mark.parametrize("features, message", [
    ({"output": "x", "extract": {"batch_size": -1}}, "features.extract.batch_size: expected int > 0, got -1"),
    ({"output": "x", "generation": {"max_tokens": 5}}, "features.generation.max_tokens: unknown key"),
    ({"output": "x", "generation": {"backend": "tgi"}}, "features.generation.backend: expected one of 'hf', 'vllm'"),
    ({"output": "x", "generation": {"top_p": 0}}, "features.generation.top_p: expected number in (0, 1], got 0"),
    ({"output": "x", "storage": {"dtype": "fp8"}}, "features.storage.dtype: expected one of"),
    ({"output": "x", "layer_ids": [1, 1]}, "features.layer_ids: expected distinct ints >= 0"),
    ({"output": "x", "prompts": {"limit": "ten"}}, "features.prompts.limit: expected int, got 'ten'"),
    ({"output": "x", "generation": {"backend": "vllm", "vllm": {"accelerator_type": "H100"}}},
     "features.generation.vllm.accelerator_type: 'H100' names a GPU, but num_gpus 0 runs the vllm backend on CPU"),
    ({"target": {"model": "m"}}, "features.output: required"),
    ({"output": "x", "generation": {"backend": "dataset", "temperature": 0.7}},
     "features.generation.temperature: the dataset backend generates nothing"),
    ({"output": "x", "prompts": {"skip": -1}}, "features.prompts.skip: expected int >= 0"),
    ({"output": "x", "extract": {"from_generation": True}, "generation": {"backend": "vllm", "num_gpus": 1}},
     "features.extract.from_generation: only the hf backend"),
])
def test_recipe_errors_name_the_key(tmp_path, features, message):
    with pytest.raises(ConfigError) as err:
        load_features_config(write_recipe(tmp_path / "r.yaml", features))
    assert message in str(err.value)


def test_missing_section_and_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"train": {}}))
    with pytest.raises(ConfigError, match="features: section missing"):
        load_features_config(recipe)
    write_recipe(recipe, {"output": "x"})
    cfg = load_features_config(recipe, ["features.prompts.limit=7", "features.storage.dtype=int8"])
    assert (cfg.prompts.limit, cfg.storage.dtype) == (7, "int8")
    # YAML 1.1 reads 3e-1 (no dot) as a string; a number field takes it as the number it is
    cfg = load_features_config(recipe, ["features.generation.top_p=3e-1"])
    assert cfg.generation.top_p == 0.3
    with pytest.raises(ConfigError, match="features.generation.top_p: expected number, got 'e-1'"):
        load_features_config(recipe, ["features.generation.top_p=e-1"])


def test_content_ignores_resources_but_not_generation():
    a = parse_section(FeaturesConfig, {"output": "x"}, "features")
    b = parse_section(FeaturesConfig, {"output": "y", "extract": {"actors": 4}}, "features")
    c = parse_section(FeaturesConfig, {"output": "x", "generation": {"temperature": 0.7}}, "features")
    assert a.content() == b.content() != c.content()
    # keeping features from generation changes the data (last token): it is part of the identity
    d = parse_section(FeaturesConfig, {"output": "x", "extract": {"from_generation": True}}, "features")
    assert d.content() == a.content() | {"extract": {"from_generation": True}}
    # prompts.skip is part of the identity when set, absent at 0 (runs made before it resume)
    e = parse_section(FeaturesConfig, {"output": "x", "prompts": {"skip": 10}}, "features")
    assert "skip" not in a.content()["prompts"] and e.content()["prompts"]["skip"] == 10


# ---------------------------------------------------------------------------- encodings
def test_int8_round_trip_within_stated_bound():
    """Stated bound: |x - decoded| <= max|x| / 254 per (token, layer), + float32 rounding."""
    torch.manual_seed(0)
    layout = FeatureLayout("int8", (1, 3, 5), 96)
    x = torch.randn(37, 3 * 96) * torch.logspace(-2, 3, 37)[:, None]  # magnitudes over 5 decades
    x[5, 10] = 900.0  # an outlier channel, as real hidden states have
    x[7, :96] = 0.0  # an all-zero slice
    data, scales = layout.encode(x)
    assert len(data) == 37 * 3 * 96 and len(scales) == 37 * 3 * 4
    y = layout.decode(data, scales, 37)
    err = (y - x).abs().view(37, 3, 96)
    bound = x.abs().view(37, 3, 96).amax(-1, keepdim=True) / 254
    assert bool((err <= bound * (1 + 1e-5) + 1e-30).all())
    assert torch.equal(y[7, :96], torch.zeros(96))
    rel = ((y - x).norm() / x.norm()).item()
    assert rel < 0.01


def test_quantize_never_clips():
    q, s = quantize_int8(torch.tensor([[-3.0, 1.5, 3.0]]))
    assert q.tolist() == [[-127, 64, 127]]
    assert torch.allclose(dequantize_int8(q, s), torch.tensor([[-3.0, 1.512, 3.0]]), atol=1e-3)


@pytest.mark.parametrize("dtype, tol", [("float16", 1e-3), ("bfloat16", 8e-3)])
def test_float_round_trip_and_exact_size(dtype, tol):
    layout = FeatureLayout(dtype, (0, 1), 8)
    x = torch.randn(2, 5, 16)
    rows = layout.encode_batch(x, [5, 3])  # row 1 is right-padded: only 3 tokens are stored
    assert [len(d) for d, _ in rows] == [5 * 16 * 2, 3 * 16 * 2] and rows[0][1] is None
    y = layout.decode(rows[1][0], None, 3)
    assert torch.allclose(y, x[1, :3], rtol=tol, atol=tol)
    assert layout.nominal_bytes_per_token == 16 * 2


def test_float16_overflow_is_an_error_not_inf():
    with pytest.raises(ValueError, match="overflow float16"):
        FeatureLayout("float16", (0,), 4).encode(torch.full((2, 4), 1e6))


def test_manifest_check_names_the_field():
    m = {"format": "dflash-features", "schema_version": 1, "target": {"identity": "abc"}, "layer_ids": [1, 2],
         "hidden_size": 64, "tokenizer": {"hash": "t"}}
    check_manifest(m, "u", target_identity="abc", layer_ids=[1, 2], hidden_size=64, tokenizer_hash="t")
    for kwargs, name in [({"target_identity": "abd"}, "target.identity"), ({"layer_ids": [1, 3]}, "layer_ids"),
                         ({"hidden_size": 65}, "hidden_size"), ({"tokenizer_hash": "u"}, "tokenizer.hash")]:
        with pytest.raises(ManifestMismatchError) as err:
            check_manifest(m, "u", **kwargs)
        assert err.value.field == name and f"'{name}'" in str(err.value)
    check_manifest(m | {"schema_version": 2}, "u")  # row-group digests, held-out shards
    with pytest.raises(ManifestMismatchError) as err:
        check_manifest(m | {"schema_version": 3}, "u")
    assert err.value.field == "schema_version"


# ---------------------------------------------------------------------------- storage
def test_s3_endpoint_and_region_from_environment(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    opts = storage.resolve_options("s3://b/p", {"key": "k", "secret": "s"})
    assert opts == {"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9",
                    "client_kwargs": {"region_name": "eu-west-3"}}
    # the recipe wins over the environment; local paths take no S3 options
    assert storage.resolve_options("s3://b", {"endpoint_url": "http://x"})["endpoint_url"] == "http://x"
    assert storage.resolve_options("/tmp/x", {}) == {}
    fs, path = storage.filesystem("s3://bucket/run/", {"key": "k", "secret": "s"})
    assert path == "bucket/run" and fs.endpoint_url == "http://127.0.0.1:9"


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    fs, root = storage.filesystem(str(tmp_path))
    target = storage.join(root, "d", "f.bin")
    with pytest.raises(RuntimeError):
        with storage.open_atomic(fs, target) as out:
            out.write(b"partial")
            raise RuntimeError("killed")
    assert list((tmp_path / "d").iterdir()) == []
    sha = storage.write_bytes(fs, target, b"whole")
    assert (tmp_path / "d" / "f.bin").read_bytes() == b"whole"
    assert storage.sha256_file(fs, target) == (sha, 5)


# ---------------------------------------------------------------------------- planning
def test_plan_is_deterministic_with_unique_ids(tmp_path):
    from pipelines.features import plan_shards

    src = tmp_path / "p.jsonl"
    rows = [{"id": "a", "prompt": "one"}, {"id": "a", "prompt": "two"}] + \
           [{"id": f"q{i}", "prompt": f"question {i}"} for i in range(5)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_section(FeaturesConfig, {"output": "x", "prompts": {"source": str(src), "split": "all"},
                                         "storage": {"samples_per_shard": 3}}, "features")
    shards, digest = plan_shards(cfg)
    assert [s.shard_id for s in shards] == ["00000", "00001", "00002"]
    assert [i for s in shards for i in s.ids] == ["a", "a~2", "q0", "q1", "q2", "q3", "q4"]
    assert plan_shards(cfg) == (shards, digest)


def test_streamed_plan_keeps_refs_and_writes_each_pending_shard_once(tmp_path):
    """The driver's plan is refs (id, split, count, ids digest); the samples of pending shards
    go to plan files, once; a stage row naming its plan file reads back the shard's samples."""
    from pipelines.features.plan import ids_digest, plan_index, plan_shards, write_plan_files
    from pipelines.features.shards import load_shard_row

    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) + "\n" for i in range(20)))
    cfg = parse_section(FeaturesConfig, {"output": "x", "prompts": {"source": str(src), "split": "all"},
                                         "storage": {"samples_per_shard": 4, "holdout_fraction": 0.25}}, "features")
    shards, digest = plan_shards(cfg)
    refs, digest2 = plan_index(cfg)
    assert digest2 == digest and [r.shard_id for r in refs] == [s.shard_id for s in shards]
    assert [r.split for r in refs] == [s.split for s in shards] and refs[-1].shard_id.startswith("h")
    assert [r.ids_sha256 for r in refs] == [ids_digest(s.ids) for s in shards]
    assert sum(r.samples for r in refs) == 20
    fs, root = storage.filesystem(str(tmp_path / "run"))
    pending = {refs[0].shard_id, refs[-1].shard_id}
    assert write_plan_files(cfg, fs, root, pending) == 2 and write_plan_files(cfg, fs, root, pending) == 0
    assert sorted(p.name for p in (tmp_path / "run" / "plan").iterdir()) == sorted(f"{i}.json" for i in pending)
    row = load_shard_row({"shard_id": refs[-1].shard_id, "plan_uri": str(tmp_path / "run" / "plan" /
                                                                         f"{refs[-1].shard_id}.json")}, None)
    assert row == shards[-1].as_row()


def _plan_peak(src: str, limit: int, whole: bool) -> int:
    """Peak bytes Python allocated while planning ``limit`` prompts of ``src`` (``whole``: the
    list of shards with their samples, as the driver held it before plans were streamed)."""
    import tracemalloc

    from pipelines.features.plan import plan_index, plan_shards, write_plan_files

    cfg = parse_section(FeaturesConfig, {"output": "x", "prompts": {"source": src, "split": "all", "limit": limit,
                                                                    "max_prompt_chars": None},
                                         "storage": {"samples_per_shard": 4}}, "features")
    from specdec.prompts import load_prompts

    load_prompts(src, split="all", max_prompt_chars=None)  # parse caches warm: they are not the plan
    tracemalloc.start()
    if whole:
        plan = plan_shards(cfg)
    else:
        plan, _ = plan_index(cfg)
        with tempfile_dir() as d:
            fs, root = storage.filesystem(d)
            write_plan_files(cfg, fs, root, {r.shard_id for r in plan})
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del plan
    return peak


def tempfile_dir():
    import tempfile

    return tempfile.TemporaryDirectory()


def test_driver_plan_memory_does_not_grow_with_the_prompts(tmp_path):
    """Planning 8x the prompts of one source: the streamed plan's peak grows by a fraction of the
    prompts' added text (per prompt: its dedup key and id, ~300 bytes, not its 2 KB of text),
    while holding every shard's samples (the old plan) grows by more than the text. The
    source's own parse is the same for both sizes and not counted."""
    src = tmp_path / "big.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"{i} " + "x" * 2000}) + "\n" for i in range(1600)))
    added_text = 1400 * 2000
    # 200 prompts are 50 shards: past the 32 shards of samples the plan writer holds in flight
    streamed = [_plan_peak(str(src), n, whole=False) for n in (200, 1600)]
    whole = [_plan_peak(str(src), n, whole=True) for n in (200, 1600)]
    assert whole[1] - whole[0] > added_text  # the check can fail: the old plan grows with the text
    assert streamed[1] - streamed[0] < 0.25 * added_text, (streamed, whole)


# ---------------------------------------------------------------------------- vllm backend (config only)
def test_vllm_regeneration_stage_without_importing_vllm(monkeypatch):
    """One Ray Data stage of long-lived engine actors: the actor pool, its resources and
    constructor settings, the per-shard seed; CPU mode gets the VLLM_CPU_* variables with a
    1 GiB KV cache by default; pools that cannot run together are refused in the driver."""
    from importlib import metadata

    import ray

    from pipelines.features.vllm_regen import (RegenerateVLLM, check_room, check_vllm_cpu_build, regeneration_stage,
                                               vllm_sampling_params)

    imported_before = "vllm" in sys.modules  # another test module may have imported it already

    cfg = parse_section(FeaturesConfig, {"output": "x", "generation": {
        "backend": "vllm", "num_gpus": 1, "batch_size": 64, "actors": 2, "temperature": 0.6, "top_k": 20,
        "max_new_tokens": 100, "vllm": {"engine_kwargs": {"gpu_memory_utilization": 0.8},
                                        "accelerator_type": "H100"}}}, "features")
    gen = dataclasses.asdict(cfg.generation)
    calls = []

    class FakeDataset:
        def map_batches(self, fn, **kw):
            calls.append((fn, kw))
            return self

    regeneration_stage(FakeDataset(), "/models/qwen3-8b", {"dtype": "bfloat16", "trust_remote_code": False}, gen,
                       2048, 2148)
    (fn, kw), = calls
    assert fn is RegenerateVLLM and kw["batch_size"] == 1 and kw["num_gpus"] == 1 and kw["num_cpus"] == 1.0
    assert kw["accelerator_type"] == "H100" and kw["compute"].max_size == 2  # one engine per actor, for the run
    ctor = kw["fn_constructor_kwargs"]
    assert ctor["max_model_len"] == 2148 and ctor["generation"]["vllm"]["engine_kwargs"] == {
        "gpu_memory_utilization": 0.8} and ctor["env"] == {}  # GPU: no CPU settings
    sp = vllm_sampling_params(gen, "00007")
    assert sp["max_tokens"] == 100 and sp["top_k"] == 20 and sp["temperature"] == 0.6 and sp["detokenize"] is False
    assert sp == vllm_sampling_params(gen, "00007") != vllm_sampling_params(gen, "00008")

    cpu = dataclasses.asdict(parse_section(FeaturesConfig, {"output": "x", "generation": {
        "backend": "vllm", "num_cpus": 2}}, "features").generation)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    calls.clear()
    regeneration_stage(FakeDataset(), "/m", {"dtype": "float32", "trust_remote_code": False}, cpu, 64, 128)
    (_, kw), = calls
    assert kw["num_gpus"] == 0 and kw["num_cpus"] == 2 and "accelerator_type" not in kw
    assert kw["fn_constructor_kwargs"]["env"] == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")  # unset: unbound (specdec.vllm_engine.CPU_THREADS_BIND)
    calls.clear()
    regeneration_stage(FakeDataset(), "/m", {"dtype": "float32", "trust_remote_code": False}, cpu, 64, 128)
    assert calls[0][1]["fn_constructor_kwargs"]["env"] == {"VLLM_CPU_KVCACHE_SPACE": "1",
                                                         "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    # engines and extraction actors overlap: both pools must fit at once
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    extract = {"actors": 1, "num_cpus": 1.0}
    with pytest.raises(ConfigError, match="features.generation.num_cpus: 1 vLLM engine.* x 2 CPUs leave 0 .* need 1"):
        check_room(cpu, extract)
    check_room(cpu | {"num_cpus": 1.0}, extract)
    # a GPU build of vLLM (or none) cannot run on CPU

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", not_installed)
    with pytest.raises(ConfigError, match="needs the vllm-cpu build"):
        check_vllm_cpu_build()
    with pytest.raises(ConfigError, match="features.generation.vllm.wave_shards: removed"):
        parse_section(FeaturesConfig, {"output": "x", "generation": {"vllm": {"wave_shards": 8}}}, "features")
    assert imported_before or "vllm" not in sys.modules  # the driver side never imports vLLM


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from specdec.tiny import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("tiny") / "t", num_layers=6)


def test_layers_are_checked_before_any_ray_work(tiny_dir):
    from pipelines.features import check_target_early

    tiny = tiny_dir

    def cfg(**features):
        return parse_section(FeaturesConfig, {"output": "x", "target": {"model": str(tiny)}, **features}, "features")

    check_target_early(cfg(layer_ids=[1, 3, 4]))
    # the last layer (5) is refused too: vLLM feeds layer i+1's input for id i
    with pytest.raises(ConfigError, match=r"features\.layer_ids: layers \[5\] out of range; a 6-layer target allows 0\.\.4"):
        check_target_early(cfg(layer_ids=[1, 5]))
    with pytest.raises(ConfigError, match=r"features\.num_layers: 5 layers spaced over a 6-layer target repeat"):
        check_target_early(cfg())


def test_thinking_switch_only_where_the_template_has_one(caplog):
    from transformers import AutoTokenizer

    from pipelines.features.shards import PromptEncoder
    from specdec.target import resolve_target_path

    tok = AutoTokenizer.from_pretrained(resolve_target_path(None))
    msgs = [{"role": "user", "content": "hi there"}]
    assert PromptEncoder(tok, None, 1000)(msgs) == PromptEncoder(tok, True, 1000)(msgs)  # no switch: ignored
    assert "no thinking switch" in caplog.text
    assert PromptEncoder(tok, None, 5)(msgs) is None  # over the token cap

    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    on, off = PromptEncoder(tok, True, 1000)(msgs), PromptEncoder(tok, False, 1000)(msgs)
    assert off[: len(on)] == on and len(off) > len(on)


def test_shard_writer_overlapped_io_writes_the_same_bytes(tiny_dir, tmp_path):
    """The GPU path (writes on a background thread) and the CPU path (inline) agree."""
    import pyarrow.parquet as pq

    from pipelines.features.writer import ShardWriter
    from specdec.target import load_target

    target = load_target(str(tiny_dir))
    shard = {"shard_id": "00003", "ids": ["a", "b", "c"], "input_ids": [[5, 6, 7, 8], [9, 10], [11, 12, 13]],
             "prompt_tokens": [2, 1, 2], "finish_reason": ["stop", "length", "stop"], "skipped_ids": ["d"],
             "skipped_reasons": ["prompt_too_long"], "gen_tokens": 4, "gen_seconds": 0.0, "gen_pid": 0}
    status = {}
    for overlap in (False, True):
        writer = ShardWriter(target, [1, 4], "float16", "none", 2, str(tmp_path / str(overlap)), {}, "k", "m",
                             overlap_io=overlap)
        status[overlap] = writer.write_shard(shard)
    assert status[False]["sha256"] == status[True]["sha256"]
    assert (status[False]["rows"], status[False]["tokens"], status[False]["skipped"]) == (3, 9, 1)
    record = json.loads((tmp_path / "True" / "progress" / "shard-00003.json").read_text())
    table = pq.read_table(tmp_path / "True" / record["path"])
    assert table.column("id").to_pylist() == ["b", "c", "a"]  # length-sorted mini-batches
    assert table.column("loss_mask").to_pylist()[2] == [0, 0, 1, 1]
    assert record["skipped"] == {"d": "prompt_too_long"} and record["layout"]["layer_ids"] == [1, 4]


def test_shards_are_cut_into_files_by_bytes_and_streamed_back_row_group_by_row_group(tiny_dir, tmp_path):
    """storage.shard_bytes: a shard's rows go to files that close once they hold that many
    bytes; every file lists its row groups' ranges and digests, and streaming them back
    gives the rows of the single-file shard."""
    from pipelines import storage
    from pipelines.features.manifest import _shard_entries
    from pipelines.features.reader import stream_shard
    from pipelines.features.writer import ShardWriter
    from specdec.target import load_target

    target = load_target(str(tiny_dir))
    lengths = [3, 9, 4, 12, 5, 7, 6, 8, 10, 11]
    shard = {"shard_id": "00001", "ids": [f"r{i}" for i in range(10)],
             "input_ids": [list(range(5, 5 + n)) for n in lengths], "prompt_tokens": [2] * 10,
             "finish_reason": ["stop"] * 10, "skipped_ids": [], "skipped_reasons": [], "gen_tokens": 0,
             "gen_seconds": 0.0, "gen_pid": 0}
    records = {}
    for name, limit in (("one", None), ("cut", 3000)):
        ShardWriter(target, [1, 2], "float16", "none", 2, str(tmp_path / name), {}, "k", "m",
                    shard_bytes=limit).write_shard(shard)
        records[name] = json.loads((tmp_path / name / "progress" / "shard-00001.json").read_text())
    one, cut = (_shard_entries(records[n], "train") for n in ("one", "cut"))
    assert len(one) == 1 and len(cut) >= 3
    assert sum(e["rows"] for e in cut) == 10 and sum(e["tokens"] for e in cut) == sum(lengths)
    biggest_group = max(g["length"] for e in cut for g in e["row_groups"])
    for entry in cut[:-1]:  # every file but the last passed the limit by less than one row group
        body = entry["footer"]["offset"]
        assert 3000 <= body < 3000 + biggest_group
    rows = {}
    for name, entries in (("one", one), ("cut", cut)):
        fs, root = storage.filesystem(str(tmp_path / name))
        rows[name] = [r for e in entries for t in stream_shard(fs, storage.join(root, e["path"]), e)
                      for r in t.to_pylist()]
    assert [r["id"] for r in rows["cut"]] == [r["id"] for r in rows["one"]] and len(rows["one"]) == 10
    assert all(a["features"] == b["features"] for a, b in zip(rows["cut"], rows["one"]))


def test_teacher_logprobs_are_the_target_law_of_the_teacher_forced_pass(tiny_dir, tmp_path):
    """features.storage.teacher_topk K: each stored row holds the target's top-K next tokens
    and log-probs after every position, equal to a fresh full-vocabulary softmax; the
    manifest layout says K and the bytes per token count it; from_generation is refused."""
    import pyarrow.parquet as pq

    from pipelines.features.format import FeatureLayout
    from pipelines.features.writer import ShardWriter
    from specdec.target import load_target

    target = load_target(str(tiny_dir))
    shard = {"shard_id": "00001", "ids": ["a", "b"], "input_ids": [[5, 6, 7, 8, 9], [9, 10, 11]],
             "prompt_tokens": [2, 1], "finish_reason": ["stop", "length"], "skipped_ids": [], "skipped_reasons": [],
             "gen_tokens": 5, "gen_seconds": 0.0, "gen_pid": 0}
    writer = ShardWriter(target, [1, 4], "float16", "none", 2, str(tmp_path), {}, "k", "m", teacher_topk=4)
    writer.write_shard(shard)
    record = json.loads((tmp_path / "progress" / "shard-00001.json").read_text())
    layout = FeatureLayout.from_manifest(record["layout"])
    assert layout.teacher_topk == 4 and layout.nominal_bytes_per_token == 2 * 2 * target.hidden_size + 24
    rows = {r["id"]: r for r in pq.read_table(tmp_path / record["path"]).to_pylist()}
    for sid, seq in zip(shard["ids"], shard["input_ids"]):
        row = layout.decode_row(rows[sid])
        ids = torch.tensor([seq])
        out = target(ids, torch.arange(len(seq))[None])
        full = torch.log_softmax(target.logits(out.hidden).double(), -1)[0]
        top = full.topk(4, dim=-1)
        assert torch.equal(row["teacher_ids"], top.indices)
        torch.testing.assert_close(row["teacher_logprobs"].double(), top.values, atol=2e-3, rtol=1e-3)
    # a layout without teacher columns (every run made before them) decodes as before
    plain = FeatureLayout.from_manifest({k: v for k, v in record["layout"].items() if k != "teacher_topk"})
    assert plain.teacher_topk == 0 and "teacher_ids" not in plain.decode_row(rows["a"])
    with pytest.raises(ValueError, match="teacher-forced pass"):
        writer.write_shard(shard, recorded=[torch.zeros(5, 2 * target.hidden_size), torch.zeros(3, 2 * target.hidden_size)])
    with pytest.raises(ConfigError, match=r"features\.storage\.teacher_topk: teacher log-probs come from the "
                                          r"teacher-forced pass"):
        parse_section(FeaturesConfig, {"output": "x", "generation": {"backend": "hf"}, "extract": {"from_generation": True},
                                       "storage": {"teacher_topk": 8}}, "features")
    with pytest.raises(ConfigError, match=r"features\.storage\.teacher_topk: expected int in \[0, 256\]"):
        parse_section(FeaturesConfig, {"output": "x", "storage": {"teacher_topk": -1}}, "features")


def test_what_ray_data_read_tasks_import_loads_no_torch_nor_the_trainer():
    """Ray Data's read tasks and Ray Train's dataset actors import the modules whose functions
    they run (the readers, the split and replay filters) and their packages: none of it may pull
    in torch, Ray Train, DeepSpeed, MLflow or transformers, seconds of CPU in every such process
    (pipelines/lazy.py). The public names still load on first use."""
    import subprocess

    heavy = ["torch", "ray.train", "deepspeed", "mlflow", "transformers"]
    code = ("import sys; import pipelines.features.reader, pipelines.train.data, pipelines.config, serve_app.config; "
            f"print(sorted(m for m in {heavy!r} if m in sys.modules)); "
            "from pipelines.train import fit; from pipelines.features import read_runs, run_features; "
            "print(callable(fit) and callable(read_runs) and callable(run_features))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "True"], out.stdout
