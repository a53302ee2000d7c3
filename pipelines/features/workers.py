"""The Ray Data workers of the feature pipeline, one shard per call (what a shard row holds:
``shards.py``).

* :class:`Regenerate` (hf backend): the target answers the shard's prompts with the
  specdec engine (batched KV-cache decoding) and emits the shard's token sequences.
* the vllm backend's: :class:`RegenerateVLLM` (``vllm_regen.py``), the same through vLLM.
* :class:`DatasetAnswers` (dataset backend): the dataset's own answers, no generation.
* :class:`CapturedAnswers` (captured backend): the target's answers as it served them, no generation.
* :class:`ExtractFeatures`: one teacher-forced target pass per mini-batch captures the
  selected layers; the shard is written as one Parquet file (a row group per mini-batch)
  and then committed by a small JSON record. It returns one status row per shard.
* :class:`GenerateAndWrite` (``extract.from_generation``, hf backend): one actor does both,
  keeping the features that decoding computes anyway (no second pass).

The target's pass is ``target_pass.py``'s, writing and committing a shard ``writer.py``'s.
"""

from __future__ import annotations

import json
import logging
import time

import pyarrow as pa
import torch

from pipelines.features.shards import (SEQUENCES_SCHEMA, SKIP_NO_ANSWER, SKIP_PROMPT_TOO_LONG, STATUS_SCHEMA,
                                       PromptEncoder, add_sequence, empty_sequences, encode_shard, load_shard_row,
                                       shard_seed)
from pipelines.features.target_pass import FeatureRecorder, load_stage_target
from pipelines.features.writer import ShardWriter

log = logging.getLogger(__name__)


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
            add_sequence(out, sample_id, prompt, result.tokens, result.finish_reason)
            if recorder:
                out["features"].append(feats)
        out["gen_seconds"] = time.perf_counter() - t0
        return out


class _AnswersStage:
    """A stage whose answers are given, not generated: one shard row in, its sequences out."""
    storage_options: dict | None = None

    def __call__(self, batch: pa.Table) -> pa.Table:
        return pa.Table.from_pylist([self.sequences(load_shard_row(row, self.storage_options))
                                     for row in batch.to_pylist()], schema=SEQUENCES_SCHEMA)

    def sequences(self, shard: dict) -> dict:
        raise NotImplementedError


def _skip(out: dict, sample_id: str, reason: str) -> None:
    out["skipped_ids"].append(sample_id)
    out["skipped_reasons"].append(reason)


class DatasetAnswers(_AnswersStage):
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

    def sequences(self, shard: dict) -> dict:
        t0 = time.perf_counter()
        out = empty_sequences(shard["shard_id"])
        for sample_id, messages, answer in zip(shard["ids"], shard["messages"], shard["answers"]):
            messages = json.loads(messages)
            prompt = self.encode(messages)
            reason = SKIP_NO_ANSWER if not answer else SKIP_PROMPT_TOO_LONG if prompt is None else None
            if reason:
                _skip(out, sample_id, reason)
                continue
            response = answer_tokens(self.encode.tokenizer, messages, prompt, answer)
            finish = "stop" if len(response) <= self.max_new_tokens else "length"
            add_sequence(out, sample_id, prompt, response[: self.max_new_tokens], finish)
        out["gen_tokens"] = 0  # read, not generated
        out["gen_seconds"] = time.perf_counter() - t0
        return out


class CapturedAnswers(_AnswersStage):
    """Ray Data actor (``generation.backend: captured``): each sequence is a captured request's
    prompt ids followed by the target's answer ids as it served them (``captured.py``), cut to
    ``max_new_tokens``; prompts over ``max_prompt_tokens`` are skipped and named. No model and
    no tokenizer: the features come from the teacher-forced pass that follows."""

    def __init__(self, generation: dict, max_prompt_tokens: int, storage_options: dict | None = None):
        self.storage_options = storage_options
        self.max_new_tokens, self.max_prompt_tokens = generation["max_new_tokens"], max_prompt_tokens

    def sequences(self, shard: dict) -> dict:
        t0 = time.perf_counter()
        out = empty_sequences(shard["shard_id"])
        for sample_id, prompt, answer in zip(shard["ids"], shard["messages"], shard["answers"]):
            prompt, answer = json.loads(prompt), json.loads(answer)
            if len(prompt) > self.max_prompt_tokens:
                _skip(out, sample_id, SKIP_PROMPT_TOO_LONG)
                continue
            cut = len(answer["ids"]) > self.max_new_tokens
            add_sequence(out, sample_id, prompt, answer["ids"][: self.max_new_tokens], "length" if cut else answer["finish"])
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
