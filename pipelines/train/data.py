"""Training data: committed feature runs (or token sequences for online features) as Ray
Datasets on the driver, and padded tensor batches on the workers.

Held-out rows are chosen by a hash of the sample id, so the split is the same on every
run, every worker count and every restart, and needs no pass over the data.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines import storage
from pipelines.config import ConfigError

if TYPE_CHECKING:
    import torch

SEQUENCE_COLUMNS = ["id", "input_ids", "loss_mask"]


# ---------------------------------------------------------------------------- driver side
def holdout_mask(ids: list[str], fraction: float) -> np.ndarray:
    """True for ids that belong to the held-out share (stable: sha256 of the id)."""
    cut = int(fraction * 2**32)
    return np.array([int.from_bytes(hashlib.sha256(i.encode()).digest()[:4], "big") < cut for i in ids], dtype=bool)


def replay_mask(ids: list[str], fraction: float) -> np.ndarray:
    """True for the ids a replay keeps (``train.replay``): a hash of its own, so the choice is
    independent of the held-out split's (a share of the training rows, not of one end of it)."""
    cut = int(fraction * 2**32)
    return np.array([int.from_bytes(hashlib.sha256(f"replay\x1f{i}".encode()).digest()[:4], "big") < cut
                     for i in ids], dtype=bool)


def replay_fraction(new_rows: int, replay_rows: int, share: float) -> float:
    """The fraction of the replay runs' rows that makes them about ``share`` of the training rows
    (all of them when they are too few)."""
    return min(1.0, share / (1 - share) * new_rows / max(1, replay_rows))


def keep_replayed(table: pa.Table, fraction: float) -> pa.Table:
    return table.filter(pa.array(replay_mask(table.column("id").to_pylist(), fraction)))


def keep_split(table: pa.Table, fraction: float, holdout: bool) -> pa.Table:
    """The held-out (``holdout=True``) or training rows of ``table``, by a hash of their ids."""
    mask = holdout_mask(table.column("id").to_pylist(), fraction)
    return table.filter(pa.array(mask if holdout else ~mask))


def split_holdout(ds, fraction: float, holdout: bool):
    """The held-out (``holdout=True``) or training rows of ``ds``."""
    return ds.map_batches(keep_split, batch_format="pyarrow", batch_size=None,
                          fn_kwargs={"fraction": fraction, "holdout": holdout})


def _normalize_sequences(table: pa.Table) -> pa.Table:
    """Token rows in any of the accepted shapes -> ``id``, ``input_ids``, ``loss_mask``."""
    names = set(table.column_names)
    if "input_ids" not in names:
        raise ValueError(f"sequence rows need an 'input_ids' column; found {sorted(names)}")
    ids = table.column("input_ids").to_pylist()
    if "loss_mask" in names:
        masks = table.column("loss_mask").to_pylist()
    elif "prompt_tokens" in names:
        masks = [[0] * p + [1] * (len(s) - p) for s, p in zip(ids, table.column("prompt_tokens").to_pylist())]
    else:
        raise ValueError("sequence rows need 'loss_mask' (1 on response tokens) or 'prompt_tokens'")
    if "id" in names:
        row_ids = [str(i) for i in table.column("id").to_pylist()]
    else:
        row_ids = [hashlib.sha256(np.asarray(s, dtype=np.int64).tobytes()).hexdigest()[:16] for s in ids]
    return pa.table({"id": pa.array(row_ids, pa.string()), "input_ids": pa.array(ids, pa.list_(pa.int32())),
                     "loss_mask": pa.array(masks, pa.list_(pa.int8()))})


def read_sequences(uri: str, storage_options: dict | None = None, field: str = "train.sequences"):
    """A Dataset of token rows from Parquet or JSON Lines files (a file or a directory):
    ``input_ids`` plus ``loss_mask`` or ``prompt_tokens``, optionally ``id``."""
    import ray.data

    uri = storage.absolute_uri(uri)
    fs, path = storage.filesystem(uri, storage_options)
    if not fs.exists(path):
        raise ConfigError(f"{field}: {uri} does not exist")
    files = [path] if fs.isfile(path) else storage.list_files(fs, path)
    kinds = {".parquet" if f.endswith(".parquet") else ".jsonl" if f.endswith((".jsonl", ".json")) else "?"
             for f in files}
    if not files or len(kinds) != 1 or "?" in kinds:
        raise ConfigError(f"{field}: expected .parquet or .jsonl files at {uri}, found {files[:3]}")
    reader = ray.data.read_parquet if kinds == {".parquet"} else ray.data.read_json
    ds = reader(files, filesystem=_arrow_fs(fs))
    return ds.map_batches(_normalize_sequences, batch_format="pyarrow", batch_size=None)


def _arrow_fs(fs):
    import pyarrow.fs as pafs

    return None if storage.is_local(fs) else pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def manifest_sha256(uri: str, storage_options: dict | None = None) -> str:
    """sha256 of a feature run's ``manifest.json`` bytes: the data lineage of a drafter."""
    uri = storage.absolute_uri(uri)
    fs, root = storage.filesystem(uri, storage_options)
    return hashlib.sha256(fs.cat_file(storage.join(root, "manifest.json"))).hexdigest()


def sequences_sha256(rows: Iterable[dict]) -> str:
    """sha256 of token rows' content (ids, tokens, masks in order), whatever file holds them."""
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps([str(r["id"]), [int(t) for t in r["input_ids"]], [int(m) for m in r["loss_mask"]]],
                            separators=(",", ":")).encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------- length buckets
def bucket_window(batch_size: int, shuffle_buffer: int) -> int:
    """Rows one worker sorts by length at a time: max(shuffle_buffer, 8 batches), in whole
    batches (so a worker takes as many steps per epoch as without buckets)."""
    rows = max(shuffle_buffer, 8 * batch_size)
    return -(-rows // batch_size) * batch_size


def bucket_slices(lengths: Sequence[int], batch_size: int, seed: Sequence[int]) -> list[np.ndarray]:
    """One window's batches as row indices: the rows sorted by length, cut into
    ``batch_size`` slices, the slices in a random order (seeded), so that neighbouring
    steps do not all see the longest sequences."""
    order = np.argsort(np.asarray(lengths, dtype=np.int64), kind="stable")
    slices = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    perm = np.random.default_rng([*map(int, seed)]).permutation(len(slices))
    return [slices[i] for i in perm]


def bucketed(windows: Iterable[pa.Table], batch_size: int, seed: Sequence[int]) -> Iterator[pa.Table]:
    """Length-bucketed batches from windows of rows (already shuffled): see :func:`bucket_slices`;
    window ``w`` is seeded by ``(*seed, w)``."""
    for w, table in enumerate(windows):
        lengths = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False)
        for idx in bucket_slices(lengths, batch_size, (*seed, w)):
            yield table.take(pa.array(idx))


def padding_fraction(batches: Iterable[Sequence[int]]) -> float:
    """Share of padded slots in right-padded batches (each padded to its longest row),
    given each batch's sequence lengths."""
    pad = total = 0
    for lens in batches:
        if len(lens):
            slots = int(max(lens)) * len(lens)
            total += slots
            pad += slots - int(sum(lens))
    return pad / total if total else 0.0


def simulated_padding(lengths: Sequence[int], batch_size: int, shuffle_buffer: int, seed: int = 0) -> dict:
    """Padding fraction of one epoch over ``lengths`` in shuffled order, without and with
    length buckets (the worker's windows and slices)."""
    rng = np.random.default_rng(seed)
    order = np.asarray(lengths, dtype=np.int64)[rng.permutation(len(lengths))]
    plain = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    window = bucket_window(batch_size, shuffle_buffer)
    buckets = [order[i: i + window][idx] for w, i in enumerate(range(0, len(order), window))
               for idx in bucket_slices(order[i: i + window], batch_size, (seed, w))]
    return {"random": padding_fraction(plain), "bucketed": padding_fraction(buckets), "window": window}


# ---------------------------------------------------------------------------- worker side
# Collate imports torch in its methods, not at the top: Ray Data's read tasks import this module
# for keep_split and _normalize_sequences, and torch costs each of their processes a second of CPU.
@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) long, right-padded with 0
    loss_mask: torch.Tensor  # (B, T) bool: response tokens
    lengths: torch.Tensor  # (B,) long
    features: torch.Tensor | None  # (B, T, n_layers * hidden) or None (online: the worker computes them)
    ids: list[str]
    # the target's top-K next-token ids (long) and log-probs (float) after each position,
    # (B, T, K) each, from feature runs stored with teacher_topk (distillation targets)
    teacher_ids: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.input_ids), move(self.loss_mask), move(self.lengths), move(self.features), self.ids,
                     move(self.teacher_ids), move(self.teacher_logprobs))

    @property
    def rows(self) -> int:
        return len(self.ids)

    def seed(self, base: int) -> int:
        """A seed that depends only on which samples are in the batch (evaluation draws the
        same anchors for the same samples, whatever the order they arrive in)."""
        h = hashlib.sha256(json.dumps([base, sorted(self.ids)]).encode()).digest()
        return int.from_bytes(h[:8], "big") & (2**63 - 1)


class Collate:
    """A pyarrow batch of stored rows -> a padded :class:`Batch` (sequences cut to
    ``max_length``; features decoded from their stored bytes to ``dtype``)."""

    def __init__(self, layout: dict | None, max_length: int, dtype: torch.dtype | None = None):
        import torch

        from pipelines.features.format import FeatureLayout

        self.layout = FeatureLayout.from_manifest(layout) if layout else None
        self.max_length = max_length
        self.dtype = dtype or torch.float32

    def __call__(self, table: pa.Table) -> Batch:
        import torch

        rows = table.to_pylist()
        lens = [min(len(r["input_ids"]), self.max_length) for r in rows]
        B, T = len(rows), max(lens)
        ids = torch.zeros(B, T, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.bool)
        feats = t_ids = t_logp = None
        if self.layout is not None:
            feats = torch.zeros(B, T, self.layout.feature_dim, dtype=self.dtype)
            if self.layout.teacher_topk:
                t_ids = torch.zeros(B, T, self.layout.teacher_topk, dtype=torch.long)
                t_logp = torch.full((B, T, self.layout.teacher_topk), -1e4)
        for b, (row, n) in enumerate(zip(rows, lens)):
            ids[b, :n] = torch.as_tensor(np.asarray(row["input_ids"][:n], dtype=np.int64))
            mask[b, :n] = torch.as_tensor(np.asarray(row["loss_mask"][:n], dtype=np.int8)).bool()
            if feats is not None:
                full = self.layout.decode(row["features"], row.get("scales"), int(row["num_tokens"]), self.dtype)
                feats[b, :n] = full[:n]
            if t_ids is not None and row.get("teacher_ids") is not None:  # else no teacher mass: plain CE
                i, lp = self.layout.decode_teacher(row["teacher_ids"], row["teacher_logprobs"], int(row["num_tokens"]))
                t_ids[b, :n], t_logp[b, :n] = i[:n], lp[:n]
        return Batch(ids, mask, torch.tensor(lens, dtype=torch.long), feats, [str(r["id"]) for r in rows],
                     t_ids, t_logp)
