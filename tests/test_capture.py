"""The traffic capture writer (serve_app/capture.py): records reach Parquet files under the
capture URI (a directory, and the real S3 API on loopback) in the schema's types; a full buffer
drops and counts, never blocks; a failing store counts errors and keeps taking records; the
rate samples by request id, the same way every time; a bad setting names the field.
No Ray, no serving: a few seconds (unit tier)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from serve_app.capture import CAPTURE_SCHEMA, CaptureSettings, CaptureWriter, sampled

pytestmark = pytest.mark.unit


def record(i: int, **extra) -> dict:
    return {"request_id": f"req-{i}", "time": 1_765_000_000.0 + i, "model": "smollm2-135m",
            "drafter_source": "models:/dflash-smollm2-135m@champion", "drafter_version": "3",
            "prompt_ids": [1, 2, 3, i], "answer_ids": [7, 8, i], "temperature": 0.0, "top_p": 1.0, "top_k": 0,
            "max_tokens": 64, "finish_reason": "stop", "accepted": [2, 1, 3], **extra}


def written(root: Path) -> list[dict]:
    files = sorted(root.glob("date=*/*.parquet"))
    return [r for f in files for r in pq.read_table(f).to_pylist()]


def test_records_reach_parquet_files_in_batches_and_on_close(tmp_path):
    w = CaptureWriter(CaptureSettings(uri=str(tmp_path / "cap"), batch_rows=4, flush_s=60), "replica-a")
    assert all(w.offer(record(i)) for i in range(10))
    # two full batches are written without waiting for flush_s; the last 2 wait for it or close
    deadline = time.monotonic() + 30
    while w.stats()["captured"] < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w.stats()["captured"] == 8 and w.stats()["files"] == 2
    w.close()
    rows = written(tmp_path / "cap")
    assert sorted(r["request_id"] for r in rows) == sorted(f"req-{i}" for i in range(10))
    assert w.stats() == {"captured": 10, "dropped": 0, "sampled_out": 0, "files": 3, "errors": 0,
                         "bytes": sum(f.stat().st_size for f in (tmp_path / "cap").glob("date=*/*.parquet"))}
    table = pq.read_table(sorted((tmp_path / "cap").glob("date=*/*.parquet"))[0])
    assert table.schema.equals(CAPTURE_SCHEMA, check_metadata=False)
    first = next(r for r in rows if r["request_id"] == "req-3")
    assert first["prompt_ids"] == [1, 2, 3, 3] and first["answer_ids"] == [7, 8, 3] and first["accepted"] == [2, 1, 3]
    assert first["time"].timestamp() == pytest.approx(1_765_000_003.0)
    assert all(f.name.startswith("replica-a-") for f in (tmp_path / "cap").glob("date=*/*.parquet"))
    assert not list((tmp_path / "cap").rglob(".tmp-*"))  # every file whole


def test_a_waiting_record_is_written_within_flush_s(tmp_path):
    w = CaptureWriter(CaptureSettings(uri=str(tmp_path), batch_rows=100, flush_s=0.3), "r")
    w.offer(record(1))
    deadline = time.monotonic() + 30
    while w.stats()["files"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w.stats()["captured"] == 1  # well before the batch filled and without close
    w.close()


def test_a_full_buffer_drops_and_counts_without_blocking(tmp_path, monkeypatch):
    gate = threading.Event()
    from pipelines import storage

    real = storage.write_bytes

    def slow(fs, path, data):  # the store hangs until the test lets it go
        gate.wait(30)
        return real(fs, path, data)

    monkeypatch.setattr(storage, "write_bytes", slow)
    w = CaptureWriter(CaptureSettings(uri=str(tmp_path), max_buffer=3, batch_rows=1, flush_s=60), "r")
    # the store hangs until the gate opens: an offer that waited for it would never return
    accepted = [w.offer(record(i)) for i in range(20)]
    # one record may be in the writer's hands, 3 in the buffer; the rest are dropped
    assert sum(accepted) <= 4 and w.stats()["dropped"] == 20 - sum(accepted) >= 16
    gate.set()
    w.close()
    assert w.stats()["captured"] == sum(accepted) and len(written(tmp_path)) == sum(accepted)


def test_a_failing_store_counts_errors_and_keeps_taking_records(tmp_path, monkeypatch, caplog):
    from pipelines import storage

    real, fail = storage.write_bytes, {"on": True}

    def flaky(fs, path, data):
        if fail["on"]:
            raise OSError("the store is away")
        return real(fs, path, data)

    monkeypatch.setattr(storage, "write_bytes", flaky)
    w = CaptureWriter(CaptureSettings(uri=str(tmp_path), batch_rows=2, flush_s=60), "r")
    with caplog.at_level("ERROR", logger="serve_app.capture"):
        assert w.offer(record(1)) and w.offer(record(2))
        deadline = time.monotonic() + 30
        while w.stats()["errors"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert w.stats()["errors"] == 1 and w.stats()["dropped"] == 2 and "the store is away" in caplog.text
    fail["on"] = False
    assert w.offer(record(3)) and w.offer(record(4))
    w.close()
    assert [r["request_id"] for r in written(tmp_path)] == ["req-3", "req-4"] and w.stats()["captured"] == 2


def test_rate_samples_by_request_id_the_same_way_every_time(tmp_path):
    ids = [f"req-{i}" for i in range(2000)]
    share = sum(sampled(i, 0.25) for i in ids) / len(ids)
    assert 0.2 < share < 0.3 and [sampled(i, 0.25) for i in ids] == [sampled(i, 0.25) for i in ids]
    assert all(sampled(i, 1.0) for i in ids[:50])
    w = CaptureWriter(CaptureSettings(uri=str(tmp_path), rate=0.25, batch_rows=1000, flush_s=60), "r")
    taken = [w.offer(record(i)) for i in range(200)]
    w.close()
    assert taken == [sampled(f"req-{i}", 0.25) for i in range(200)]
    assert w.stats()["sampled_out"] == taken.count(False) and w.stats()["captured"] == taken.count(True)


def test_capture_to_the_s3_api(tmp_path):
    from s3_helpers import loopback_s3

    from pipelines import storage

    with loopback_s3("traffic") as options:
        w = CaptureWriter(CaptureSettings(uri="s3://traffic/captures", batch_rows=3, flush_s=60), "r", options)
        for i in range(5):
            w.offer(record(i))
        w.close()
        fs, root = storage.filesystem("s3://traffic/captures", options)
        files = sorted(fs.glob(f"{root}/date=*/*.parquet"))
        assert len(files) == 2 and w.stats()["captured"] == 5
        rows = [r for f in files for r in pq.read_table(fs.open(f, "rb")).to_pylist()]
        assert sorted(r["request_id"] for r in rows) == [f"req-{i}" for i in range(5)]


@pytest.mark.parametrize("settings, field", [
    ({"uri": " "}, "uri"), ({"uri": "x", "rate": 0}, "rate"), ({"uri": "x", "rate": 1.5}, "rate"),
    ({"uri": "x", "max_buffer": 0}, "max_buffer"), ({"uri": "x", "flush_s": 0}, "flush_s"),
    ({"uri": "x", "batchrows": 4}, "batchrows"), ({}, "uri")])
def test_bad_settings_name_the_field(settings, field):
    with pytest.raises(ValidationError) as e:
        CaptureSettings(**settings)
    assert e.value.errors()[0]["loc"] == (field,)
