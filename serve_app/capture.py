"""Capture of served traffic, the first stage of adapting a drafter to it: every request a
replica answers holds what a drafter learns from (the prompt as the target saw it and the
target's own answer). Opt-in (``ServeConfig.capture``), and off the request path:

* :meth:`CaptureWriter.offer` never blocks and never raises. A record goes into a bounded
  buffer, or is dropped and counted when the buffer is full.
* A daemon thread writes the buffer as Parquet files under ``uri``: at ``batch_rows`` records,
  or ``flush_s`` after the first one waiting, and on :meth:`CaptureWriter.close`. Each file is
  written whole or not at all, at ``<uri>/date=YYYY-MM-DD/<writer id>-<time>-<n>.parquet``.
  A failing store counts the batch as dropped and the error, logs it, and keeps serving.
* ``rate`` samples requests by a hash of their id, so a retried request is decided the same
  way every time. The caller honours OpenAI's ``"store": false``: such a request is never
  offered.

A record (:data:`CAPTURE_SCHEMA`) holds the request id and time; the served model; the drafter
(source and version); the prompt's token ids after the chat template; the answer's token ids;
the sampling settings; the finish reason; and the drafted tokens accepted in each cycle (A;
the cycle committed A + 1).
"""

from __future__ import annotations

import hashlib
import io
import logging
import queue
import threading
import time
import uuid
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.parquet as pq

from serve_app.config import CaptureSettings

log = logging.getLogger("serve_app.capture")

CAPTURE_SCHEMA = pa.schema([
    ("request_id", pa.string()),
    ("time", pa.timestamp("ms", tz="UTC")),
    ("model", pa.string()),
    ("drafter_source", pa.string()),
    ("drafter_version", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("answer_ids", pa.list_(pa.int32())),
    ("temperature", pa.float32()),
    ("top_p", pa.float32()),
    ("top_k", pa.int32()),
    ("max_tokens", pa.int32()),
    ("finish_reason", pa.string()),
    ("accepted", pa.list_(pa.int16())),
])


def sampled(request_id: str, rate: float) -> bool:
    """Whether ``request_id`` falls in the captured share ``rate`` (the same answer every time)."""
    if rate >= 1.0:
        return True
    return int(hashlib.sha256(request_id.encode()).hexdigest()[:8], 16) / 2 ** 32 < rate


class CaptureWriter:
    """A bounded buffer of records and the thread that writes them (see the module docstring)."""

    def __init__(self, settings: CaptureSettings, writer_id: str, storage_options: dict | None = None):
        from pipelines import storage

        self.settings, self.writer_id = settings, writer_id
        self.fs, self.root = storage.filesystem(settings.uri, storage_options)
        self._queue: queue.Queue = queue.Queue(maxsize=settings.max_buffer)
        self._stop = threading.Event()
        self._files = 0
        self.counts = {"captured": 0, "dropped": 0, "sampled_out": 0, "bytes": 0, "files": 0, "errors": 0}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="capture-writer", daemon=True)
        self._thread.start()

    def offer(self, record: dict) -> bool:
        """Queue ``record`` for writing; False (and counted) when it is sampled out or the
        buffer is full. Never blocks, never raises."""
        try:
            if not sampled(str(record.get("request_id", "")), self.settings.rate):
                self._count("sampled_out")
                return False
            self._queue.put_nowait(record)
            return True
        except queue.Full:
            self._count("dropped")
            return False
        except Exception:  # noqa: BLE001 - capture must never fail a request
            log.exception("capture: a record could not be queued")
            self._count("dropped")
            return False

    def stats(self) -> dict[str, int]:
        """captured / dropped / sampled_out records, bytes and files written, write errors."""
        with self._lock:
            return dict(self.counts)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is buffered, then stop the thread."""
        self._stop.set()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the writer thread
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def _run(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            batch = self._next_batch()
            if batch:
                self._write(batch)

    def _next_batch(self) -> list[dict]:
        """Up to ``batch_rows`` records: once that many wait, ``flush_s`` after the first one
        arrived, or what is left when closing (an empty batch: closing, nothing left)."""
        batch: list[dict] = []
        deadline = None
        while len(batch) < self.settings.batch_rows:
            timeout = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
            if timeout <= 0:
                break
            try:
                batch.append(self._queue.get(timeout=timeout))
            except queue.Empty:
                if self._stop.is_set():
                    break
                continue
            if deadline is None:
                deadline = time.monotonic() + self.settings.flush_s
        return batch

    def _write(self, batch: list[dict]) -> None:
        from pipelines import storage

        now = datetime.now(timezone.utc)
        self._files += 1
        path = storage.join(self.root, f"date={now:%Y-%m-%d}",
                            f"{self.writer_id}-{now:%H%M%S}-{self._files:06d}-{uuid.uuid4().hex[:6]}.parquet")
        try:
            table = pa.Table.from_pylist([_row(r) for r in batch], schema=CAPTURE_SCHEMA)
            buf = io.BytesIO()
            pq.write_table(table, buf, compression="zstd")
            storage.write_bytes(self.fs, path, buf.getvalue())
        except Exception as e:  # noqa: BLE001 - a failing store drops the batch, never the service
            log.error("capture: writing %d records to %s failed (%s); they are dropped", len(batch), path, e)
            self._count("errors")
            self._count("dropped", len(batch))
            return
        with self._lock:
            self.counts["captured"] += len(batch)
            self.counts["bytes"] += buf.getbuffer().nbytes
            self.counts["files"] += 1


def _row(record: dict) -> dict:
    """A record in the schema's types (the time as a UTC datetime)."""
    out = {name: record.get(name) for name in CAPTURE_SCHEMA.names}
    t = out["time"]
    out["time"] = datetime.fromtimestamp(t, timezone.utc) if isinstance(t, (int, float)) else t
    return out
