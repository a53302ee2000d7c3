"""A shard as the feature workers see it. The unit of work is a shard: one input row carries the
prompts of one shard (``shard_id``, ``ids``, ``messages`` as JSON, or the path of its plan file);
after generation it is a row of token sequences (:data:`SEQUENCES_SCHEMA`), after extraction a
status row (:data:`STATUS_SCHEMA`). Reading a shard's row, encoding its prompts, its seed, and
the generation actors' pool.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

import pyarrow as pa

from pipelines import storage

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


def generation_actors(n: int):
    """The generation actors' pool (hf and vllm backends), one shard in flight each: Ray Data
    otherwise queues several shards on the first actor up while the others still load the
    model (a run of 2 shards on 2 actors decoded both on one)."""
    import ray.data

    return ray.data.ActorPoolStrategy(size=n, max_tasks_in_flight_per_actor=1)


def progress_path(root: str, shard_id: str) -> str:
    return storage.join(root, "progress", f"shard-{shard_id}.json")


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
    out, todo = empty_sequences(shard["shard_id"]), []
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


def chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i: i + size]


def empty_sequences(shard_id: str) -> dict:
    return {"shard_id": shard_id, "ids": [], "input_ids": [], "prompt_tokens": [], "finish_reason": [],
            "skipped_ids": [], "skipped_reasons": [], "gen_tokens": 0, "gen_seconds": 0.0, "gen_start": time.time(),
            "gen_pid": os.getpid()}


def add_sequence(out: dict, sample_id: str, prompt: list[int], response: list[int], finish: str | None) -> None:
    out["ids"].append(sample_id)
    out["input_ids"].append(list(prompt) + list(response))
    out["prompt_tokens"].append(len(prompt))
    out["finish_reason"].append(finish or "length")
    out["gen_tokens"] += len(response)
