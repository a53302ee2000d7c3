"""The feature pipeline end to end on a tiny target (real tokenizer), on a local Ray
cluster: to a local path and to a real S3 API (moto's server on loopback), killed and
resumed, corrupted and caught, mismatched and refused."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
import yaml

from pipelines import storage
from pipelines.config import ConfigError, load_features_config
from pipelines.features.format import FeatureLayout, ManifestMismatchError, expected_for
from pipelines.features import load_manifest, read_features, run_features, verify_features

REPO = Path(__file__).resolve().parents[1]
LAYERS = [0, 1, 2]  # <= L-2 of the 4-layer tiny target
NUM_PROMPTS = 11  # one of them is over the token cap and is skipped


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ray_address():
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=300 << 20,
                 logging_level="warning", log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("features")


@pytest.fixture(scope="module")
def tiny_dir(work) -> Path:
    from specdec.tiny import save_tiny_target

    return save_tiny_target(work / "tiny", num_layers=4)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from specdec.target import load_target

    return load_target(str(tiny_dir))


@pytest.fixture(scope="module")
def prompts_file(work) -> str:
    rows = [{"id": f"p{i}", "prompt": f"Question {i}: what is {i} times {i + 1}?"} for i in range(10)]
    rows.append({"id": "long", "prompt": "tell me a very long story " * 20})  # > max_prompt_tokens
    path = work / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def recipe(work: Path, tiny_dir: Path, source: str, output: str, name: str, **sections) -> Path:
    """A recipe file for the tiny target; ``sections`` are merged into ``features``."""
    features = {
        "output": output, "target": {"model": str(tiny_dir)}, "layer_ids": LAYERS,
        "prompts": {"source": source, "split": "all", "max_prompt_tokens": 60},
        "generation": {"max_new_tokens": 12, "batch_size": 4},
        "extract": {"batch_size": 3},
        "storage": {"samples_per_shard": 4},
    }
    for key, value in sections.items():
        features[key] = {**features[key], **value} if isinstance(value, dict) else value
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"features": features, "train": {"owned_by": "another stage"}}))
    return path


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def local_run(ray_address, work, tiny_dir, prompts_file):
    path = recipe(work, tiny_dir, prompts_file, str(work / "run-local"), "local")
    cfg = load_features_config(path)
    progress, logger = Lines(), logging.getLogger("pipelines.features")
    logger.addHandler(progress)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        summary = run_features(cfg)
    finally:
        logger.removeHandler(progress)
        logger.setLevel(old_level)
    return cfg, summary | {"log": progress.lines}


@pytest.fixture(scope="module")
def s3(ray_address):
    from s3_helpers import loopback_s3

    with loopback_s3("features") as options:
        yield options


# ---------------------------------------------------------------------------- helpers
def assert_exactly_once(uri: str, options: dict | None = None) -> dict:
    """The committed run holds every planned prompt once: as a row or as a counted skip."""
    m = load_manifest(uri, options)
    fs, root = storage.filesystem(uri, options)
    records = storage.read_json_many(fs, storage.list_files(fs, storage.join(root, "progress"), ".json"))
    ids = [i for r in records for i in r["ids"]]
    skipped = [i for r in records for i in r["skipped"]]
    assert len(ids) == len(set(ids)) == m["num_samples"] == NUM_PROMPTS - 1
    assert skipped == ["long"] and m["skipped"] == {"prompt_too_long": 1}
    assert len(m["shards"]) == len({s["shard_id"] for s in m["shards"]}) == 3
    listed = {s["path"] for s in m["shards"]}
    stored = {f"shards/{Path(p).name}" for p in storage.list_files(fs, storage.join(root, "shards"))}
    assert stored == listed  # no orphans of killed attempts, no temporaries
    report = verify_features(uri, options)
    assert report.ok, report.summary()
    return m


def check_rows_against_target(rows: list[dict], manifest: dict, tiny, bound) -> None:
    """Stored ids, masks and features equal a fresh single-sequence target pass."""
    layout = FeatureLayout.from_manifest(manifest)
    for row in rows[:3]:
        dec = layout.decode_row(row)
        n, p = row["num_tokens"], row["prompt_tokens"]
        assert dec["features"].shape == (n, len(LAYERS) * 64)
        assert dec["loss_mask"].tolist() == [False] * p + [True] * (n - p) and n > p
        prompt = [{"role": "user", "content": f"Question {row['id'][1:]}: what is {int(row['id'][1:])} times "
                                              f"{int(row['id'][1:]) + 1}?"}]
        assert dec["input_ids"][:p].tolist() == tiny.encode_chat(prompt)
        ids = dec["input_ids"][None]
        ref = tiny(ids, torch.arange(n)[None], None, None, LAYERS).features[0]
        assert bound(dec["features"], ref), (row["id"], (dec["features"] - ref).abs().max())


# ---------------------------------------------------------------------------- tests
def test_local_run_end_to_end(local_run, tiny):
    cfg, summary = local_run
    uri = storage.absolute_uri(cfg.output)
    m = assert_exactly_once(uri)
    assert summary["shards_run"] == 3 and summary["num_samples"] == 10
    shard_lines = [line for line in summary["log"] if "committed |" in line]
    assert len(shard_lines) == 3  # progress while it runs: one line per shard
    assert all("rows/s" in line and "tok/s" in line and "written" in line for line in shard_lines)
    assert m["target"]["identity"] == tiny.identity and m["target"]["model_id"] == cfg.target.model
    assert m["extraction"] == "teacher_forced"
    assert (m["layer_ids"], m["hidden_size"], m["dtype"], m["feature_dim"]) == (LAYERS, 64, "float16", 192)
    assert m["tokenizer"]["hash"] == expected_for(tiny, LAYERS)["tokenizer_hash"]
    assert m["num_tokens"] == sum(s["tokens"] for s in m["shards"])
    assert m["nominal_bytes_per_token"] == 3 * 64 * 2
    # Parquet footers dominate the overhead at this toy width (192 features, 4 samples a shard)
    assert m["nominal_bytes_per_token"] <= m["bytes_per_token"] < 1.3 * m["nominal_bytes_per_token"]

    rows = read_features(uri, **expected_for(tiny, LAYERS)).take_all()
    assert sorted(r["id"] for r in rows) == sorted(f"p{i}" for i in range(10))
    check_rows_against_target(rows, m, tiny, lambda got, ref: torch.allclose(got, ref, rtol=2e-3, atol=2e-3))

    # idempotent: running again changes nothing
    before = {p: p.stat().st_mtime_ns for p in Path(uri).rglob("*") if p.is_file()}
    again = run_features(cfg)
    assert again["already_committed"] and again["shards_run"] == 0
    assert {p: p.stat().st_mtime_ns for p in Path(uri).rglob("*") if p.is_file()} == before


def test_features_from_generation_match_the_teacher_forced_run(local_run, ray_address, work, tiny_dir,
                                                                prompts_file, tiny):
    """extract.from_generation: one stage, the same sequences and (to fp16) the same
    features as the two-stage run, except the last token of each sequence (zero)."""
    path = recipe(work, tiny_dir, prompts_file, str(work / "run-fused"), "fused", extract={"from_generation": True})
    cfg = load_features_config(path)
    summary = run_features(cfg)
    uri = storage.absolute_uri(cfg.output)
    m = assert_exactly_once(uri)
    assert summary["shards_run"] == 3 and m["extraction"] == "generation"
    layout = FeatureLayout.from_manifest(m)
    fused = {r["id"]: layout.decode_row(r) for r in read_features(uri, **expected_for(tiny, LAYERS)).take_all()}
    base_uri = storage.absolute_uri(local_run[0].output)
    base = {r["id"]: layout.decode_row(r) for r in read_features(base_uri, **expected_for(tiny, LAYERS)).take_all()}
    assert fused.keys() == base.keys()
    for key, row in fused.items():
        assert row["input_ids"].tolist() == base[key]["input_ids"].tolist()
        assert row["loss_mask"].tolist() == base[key]["loss_mask"].tolist()
        torch.testing.assert_close(row["features"][:-1], base[key]["features"][:-1], rtol=2e-3, atol=2e-3)
        assert not row["features"][-1].any()


def test_dataset_answers_are_teacher_forced_without_generation(ray_address, work, tiny_dir, tiny):
    """generation.backend dataset: prompt + the dataset's own answer (capped, ended by the
    end-of-turn token), features from one target pass; prompts without an answer or over
    the cap are skipped and counted; skip starts after the first N prompts."""
    from pipelines.features.workers import answer_tokens

    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                         {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. " * (1 + i % 3)}]}
            for i in range(7)]
    rows.append({"id": "open", "messages": [{"role": "user", "content": "a question nobody answered"}]})
    rows.append({"id": "long", "messages": [{"role": "user", "content": "tell me a long story " * 20},
                                            {"role": "assistant", "content": "no"}]})
    path = work / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_features_config(recipe(work, tiny_dir, str(path), str(work / "run-answers"), "answers",
                                      prompts={"skip": 1}, generation={"backend": "dataset", "max_new_tokens": 16}))
    summary = run_features(cfg)
    uri = storage.absolute_uri(cfg.output)
    m = load_manifest(uri)
    assert summary["num_samples"] == m["num_samples"] == 6  # c1..c6; c0 skipped by prompts.skip
    assert m["skipped"] == {"no_answer": 1, "prompt_too_long": 1}
    assert verify_features(uri).ok
    stored = {r["id"]: r for r in read_features(uri, **expected_for(tiny, LAYERS)).take_all()}
    assert sorted(stored) == [f"c{i}" for i in range(1, 7)]
    layout = FeatureLayout.from_manifest(m)
    for row in rows[1:7]:
        dec = layout.decode_row(stored[row["id"]])
        prompt = tiny.encode_chat(row["messages"][:1])
        answer = answer_tokens(tiny.tokenizer, row["messages"][:1], prompt, row["messages"][1]["content"])
        assert answer[-1] == tiny.tokenizer.eos_token_id and len(answer) > 4
        assert dec["input_ids"].tolist() == prompt + answer[:16]
        assert stored[row["id"]]["finish_reason"] == ("stop" if len(answer) <= 16 else "length")
        assert dec["loss_mask"].tolist() == [False] * len(prompt) + [True] * min(len(answer), 16)
        ids = dec["input_ids"][None]
        ref = tiny(ids, torch.arange(ids.shape[1])[None], None, None, LAYERS).features[0]
        torch.testing.assert_close(dec["features"], ref, rtol=2e-3, atol=2e-3)
    assert {r["finish_reason"] for r in stored.values()} == {"stop", "length"}  # both cases exercised


def test_captured_traffic_is_teacher_forced_without_generation(ray_address, work, tiny_dir, tiny):
    """prompts.source captured (generation.backend captured): the records serve_app's capture
    writer left become prompt + the target's answer as served, one per prompt (a prompt asked
    again adds nothing), only the window's, capped; features from one target pass."""
    from pipelines.features.captured import sample_id
    from serve_app.capture import CaptureWriter
    from serve_app.config import CaptureSettings
    from specdec.engine import Engine, Request

    writer = CaptureWriter(CaptureSettings(uri=str(work / "captured"), flush_s=0.05), "replica-a")
    prompts = [tiny.encode_chat([{"role": "user", "content": f"Captured question {i}?"}]) for i in range(5)]
    answers = [r.tokens for r in Engine(tiny).generate([Request(p, 14) for p in prompts])]
    now = time.time()
    records = [(p, a, now) for p, a in zip(prompts, answers)] + [(prompts[0], answers[1], now + 1),  # asked again
                                                                   (prompts[4][:3], answers[4], now - 86400)]  # before
    for i, (p, a, t) in enumerate(records):
        assert writer.offer({"request_id": f"r{i}", "time": t, "model": "tiny", "drafter_source": "", "drafter_version": "",
                             "prompt_ids": p, "answer_ids": a, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                             "max_tokens": 14, "finish_reason": "length", "accepted": []})
    writer.close()
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - 3600))
    cfg = load_features_config(recipe(work, tiny_dir, "captured", str(work / "run-captured"), "captured",
                                      prompts={"captured": {"uris": [str(work / "captured")], "since": since}},
                                      generation={"backend": "captured", "max_new_tokens": 10}))
    summary = run_features(cfg)
    uri = storage.absolute_uri(cfg.output)
    m = load_manifest(uri)
    assert summary["num_samples"] == m["num_samples"] == 5 and verify_features(uri).ok
    stored = {r["id"]: r for r in read_features(uri, **expected_for(tiny, LAYERS)).take_all()}
    assert sorted(stored) == sorted(sample_id(p) for p in prompts)
    layout = FeatureLayout.from_manifest(m)
    for p, a in zip(prompts, answers):
        dec = layout.decode_row(stored[sample_id(p)])
        assert dec["input_ids"].tolist() == p + a[:10] and stored[sample_id(p)]["finish_reason"] == "length"
        assert dec["loss_mask"].tolist() == [False] * len(p) + [True] * min(len(a), 10)
        ids = dec["input_ids"][None]
        ref = tiny(ids, torch.arange(ids.shape[1])[None], None, None, LAYERS).features[0]
        torch.testing.assert_close(dec["features"], ref, rtol=2e-3, atol=2e-3)
    assert m["generation"]["backend"] == "captured" and m["prompts"]["captured"]["since"].startswith(since[:10])


def test_restart_with_other_settings_is_refused(local_run):
    cfg, _ = local_run
    changed = copy.deepcopy(cfg)
    changed.generation.temperature = 0.7
    with pytest.raises(ConfigError, match=r"features\.generation\.temperature: the run at .* was started with 0\.0"):
        run_features(changed)


def test_corrupt_shard_is_named_by_verify_and_reader(local_run, work, tiny):
    cfg, _ = local_run
    bad = work / "run-corrupt"
    shutil.copytree(storage.absolute_uri(cfg.output), bad)
    shard = load_manifest(str(bad))["shards"][1]["path"]
    data = bytearray((bad / shard).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the features
    (bad / shard).write_bytes(bytes(data))

    job = subprocess.run([sys.executable, str(REPO / "jobs" / "generate_features.py"), "--verify", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert job.returncode == 1, job.stdout + job.stderr
    assert shard in job.stdout and "sha256" in job.stdout
    assert [where for where, _ in verify_features(str(bad)).problems] == [shard]

    with pytest.raises(Exception) as err:
        read_features(str(bad), **expected_for(tiny, LAYERS)).take_all()
    assert shard in str(err.value) and "corrupt feature shard" in str(err.value)


def test_reader_refuses_a_manifest_for_another_target(local_run, tiny, work):
    cfg, _ = local_run
    uri = storage.absolute_uri(cfg.output)
    good = expected_for(tiny, LAYERS)
    for change, field in [({"target_identity": "0" * 64}, "target.identity"), ({"layer_ids": [1, 2]}, "layer_ids"),
                          ({"hidden_size": 576}, "hidden_size"), ({"tokenizer_hash": "x"}, "tokenizer.hash")]:
        with pytest.raises(ManifestMismatchError) as err:
            read_features(uri, **{**good, **change})
        assert err.value.field == field and f"'{field}'" in str(err.value)
    with pytest.raises(FileNotFoundError, match="not committed"):
        read_features(str(work / "no-such-run"))


def test_s3_end_to_end_int8(s3, work, tiny_dir, prompts_file, tiny):
    uri = "s3://features/runs/tiny-int8"
    path = recipe(work, tiny_dir, prompts_file, uri, "s3", storage={"dtype": "int8", "options": s3})
    summary = run_features(load_features_config(path))
    assert summary["num_samples"] == 10
    m = assert_exactly_once(uri, s3)
    assert (m["dtype"], m["scale_dtype"]) == ("int8", "float32")
    # int8 + a float32 scale per token and layer: 192 + 12 bytes a token, plus ids/mask/footers
    assert m["nominal_bytes_per_token"] == 192 and m["bytes_per_token"] < 1.3 * (192 + 12)

    rows = read_features(uri, storage_options=s3, **expected_for(tiny, LAYERS)).take_all()
    assert len(rows) == 10

    def within_int8_bound(got, ref):  # |error| <= max|x| / 254 per token and layer (+ fp32 slack)
        err = (got - ref).abs().view(len(ref), len(LAYERS), -1)
        bound = ref.abs().view(len(ref), len(LAYERS), -1).amax(-1, keepdim=True) / 254
        return bool((err <= bound * 1.001 + 1e-5).all())

    check_rows_against_target(rows, m, tiny, within_int8_bound)
    assert "vllm" not in sys.modules


def test_driver_killed_mid_run_then_resumed(ray_address, work, tiny_dir, prompts_file):
    out = work / "run-driver-kill"
    path = recipe(work, tiny_dir, prompts_file, str(out), "driver-kill", generation={"max_new_tokens": 24})
    log = open(work / "driver-kill.log", "w")
    job = subprocess.Popen([sys.executable, str(REPO / "jobs" / "generate_features.py"), "--config", str(path)],
                           env={**os.environ, "RAY_ADDRESS": ray_address}, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    try:
        wait_for_records(out, 1, job)
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the whole job process group, as a node failure would
        job.wait()
    assert not (out / "manifest.json").exists()
    committed = len(list((out / "progress").glob("*.json")))
    assert 1 <= committed < 3

    summary = run_features(load_features_config(path))
    assert summary["shards_skipped"] >= committed and summary["shards_run"] + summary["shards_skipped"] == 3
    assert_exactly_once(str(out))


def test_worker_killed_mid_run(ray_address, work, tiny_dir, prompts_file):
    out = work / "run-worker-kill"
    path = recipe(work, tiny_dir, prompts_file, str(out), "worker-kill", generation={"max_new_tokens": 24},
                  storage={"samples_per_shard": 4})
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(run(load_features_config(path))), daemon=True)

    def run(cfg):
        try:
            return {"summary": run_features(cfg)}
        except BaseException as e:  # surfaced below
            return {"error": e}

    runner.start()
    record = wait_for_records(out, 1)[0]
    os.kill(record["extract_pid"], signal.SIGKILL)  # the actor writing shards, mid-run
    runner.join(timeout=240)
    assert not runner.is_alive()
    if "error" in result:  # Ray Data retries a lost actor's work; a failed run must still resume cleanly
        result = {"summary": run_features(load_features_config(path))}
    assert result["summary"]["num_samples"] == 10
    assert_exactly_once(str(out))


def wait_for_records(out: Path, n: int, job: subprocess.Popen | None = None, timeout: float = 150) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted((out / "progress").glob("*.json")) if (out / "progress").exists() else []
        if len(found) >= n:
            return [json.loads(p.read_text()) for p in found]
        if job is not None and job.poll() is not None:
            pytest.fail(f"the job exited ({job.returncode}) before committing a shard")
        time.sleep(0.02)
    pytest.fail(f"no {n} committed shard(s) in {out} after {timeout} s")
