"""Writing a shard's features: :class:`ShardWriter` computes them from the shard's sequences a
mini-batch at a time and writes Parquet files (a row group per mini-batch; :class:`ShardFiles`
closes a file and starts the next one at ``shard_bytes``) under a per-attempt name, then
commits the shard by its progress record. Features never leave the writing actor except as
bytes on their way to storage, so memory stays bounded by a couple of mini-batches whatever
the run's size.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipelines import storage
from pipelines.features.format import FeatureLayout, shard_schema, tokenizer_fingerprint
from pipelines.features.shards import STATUS_SCHEMA, chunks, progress_path
from pipelines.features.target_pass import pad_stack, resolve_layer_ids, target_features


class ShardWriter:
    """Features of a shard's sequences -> one Parquet file (a row group per mini-batch)
    -> the shard's progress record, its commit point."""

    @classmethod
    def for_stage(cls, loaded, target: dict, layer_ids: list[int] | None, num_layers: int, storage_cfg: dict,
                  batch_size: int, run_uri: str, storage_options: dict, run_key: str) -> "ShardWriter":
        """The writer a pipeline actor uses, from the stage's recipe sections."""
        return cls(loaded, resolve_layer_ids(layer_ids, num_layers, loaded.num_layers), storage_cfg["dtype"],
                   storage_cfg["compression"], batch_size, run_uri, storage_options, run_key,
                   model_id=target["model"], teacher_topk=storage_cfg.get("teacher_topk", 0),
                   shard_bytes=storage_cfg.get("shard_bytes"))

    def __init__(self, target, layer_ids: list[int], dtype: str, compression: str, batch_size: int,
                 run_uri: str, storage_options: dict, run_key: str, model_id: str, overlap_io: bool | None = None,
                 teacher_topk: int = 0, shard_bytes: int | None = None):
        self.target = target
        self.layer_ids = list(layer_ids)
        self.layout = FeatureLayout(dtype, tuple(self.layer_ids), target.hidden_size, teacher_topk)
        self.compression = compression
        self.batch_size = batch_size
        self.shard_bytes = shard_bytes  # a file closes once it holds this many bytes (None: never)
        self.fs, self.root = storage.filesystem(run_uri, storage_options)
        self.run_key = run_key
        self.model_id = model_id
        self.tokenizer = tokenizer_fingerprint(target.tokenizer)
        # On a GPU one background thread writes (and uploads) a mini-batch while the next
        # one runs through the target; at most one is pending, so memory stays bounded. On
        # a CPU the forward pass already uses every core and a second busy thread only
        # stalls its thread team, so writes happen inline there.
        overlap = target.device.type != "cpu" if overlap_io is None else overlap_io
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") if overlap else None

    # ------------------------------------------------------------------ compute
    def features(self, sequences: list[list[int]]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """This writer's layers (and teacher law) of ``sequences``: :func:`target_features`."""
        return target_features(self.target, self.layer_ids, sequences, self.layout.teacher_topk)

    # ------------------------------------------------------------------ one shard
    def write_shard(self, shard: dict, recorded: list[torch.Tensor] | None = None) -> dict:
        """Write and commit one shard (one file, or several of about ``shard_bytes`` each);
        ``recorded`` (per sequence, as in ``shard``) are features computed while generating,
        else one teacher-forced pass computes them."""
        if recorded is not None and self.layout.teacher_topk:
            raise ValueError("teacher log-probs come from the teacher-forced pass; recorded features have none")
        t0 = time.perf_counter()
        shard_id = shard["shard_id"]
        order = sorted(range(len(shard["ids"])), key=lambda i: len(shard["input_ids"][i]))
        tokens = sum(len(s) for s in shard["input_ids"])
        files = ShardFiles(self, shard_id)
        pending = None
        try:
            for chunk in chunks(order, self.batch_size):
                seqs = [shard["input_ids"][i] for i in chunk]
                # tensor work stays on this thread (a second thread would start its own
                # intra-op thread team); the I/O thread only builds, hashes and writes bytes
                lens = [len(q) for q in seqs]
                if recorded is not None:
                    feats, teacher = pad_stack([recorded[i] for i in chunk]), None
                else:
                    feats, teacher = self.features(seqs)
                encoded = self.layout.encode_batch(feats, lens)
                teacher = self.layout.encode_teacher(*teacher, lens) if teacher is not None else None
                if pending is not None:
                    pending.result()
                args = (*files.next_group(len(chunk), sum(lens)), shard, chunk, encoded, teacher)
                pending = self.io.submit(self._write_rows, *args) if self.io is not None else self._write_rows(*args)
            if pending is not None:
                pending.result()
            parts = files.finish()
        except BaseException as e:
            if pending is not None:
                pending.exception()  # never abandon a sink while the I/O thread writes to it
            files.abort(e)
            raise
        record = {
            "shard_id": shard_id, "path": parts[0]["path"], "rows": len(shard["ids"]), "tokens": tokens,
            "response_tokens": tokens - sum(shard["prompt_tokens"]), "bytes": sum(f["bytes"] for f in parts),
            "sha256": parts[0]["sha256"], "files": parts,
            "ids": list(shard["ids"]), "skipped": dict(zip(shard["skipped_ids"], shard["skipped_reasons"])),
            "run_key": self.run_key,
            "target": {"model_id": self.model_id, "identity": self.target.identity,
                       "num_layers": self.target.num_layers, "hidden_size": self.target.hidden_size,
                       "vocab_size": self.target.vocab_size, "dtype": str(self.target.dtype).replace("torch.", "")},
            "tokenizer": self.tokenizer, "layout": self.layout.as_dict(),
            "gen_tokens": shard["gen_tokens"], "gen_seconds": shard["gen_seconds"],
            "extract_seconds": time.perf_counter() - t0,
            "host": socket.gethostname(), "gen_pid": shard["gen_pid"], "extract_pid": os.getpid(),
            "written_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        storage.write_json(self.fs, progress_path(self.root, shard_id), record)  # the shard's commit point
        return {k: record[k] for k in STATUS_SCHEMA.names if k != "skipped"} | {"skipped": len(record["skipped"])}

    def _parquet_writer(self, sink) -> pq.ParquetWriter:
        schema = shard_schema(self.layout.as_dict())
        codec = {"none": "NONE", "zstd": "ZSTD"}[self.compression]
        # Ids and masks shrink a lot under zstd; features (near-random mantissas) barely
        # do, so they are stored as is by default and cost exactly their nominal size.
        compression = {name: "ZSTD" for name in schema.names} | {"features": codec, "scales": codec}
        return pq.ParquetWriter(sink, schema, compression=compression, use_dictionary=["id", "finish_reason"],
                                write_statistics=["num_tokens", "prompt_tokens"])

    def _write_rows(self, writer: pq.ParquetWriter, sink: storage.HashingWriter, row_groups: list[dict],
                    shard: dict, chunk: list[int], encoded: list[tuple[bytes, bytes | None]],
                    teacher: list[tuple[bytes, bytes]] | None = None) -> None:
        """Write one encoded mini-batch as a row group (runs on the I/O thread) and record
        its byte range and digest: pyarrow hands a row group to the sink whole as
        ``write_table`` returns, so the bytes since the last cut are exactly this group
        (the first one also holds the file's leading magic bytes)."""
        rows = {name: [] for name in writer.schema.names}
        for k, (i, (data, scales)) in enumerate(zip(chunk, encoded)):
            n, p = len(shard["input_ids"][i]), shard["prompt_tokens"][i]
            rows["id"].append(shard["ids"][i])
            rows["input_ids"].append(shard["input_ids"][i])
            rows["loss_mask"].append([0] * p + [1] * (n - p))
            rows["num_tokens"].append(n)
            rows["prompt_tokens"].append(p)
            rows["finish_reason"].append(shard["finish_reason"][i])
            rows["features"].append(data)
            rows["scales"].append(scales)
            teacher_ids, teacher_logprobs = teacher[k] if teacher is not None else (None, None)
            rows["teacher_ids"].append(teacher_ids)
            rows["teacher_logprobs"].append(teacher_logprobs)
        writer.write_table(pa.Table.from_pydict(rows, schema=writer.schema))
        row_groups.append({**sink.cut(), "rows": len(chunk)})


class ShardFiles:
    """The Parquet files of one attempt at a shard: a file is closed, and the next one
    started, once it holds ``shard_bytes`` (checked between row groups), so files are sized
    by bytes whatever the samples' lengths. Each file is written atomically; none is
    listed anywhere until the shard's progress record commits them all."""

    def __init__(self, writer: "ShardWriter", shard_id: str):
        self.writer, self.shard_id = writer, shard_id
        self.attempt = uuid.uuid4().hex[:8]  # per attempt: retries never clash
        self.parts: list[dict] = []
        self.open = None  # (atomic-write context, sink, Parquet writer, part record)

    def next_group(self, rows: int, tokens: int) -> tuple:
        """(Parquet writer, sink, row-group list) the next row group of ``rows`` goes to."""
        if self.open is not None and self.writer.shard_bytes and self.open[1].nbytes >= self.writer.shard_bytes:
            self._close()
        if self.open is None:
            self._start()
        _, sink, pq_writer, part = self.open
        part["rows"] += rows
        part["tokens"] += tokens
        return pq_writer, sink, part["row_groups"]

    def finish(self) -> list[dict]:
        """Close the last file; the shard's files as its progress record lists them."""
        if self.open is None and not self.parts:
            self._start()  # a shard whose samples were all skipped still has its (empty) file
        if self.open is not None:
            self._close()
        return self.parts

    def abort(self, error: BaseException) -> None:
        """Discard the file being written (committed ones are orphans, removed at commit)."""
        if self.open is not None:
            context = self.open[0]
            self.open = None
            context.__exit__(type(error), error, error.__traceback__)

    def _start(self) -> None:
        k = len(self.parts)
        rel = f"shards/shard-{self.shard_id}-{self.attempt}{f'-{k}' if k else ''}.parquet"
        context = storage.open_atomic(self.writer.fs, storage.join(self.writer.root, rel))
        sink = context.__enter__()
        part = {"path": rel, "rows": 0, "tokens": 0, "row_groups": []}
        self.open = (context, sink, self.writer._parquet_writer(sink), part)

    def _close(self) -> None:
        context, sink, pq_writer, part = self.open
        pq_writer.close()
        part.update(footer=sink.cut(), bytes=sink.nbytes, sha256=sink.hexdigest)
        self.open = None
        context.__exit__(None, None, None)  # the file appears whole
        self.parts.append(part)
