"""Planning a feature run: the prompt list (after split, dedup and caps, in source order) cut
into shards of ``samples_per_shard`` with stable ids, its digest (a resumed run must plan the
same shards), and one plan file per pending shard that the workers read their samples from
(the driver never holds a large run's prompts at once).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import posixpath
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pipelines import storage
from pipelines.config import ConfigError, FeaturesConfig

PLAN_DIR = "plan"  # one file per pending shard: its samples (removed when the run commits)


@dataclass(frozen=True)
class ShardPlan:
    shard_id: str
    ids: tuple[str, ...]
    messages: tuple[str, ...]  # JSON, one per sample: chat messages (captured: the prompt's token ids)
    # the dataset's answers (generation.backend: dataset), or captured ones as JSON (captured.py)
    answers: tuple[str | None, ...] | None = None
    split: str = "train"  # "holdout": written for evaluation (storage.holdout_fraction), never trained on

    def as_row(self) -> dict:
        row = {"shard_id": self.shard_id, "ids": list(self.ids), "messages": list(self.messages)}
        return row if self.answers is None else {**row, "answers": list(self.answers)}


@dataclass(frozen=True)
class ShardRef:
    """A planned shard as the driver keeps it while the run goes (its samples live in its
    plan file, ``plan/<shard_id>.json``): the driver's memory grows with the shard count,
    not with the prompts' text."""

    shard_id: str
    split: str
    samples: int
    ids_sha256: str  # of the shard's sorted sample ids: what commit checks a shard's record against


def ids_digest(ids) -> str:
    return hashlib.sha256("\x1e".join(sorted(ids)).encode()).hexdigest()


def iter_plan(cfg: FeaturesConfig, digest=None) -> Iterator[ShardPlan]:
    """The run's shards as the prompts stream by: training and held-out shards filled side by
    side and yielded as they fill (ids ``<k>`` and ``h<k>``, 5 digits and more past 99,999),
    the rest at the end. ``digest`` (a sha256) is fed the prompt list as it goes."""
    from pipelines.train.data import holdout_mask

    p = cfg.prompts
    with_answers = cfg.generation.backend in ("dataset", "captured")
    fraction, n = cfg.storage.holdout_fraction, cfg.storage.samples_per_shard
    buffers: dict[str, list] = {"train": [], "holdout": []}
    count = {"train": 0, "holdout": 0}
    seen: Counter[str] = Counter()

    def cut(split: str) -> ShardPlan:
        rows, buffers[split] = buffers[split], []
        shard_id = f"{'h' if split == 'holdout' else ''}{count[split]:05d}"
        count[split] += 1
        ids, messages, answers = zip(*rows)
        return ShardPlan(shard_id, ids, messages, answers if with_answers else None, split)

    for prompt_id, text, answer in itertools.islice(_samples(cfg), p.skip, None if p.limit is None else p.skip + p.limit):
        # Sources may repeat an id for different conversations; samples need unique keys.
        seen[prompt_id] += 1
        sample_id = prompt_id if seen[prompt_id] == 1 else f"{prompt_id}~{seen[prompt_id]}"
        if digest is not None:
            digest.update(f"{sample_id}\x1f{text}\x1e".encode())
            if with_answers:
                digest.update(f"{answer}\x1e".encode())
        split = "holdout" if fraction and holdout_mask([sample_id], fraction)[0] else "train"
        buffers[split].append((sample_id, text, answer if with_answers else None))
        if len(buffers[split]) == n:
            yield cut(split)
    if not (count["train"] or count["holdout"] or buffers["train"] or buffers["holdout"]):
        where = (f"captured traffic at {', '.join(p.captured.uris)} (since {p.captured.since}, until "
                 f"{p.captured.until}, model {p.captured.model}, max_temperature {p.captured.max_temperature})"
                 if p.source == "captured" else repr(p.source))
        raise ConfigError(f"features.prompts: no prompts left from {where} after the split and filters")
    for split in ("train", "holdout"):
        if buffers[split]:
            yield cut(split)


def _samples(cfg: FeaturesConfig) -> Iterator[tuple[str, str, str | None]]:
    """``(id, text, answer)`` per prompt of the source, in source order: chat messages as JSON
    and the dataset's answer, or a captured request's prompt and answer ids (``captured.py``)."""
    from specdec.prompts import iter_prompts

    p = cfg.prompts
    if p.source == "captured":
        from pipelines.features.captured import iter_plan_items

        yield from iter_plan_items(p, cfg.storage.options)
        return
    for prompt in iter_prompts(p.source, split=p.split, holdout_fraction=p.holdout_fraction, multi_turn=p.multi_turn,
                               max_prompt_chars=p.max_prompt_chars, min_prompt_chars=p.min_prompt_chars, dedup=p.dedup):
        yield prompt.id, json.dumps(prompt.messages, ensure_ascii=False, sort_keys=True), prompt.reference


def _plan_order(shard) -> tuple:
    """Training shards first, then held-out ones, each by number (the manifest's order)."""
    return shard.split != "train", len(shard.shard_id), shard.shard_id


def plan_shards(cfg: FeaturesConfig) -> tuple[list[ShardPlan], str]:
    """The run's shards, samples included, and a hash of the prompt list they came from
    (small runs and tools; ``run_features`` keeps only :class:`ShardRef` s)."""
    digest = hashlib.sha256()
    return sorted(iter_plan(cfg, digest), key=_plan_order), digest.hexdigest()


def plan_index(cfg: FeaturesConfig) -> tuple[list[ShardRef], str]:
    """One streaming pass over the prompts: the run's shards as refs, and the plan's hash."""
    digest = hashlib.sha256()
    refs = [ShardRef(s.shard_id, s.split, len(s.ids), ids_digest(s.ids)) for s in iter_plan(cfg, digest)]
    return sorted(refs, key=_plan_order), digest.hexdigest()


def plan_path(root: str, shard_id: str) -> str:
    return storage.join(root, PLAN_DIR, f"{shard_id}.json")


def write_plan_files(cfg: FeaturesConfig, fs, root: str, pending: set[str], threads: int = 8) -> int:
    """A second streaming pass: the samples of every pending shard that has no plan file yet,
    written to ``plan/<shard_id>.json`` (the generating actors read them; the driver holds
    one shard's samples at a time, plus the writes in flight). Returns how many it wrote."""
    have = {posixpath.basename(q)[: -len(".json")] for q in storage.list_files(fs, storage.join(root, PLAN_DIR),
                                                                               ".json")}
    todo = pending - have
    if not todo:
        return 0
    with ThreadPoolExecutor(threads) as pool:
        futures, written = [], 0
        for shard in iter_plan(cfg):
            if shard.shard_id in todo:
                futures.append(pool.submit(storage.write_json, fs, plan_path(root, shard.shard_id), shard.as_row()))
                written += 1
            if len(futures) >= 4 * threads:  # bounded: at most this many shards' samples in memory
                futures.pop(0).result()
        for f in futures:
            f.result()
    return written
