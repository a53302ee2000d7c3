"""Served traffic as training data (``features.prompts.source: captured``). The records that
serving replicas capture (serve_app/capture.py) hold the prompt as the target saw it (token ids
after the chat template) and the target's own answer (token ids), so a feature run over them
runs only the teacher-forced pass (``generation.backend: captured``), like the dataset backend.

* **Files**: every ``*.parquet`` under each of ``prompts.captured.uris`` (the writers'
  ``date=YYYY-MM-DD/`` folders), in path order. A time window (``since``, ``until``) skips the
  date folders wholly outside it, then rows by their time. ``model`` keeps one served model's.
* **Temperature**: greedy and sampled answers are both the target's outputs. A sampled answer
  is a draw from the target's law, which is what a drafter is trained to predict (distillation
  data); ``max_temperature`` keeps only answers sampled at or below it (0: greedy only).
* **One sample per prompt** (dedup by content hash): a prompt's id is ``cap-`` and a hash of its
  token ids. The first answer in path order is kept, and the same prompt asked again (a
  popular question, a retry) adds nothing. Both splits hash that id as for any source
  (``prompts.split`` / ``prompts.holdout_fraction`` for a held-out traffic set,
  ``storage.holdout_fraction`` for a run's held-out shards), so a prompt is on one side only.
* **Empty answers** (a request cut at zero tokens) are skipped.

A sample travels through the plan as JSON: the prompt ids where other sources have chat
messages, and ``{"ids": [...], "finish": ...}`` where the dataset backend has its answer text.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from pipelines import storage
from pipelines.config import ConfigError, PromptsSection

COLUMNS = ["time", "model", "prompt_ids", "answer_ids", "temperature", "finish_reason"]
_DATE_DIR = re.compile(r"(?:^|/)date=(\d{4}-\d{2}-\d{2})(?:/|$)")


@dataclass(frozen=True)
class CapturedSample:
    """One captured request as a feature sample."""
    id: str
    prompt_ids: list[int]
    answer_ids: list[int]
    finish: str

    def plan_text(self) -> str:
        return json.dumps(self.prompt_ids)

    def plan_answer(self) -> str:
        return json.dumps({"ids": self.answer_ids, "finish": self.finish})


def sample_id(prompt_ids: list[int]) -> str:
    """A prompt's id: the same token ids give the same id on every machine."""
    return "cap-" + hashlib.sha256(np.asarray(prompt_ids, dtype="<i4").tobytes()).hexdigest()[:20]


def capture_files(uris: list[str], since: str | None = None, until: str | None = None,
                  storage_options: dict | None = None) -> list[tuple[str, str]]:
    """``(uri, path)`` of every capture file under ``uris`` whose date folder can hold records
    of the window, in path order per uri. A missing location is an error naming it."""
    # a folder is named by when its file was written, up to a flush after its records' times:
    # the day after until's may still hold records from before it
    first = since[:10] if since else None
    last = (datetime.datetime.fromisoformat(until) + datetime.timedelta(days=1)).date().isoformat() if until else None
    found = []
    for uri in uris:
        fs, root = storage.filesystem(uri, storage_options)
        fs.invalidate_cache(root)
        if not fs.exists(root):
            raise ConfigError(f"features.prompts.captured.uris: {uri} does not exist (the capture.uri of a serving "
                              "app writes files there once it has answered requests)")
        for path in sorted(fs.find(root)):
            if not path.endswith(".parquet") or posixpath.basename(path).startswith("."):
                continue
            day = _DATE_DIR.search(path[len(root):])  # UTC dates, as parse_time's times are UTC
            if day and ((first and day.group(1) < first) or (last and day.group(1) > last)):
                continue  # the whole day lies outside the window
            found.append((uri, path))
    return found


def iter_captured(captured, split: str = "all", holdout_fraction: float = 0.0,
                  storage_options: dict | None = None) -> Iterator[CapturedSample]:
    """The captured samples of ``captured`` (a :class:`~pipelines.config.CapturedSection`) in
    path order, one per prompt, filtered by window, model and temperature, then split by the
    prompt's id (``split`` as in :func:`specdec.prompts.iter_prompts`)."""
    from specdec.prompts import is_holdout

    since = datetime.datetime.fromisoformat(captured.since) if captured.since else None
    until = datetime.datetime.fromisoformat(captured.until) if captured.until else None
    seen: set[str] = set()
    for uri, path in capture_files(captured.uris, captured.since, captured.until, storage_options):
        fs, _ = storage.filesystem(uri, storage_options)
        with fs.open(path, "rb") as f:
            rows = pq.read_table(f, columns=COLUMNS).to_pylist()
        for row in rows:
            when = row["time"]
            if (since and when < since) or (until and when >= until) or not row["answer_ids"]:
                continue
            if captured.model is not None and row["model"] != captured.model:
                continue
            if captured.max_temperature is not None and (row["temperature"] or 0.0) > captured.max_temperature:
                continue
            sid = sample_id(row["prompt_ids"])
            if sid in seen:
                continue
            seen.add(sid)  # whichever split is asked for: the same prompt is one sample everywhere
            if split != "all" and is_holdout(sid, holdout_fraction) != (split == "holdout"):
                continue
            yield CapturedSample(sid, row["prompt_ids"], row["answer_ids"], row["finish_reason"] or "length")


def iter_plan_items(prompts: PromptsSection, storage_options: dict | None = None) -> Iterator[tuple[str, str, str]]:
    """``(id, text, answer)`` per captured sample, as the plan stores samples."""
    for s in iter_captured(prompts.captured, prompts.split, prompts.holdout_fraction, storage_options):
        yield s.id, s.plan_text(), s.plan_answer()
