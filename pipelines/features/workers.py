"""The Ray Data workers of the feature pipeline. The unit of work is a shard: one input
row carries the prompts of one shard (``shard_id``, ``ids``, ``messages`` as JSON).

* :class:`Regenerate` (hf backend): the target answers the shard's prompts with the
  specdec engine (batched KV-cache decoding) and emits the shard's token sequences.
* :func:`regenerate_vllm` (vllm backend): the same through Ray Data's vLLM processor.
* :class:`DatasetAnswers` (dataset backend): the dataset's own answers, no generation.
* :class:`ExtractFeatures`: one teacher-forced target pass per mini-batch captures the
  selected layers; the shard is written as one Parquet file (a row group per mini-batch)
  and then committed by a small JSON record. It returns one status row per shard.
* :class:`GenerateAndWrite` (``extract.from_generation``, hf backend): one actor does both,
  keeping the features that decoding computes anyway (no second pass).

Features never leave the extracting actor except as bytes on their way to storage, so
memory stays bounded by a couple of mini-batches whatever the run's size.
"""

from __future__ import annotations

import hashlib
import json
import logging
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
from pipelines.config import ConfigError
from pipelines.features.format import FeatureLayout, shard_schema, tokenizer_fingerprint

log = logging.getLogger(__name__)

#: A shard after regeneration: the token sequences the features are computed over.
SEQUENCES_SCHEMA = pa.schema([
    ("shard_id", pa.string()),
    ("ids", pa.list_(pa.string())),
    ("input_ids", pa.list_(pa.list_(pa.int32()))),
    ("prompt_tokens", pa.list_(pa.int32())),
    ("finish_reason", pa.list_(pa.string())),
    ("skipped_ids", pa.list_(pa.string())),
    ("skipped_reasons", pa.list_(pa.string())),
    ("gen_tokens", pa.int64()),
    ("gen_seconds", pa.float64()),
    ("gen_start", pa.float64()),  # unix time the shard's generation began: with gen_seconds, the run's window
    ("gen_pid", pa.int64()),
])

#: What the driver sees per committed shard (the record without the id lists).
STATUS_SCHEMA = pa.schema([
    ("shard_id", pa.string()),
    ("path", pa.string()),
    ("rows", pa.int64()),
    ("tokens", pa.int64()),
    ("response_tokens", pa.int64()),
    ("bytes", pa.int64()),
    ("sha256", pa.string()),
    ("skipped", pa.int64()),
    ("gen_tokens", pa.int64()),
    ("gen_seconds", pa.float64()),
    ("extract_seconds", pa.float64()),
])

SKIP_PROMPT_TOO_LONG = "prompt_too_long"
SKIP_NO_ANSWER = "no_answer"  # generation.backend dataset: the conversation has no answer to the prompt


def progress_path(root: str, shard_id: str) -> str:
    return storage.join(root, "progress", f"shard-{shard_id}.json")


# ---------------------------------------------------------------------------- shared helpers
def load_stage_target(target: dict, num_gpus: float, num_cpus: float | None = None):
    """The target for a worker: on the GPU when the stage asked Ray for one. On a CPU the
    stage's ``num_cpus`` sets torch's thread count: Ray exports no OMP_NUM_THREADS for
    fractional CPUs, and every actor then spawning one thread per core oversubscribes."""
    from specdec.target import load_target

    device = "cuda" if num_gpus > 0 and torch.cuda.is_available() else "cpu"
    if device == "cpu" and num_cpus is not None:
        torch.set_num_threads(max(1, round(num_cpus)))
    return load_target(target["model"], dtype=target["dtype"], device=device,
                       trust_remote_code=target["trust_remote_code"])


def resolve_layer_ids(layer_ids: list[int] | None, num_features: int, num_target_layers: int) -> list[int]:
    """The configured layers, or the drafter's default spacing; checked against the target."""
    from specdec.target import default_target_layer_ids

    if layer_ids is None:
        layer_ids = default_target_layer_ids(num_target_layers, num_features)
        if len(set(layer_ids)) != len(layer_ids):
            raise ConfigError(f"features.num_layers: {num_features} layers spaced over a {num_target_layers}-layer "
                              f"target repeat layers ({layer_ids}); set features.layer_ids")
    # <= L-2: the exported drafter must load in vLLM, which reads layer i+1's input for layer i
    bad = [i for i in layer_ids if i > num_target_layers - 2]
    if bad:
        raise ConfigError(f"features.layer_ids: layers {bad} out of range; a {num_target_layers}-layer target "
                          f"allows 0..{num_target_layers - 2} (the last layer's output is not a drafter feature)")
    return list(layer_ids)


@torch.no_grad()
def target_features(target, layer_ids: list[int], sequences: list[list[int]], teacher_topk: int = 0
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(B, T_max, n_layers * hidden) features of right-padded sequences (causal, so
    padding after a sequence never reaches it), and with ``teacher_topk`` K the target's
    top-K next-token (ids, log-probs), each (B, T_max, K), from the same pass. Stored
    shards and streamed training rows (``pipelines/train/streamed.py``) both come from here."""
    dev = target.device
    lens = [len(s) for s in sequences]
    ids = torch.zeros(len(sequences), max(lens), dtype=torch.long, device=dev)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long, device=dev)
    pos = torch.arange(ids.shape[1], device=dev)[None].expand_as(ids)
    out = target(ids, pos, None, None, layer_ids)
    return out.features, (target.topk_logprobs(out.hidden, teacher_topk) if teacher_topk else None)


class PromptEncoder:
    """Chat messages -> prompt token ids, exactly as the target's template renders them."""

    def __init__(self, tokenizer, enable_thinking: bool | None, max_prompt_tokens: int):
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        if enable_thinking is not None and "enable_thinking" not in template:
            log.warning("the chat template has no thinking switch; features.generation.enable_thinking is ignored")
            enable_thinking = None
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        self.max_prompt_tokens = max_prompt_tokens

    def __call__(self, messages: list[dict]) -> list[int] | None:
        """Prompt ids, or None when the prompt exceeds the token cap."""
        from specdec.target import encode_chat

        # one rendering for data, training and serving, without loading the model
        ids = encode_chat(self.tokenizer, messages, add_generation_prompt=True, enable_thinking=self.enable_thinking)
        return ids if len(ids) <= self.max_prompt_tokens else None


def load_shard_row(row: dict, storage_options: dict | None) -> dict:
    """A pipeline row as the stages need it: the shard's samples, read from its plan file when
    the row names one (``run_features``), as they are otherwise (tools, tests)."""
    if "plan_uri" not in row:
        return row
    fs, path = storage.filesystem(row["plan_uri"], storage_options)
    return storage.read_json(fs, path)


def encode_shard(encode: PromptEncoder, shard: dict) -> tuple[dict, list[tuple[str, list[int]]]]:
    """A shard's empty sequences record with its too-long prompts already skipped (and named),
    and the (sample id, prompt ids) pairs left to answer, in the shard's order."""
    out, todo = _empty_sequences(shard["shard_id"]), []
    for sample_id, messages in zip(shard["ids"], shard["messages"]):
        prompt = encode(json.loads(messages))
        if prompt is None:
            out["skipped_ids"].append(sample_id)
            out["skipped_reasons"].append(SKIP_PROMPT_TOO_LONG)
        else:
            todo.append((sample_id, prompt))
    return out, todo


def shard_seed(seed: int, shard_id: str) -> int:
    """A per-shard sampling seed: a re-run shard draws the same responses."""
    return int(hashlib.sha256(f"{seed}:{shard_id}".encode()).hexdigest()[:15], 16)


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i: i + size]


# ---------------------------------------------------------------------------- regeneration (hf)
class Regenerate:
    """Stateful Ray Data actor: the target writes the responses of one shard per row."""

    def __init__(self, target: dict, generation: dict, max_prompt_tokens: int, storage_options: dict | None = None):
        from specdec.sampling import SamplingParams

        self.storage_options = storage_options
        self.target = load_stage_target(target, generation["num_gpus"], generation["num_cpus"])
        self.encode = PromptEncoder(self.target.tokenizer, generation["enable_thinking"], max_prompt_tokens)
        self.params = SamplingParams(generation["temperature"], generation["top_p"], generation["top_k"])
        self.gen = generation

    def __call__(self, batch: pa.Table) -> pa.Table:
        return pa.Table.from_pylist([self.regenerate(load_shard_row(row, self.storage_options))
                                     for row in batch.to_pylist()], schema=SEQUENCES_SCHEMA)

    def regenerate(self, shard: dict, record_layers: list[int] | None = None,
                   record_dtype: torch.dtype | None = None) -> dict:
        """The shard's sequences; with ``record_layers`` also ``features``: per sequence the
        (tokens, F) features decoding computed (see :class:`FeatureRecorder`)."""
        from specdec.engine import Engine, Request

        t0 = time.perf_counter()
        out, todo = encode_shard(self.encode, shard)
        todo.sort(key=lambda item: len(item[1]))  # similar lengths are admitted together: less padding
        recorder = FeatureRecorder(record_layers, record_dtype) if record_layers else None
        engine = Engine(self.target, recorder, width=1, seed=shard_seed(self.gen["seed"], shard["shard_id"]))
        finished = {}
        for result in continuous_batches(engine, [Request(p, self.gen["max_new_tokens"], self.params, id=i)
                                                  for i, (_, p) in enumerate(todo)], self.gen["batch_size"]):
            finished[result.request.id] = (result, recorder.features(result) if recorder else None)
        if recorder:
            out["features"] = []
        for i, (sample_id, prompt) in enumerate(todo):  # the shard's order, whatever finished first
            result, feats = finished[i]
            _add_sequence(out, sample_id, prompt, result.tokens, result.finish_reason)
            if recorder:
                out["features"].append(feats)
        out["gen_seconds"] = time.perf_counter() - t0
        return out


class FeatureRecorder:
    """Never drafts (run the engine at ``block_size=1``); keeps the target features that
    plain decoding computes anyway, so training data needs no second, teacher-forced pass.

    Every position a sequence's tokens occupy gets its features except the last generated
    token, which is never fed back: ``features(result)`` returns
    ``(len(prompt) + len(tokens), F)`` with that final row zero. Training never reads it
    (a block sees context strictly before its anchor)."""

    needs_features = True

    def __init__(self, layer_ids: list[int], dtype: torch.dtype | None = None):
        self.layer_ids = list(layer_ids)
        self.dtype = dtype  # e.g. float16: halve what a long generation holds
        self.live: list[tuple[object, list[torch.Tensor]]] = []  # (engine Result, feature parts)
        self.done: dict[int, torch.Tensor] = {}

    def admit(self, engine, rows, features, lens):
        for i, row in enumerate(rows):
            self.live.append((row, [self._keep(features[i, : int(lens[i])])]))

    def propose(self, engine, k: int):
        raise RuntimeError("FeatureRecorder never drafts: run the engine with block_size=1")

    def commit(self, features, keep):
        for i, (_, parts) in enumerate(self.live):
            parts.append(self._keep(features[i, : int(keep[i])]))

    def select(self, idx):
        kept = set(idx.tolist())
        for i, (row, parts) in enumerate(self.live):
            if i not in kept:
                feats = torch.cat(parts)
                self.done[id(row.request)] = torch.cat([feats, feats.new_zeros(1, feats.shape[1])])
        self.live = [self.live[i] for i in idx.tolist()]

    def features(self, result) -> torch.Tensor:
        """The finished ``result``'s features (popped: each is handed out once)."""
        return self.done.pop(id(result.request))

    def _keep(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype) if self.dtype is not None else x.clone()


# ---------------------------------------------------------------------------- dataset answers
class DatasetAnswers:
    """Stateful Ray Data actor (``generation.backend: dataset``): each sequence is the prompt
    followed by the dataset's own assistant answer, rendered by the chat template and
    ended by the target's end-of-turn token, as the target would have ended it. Nothing is
    generated; the features come from the one teacher-forced pass that follows (EAGLE-1's
    data: the drafter sees the target's hidden states over human-written answers)."""

    def __init__(self, target: dict, generation: dict, max_prompt_tokens: int, storage_options: dict | None = None):
        from transformers import AutoTokenizer

        from specdec.target import resolve_target_path

        self.storage_options = storage_options
        tok = AutoTokenizer.from_pretrained(resolve_target_path(target["model"]),
                                            trust_remote_code=target["trust_remote_code"])
        self.encode = PromptEncoder(tok, generation["enable_thinking"], max_prompt_tokens)
        self.max_new_tokens = generation["max_new_tokens"]

    def __call__(self, batch: pa.Table) -> pa.Table:
        return pa.Table.from_pylist([self.sequences(load_shard_row(row, self.storage_options))
                                     for row in batch.to_pylist()], schema=SEQUENCES_SCHEMA)

    def sequences(self, shard: dict) -> dict:
        t0 = time.perf_counter()
        out = _empty_sequences(shard["shard_id"])
        for sample_id, messages, answer in zip(shard["ids"], shard["messages"], shard["answers"]):
            messages = json.loads(messages)
            prompt = self.encode(messages)
            reason = SKIP_NO_ANSWER if not answer else SKIP_PROMPT_TOO_LONG if prompt is None else None
            if reason:
                out["skipped_ids"].append(sample_id)
                out["skipped_reasons"].append(reason)
                continue
            response = answer_tokens(self.encode.tokenizer, messages, prompt, answer)
            finish = "stop" if len(response) <= self.max_new_tokens else "length"
            _add_sequence(out, sample_id, prompt, response[: self.max_new_tokens], finish)
        out["gen_tokens"] = 0  # read, not generated
        out["gen_seconds"] = time.perf_counter() - t0
        return out


def answer_tokens(tokenizer, messages: list[dict], prompt: list[int], answer: str) -> list[int]:
    """The answer's tokens as the template renders the assistant turn after ``prompt``, up
    to and including its end-of-turn token (what the target emits before stopping)."""
    from specdec.target import encode_chat

    full = encode_chat(tokenizer, [*messages, {"role": "assistant", "content": answer}], add_generation_prompt=False)
    eos = tokenizer.eos_token_id
    if full[: len(prompt)] == prompt:
        response = full[len(prompt):]
        if eos in response:  # drop what the template adds after the turn ends (a newline)
            return response[: response.index(eos) + 1]
    else:  # a template that renders the prompt differently inside a longer chat
        response = tokenizer.encode(answer, add_special_tokens=False)
    return response + ([eos] if eos is not None else [])


def continuous_batches(engine, requests: list, batch_size: int, refill: float = 0.25):
    """Yield finished results while keeping up to ``batch_size`` rows decoding: rows that
    stop early are replaced from the queue (in groups of at least ``refill`` x batch_size,
    so one prefill serves several new rows) instead of the batch draining to its slowest
    row. Requests are admitted in the order given."""
    queue = list(reversed(requests))
    group = max(1, int(batch_size * refill))
    while queue or engine.rows:
        room = batch_size - len(engine.rows)
        if queue and (room >= min(group, len(queue)) or not engine.rows):
            yield from engine.add([queue.pop() for _ in range(min(room, len(queue)))])
        else:
            yield from engine.step()


def _pad_stack(rows: list[torch.Tensor]) -> torch.Tensor:
    """(B, T_max, F) from (T_i, F) tensors, right-padded with zeros."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def _empty_sequences(shard_id: str) -> dict:
    return {"shard_id": shard_id, "ids": [], "input_ids": [], "prompt_tokens": [], "finish_reason": [],
            "skipped_ids": [], "skipped_reasons": [], "gen_tokens": 0, "gen_seconds": 0.0, "gen_start": time.time(),
            "gen_pid": os.getpid()}


def _add_sequence(out: dict, sample_id: str, prompt: list[int], response: list[int], finish: str | None) -> None:
    out["ids"].append(sample_id)
    out["input_ids"].append(list(prompt) + list(response))
    out["prompt_tokens"].append(len(prompt))
    out["finish_reason"].append(finish or "length")
    out["gen_tokens"] += len(response)


# ---------------------------------------------------------------------------- regeneration (vllm)
# ---------------------------------------------------------------------------- feature extraction
class ExtractFeatures:
    """Stateful Ray Data actor: teacher-forced features of one shard per row, written as
    one Parquet file and committed by its progress record (see :class:`ShardWriter`)."""

    def __init__(self, run_uri: str, storage_options: dict, target: dict, layer_ids: list[int] | None,
                 num_layers: int, storage_cfg: dict, batch_size: int, num_gpus: float, run_key: str,
                 num_cpus: float | None = None):
        loaded = load_stage_target(target, num_gpus, num_cpus)
        self.writer = ShardWriter.for_stage(loaded, target, layer_ids, num_layers, storage_cfg, batch_size, run_uri,
                                            storage_options, run_key)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return pa.Table.from_pylist([self.writer.write_shard(row) for row in batch.to_pylist()], schema=STATUS_SCHEMA)


class GenerateAndWrite:
    """Stateful Ray Data actor (``extract.from_generation``): the target answers a shard's
    prompts, and the features its decoding passes computed are written and committed
    right away. Same shard files and records as Regenerate -> ExtractFeatures, except
    that each sequence's last token has zero features (it is never fed to the target,
    and training never reads it), for about a third less compute on a CPU."""

    def __init__(self, run_uri: str, storage_options: dict, target: dict, layer_ids: list[int] | None,
                 num_layers: int, storage_cfg: dict, batch_size: int, generation: dict, max_prompt_tokens: int,
                 run_key: str):
        self.regen = Regenerate(target, generation, max_prompt_tokens)
        self.storage_options = storage_options
        loaded = self.regen.target
        self.writer = ShardWriter.for_stage(loaded, target, layer_ids, num_layers, storage_cfg, batch_size, run_uri,
                                            storage_options, run_key)
        # half-precision layouts: hold the generation's features in that dtype already
        self.record_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(storage_cfg["dtype"])

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = []
        for row in batch.to_pylist():
            seqs = self.regen.regenerate(load_shard_row(row, self.storage_options), self.writer.layer_ids,
                                         self.record_dtype)
            rows.append(self.writer.write_shard(seqs, seqs.pop("features")))
        return pa.Table.from_pylist(rows, schema=STATUS_SCHEMA)


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
            for chunk in _chunks(order, self.batch_size):
                seqs = [shard["input_ids"][i] for i in chunk]
                # tensor work stays on this thread (a second thread would start its own
                # intra-op thread team); the I/O thread only builds, hashes and writes bytes
                lens = [len(q) for q in seqs]
                if recorded is not None:
                    feats, teacher = _pad_stack([recorded[i] for i in chunk]), None
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
