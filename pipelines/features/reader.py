"""Reading committed feature runs: :func:`read_features` is a ``ray.data.Dataset`` over one
run's shards and :func:`read_runs` over several runs' shards, interleaved (refusing a manifest
made for another target or layers), streamed row group by row group with each shard's checksum
verified as it is read; the token counts of its answers (the draft vocabulary) and whether it
has held-out shards.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines import storage
from pipelines.features.format import CorruptShardError, check_manifest
from pipelines.features.manifest import check_digest, load_manifest

if TYPE_CHECKING:
    import torch

_READ_ROWS = 8  # rows per block the reader yields: features make rows large (MBs each)


@contextmanager
def _verified_local_file(fs, path: str, entry: dict, verify: bool) -> Iterator[str]:
    """Shards listed without row-group digests (runs made before them): a local file
    holding the shard (the file itself on a local filesystem, else a streamed temporary
    copy), checked against its whole-file sha256 before any row is read."""
    if storage.is_local(fs):
        if verify:
            check_digest(entry, *storage.sha256_file(fs, path))
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="feature-shard-") as tmp:
        local = os.path.join(tmp, "shard.parquet")
        digest = storage.download(fs, path, local)
        if verify:
            check_digest(entry, *digest)
        yield local


@dataclass(frozen=True)
class RunPart:
    """One feature run's share of a read (:func:`read_runs`): the shards written for ``split``
    (None: all), and of their rows those ``keep`` returns (a picklable ``pa.Table -> pa.Table``
    row filter, e.g. a hash share; None: every row)."""

    uri: str
    split: str | None = None
    keep: Callable[[pa.Table], pa.Table] | None = None


def read_features(uri: str, *, target_identity: str | None = None, layer_ids: list[int] | None = None,
                  hidden_size: int | None = None, tokenizer_hash: str | None = None,
                  storage_options: dict | None = None, verify_checksums: bool = True,
                  split: str | None = None):
    """A ``ray.data.Dataset`` of the rows of a committed run (schema in
    :mod:`pipelines.features.format`; decode with ``FeatureLayout.from_manifest(m).decode_row``).

    Raises :class:`~pipelines.features.format.ManifestMismatchError` naming the manifest
    field that differs from the expected target identity, layer ids, hidden size or
    tokenizer (None: not checked; ``feature_format.expected_for(target, layer_ids)``
    gives all four). ``split`` ("train" or "holdout") reads only the shards written for
    that share (:func:`shard_split`); None reads them all.

    A read task streams its shard a row group at a time: one ranged read of the footer,
    then one per row group, each checked against the sha256 the manifest lists for that
    range (with ``verify_checksums``) before a row of it is used, so memory is one row
    group and the first rows arrive after reading the footer and one row group.
    """
    return read_runs([RunPart(uri, split)], target_identity=target_identity, layer_ids=layer_ids,
                     hidden_size=hidden_size, tokenizer_hash=tokenizer_hash, storage_options=storage_options,
                     verify_checksums=verify_checksums)


def read_runs(parts: list[RunPart], *, storage_options: dict | None = None, verify_checksums: bool = True,
              **expect):
    """One dataset over several runs (each checked as :func:`read_features` checks one), their
    shards interleaved by progress: each run's shards spread evenly over the stream in
    proportion to its rows, so any stretch of it (a tenth of an epoch) holds about the same
    share of every run. A replay of a parent's data thus mixes into every part of an epoch;
    ``Dataset.union`` would hand out whichever input's blocks come first."""
    import ray.data

    sources, ranked = [], []
    for i, part in enumerate(parts):
        uri = storage.absolute_uri(part.uri)
        options = storage.resolve_options(uri, storage_options)
        manifest = load_manifest(uri, options)
        check_manifest(manifest, uri, **expect)
        shards = [e for e in manifest["shards"] if part.split is None or shard_split(e) == part.split]
        if not shards:
            raise ValueError(f"the feature run at {uri} has no {part.split} shards "
                             "(see features.storage.holdout_fraction)")
        sources.append((uri, options, part.keep))
        ranked += [(position, i, json.dumps(e)) for position, e in zip(_midpoints([e["rows"] for e in shards]), shards)]
    ranked.sort(key=lambda r: r[:2])
    items = [{"entry": entry, "source": i} for _, i, entry in ranked]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    ds = ds.map_batches(_read_shards, batch_size=1, batch_format="pyarrow",
                        fn_kwargs={"sources": sources, "verify": verify_checksums})
    # each yielded part leaves the task as its own block: Ray Data would otherwise gather
    # parts up to 128 MB (a whole small shard) before the first row reaches a consumer
    ds.context.target_max_block_size = 1
    return ds


def _midpoints(rows: list[int]) -> list[float]:
    """Where each shard's middle row falls in its run, from 0 to 1 (the interleaving key)."""
    total, done, out = max(1, sum(rows)), 0, []
    for n in rows:
        out.append((done + n / 2) / total)
        done += n
    return out


def shard_split(entry: dict) -> str:
    """"holdout" for a shard written as held-out rows, else "train"."""
    return entry.get("split", "train")


def _read_shards(items: pa.Table, sources: list[tuple], verify: bool):
    """Yield the rows of each listed shard in small batches, each part checked first, then
    filtered by its run's ``keep``."""
    for entry, i in zip(map(json.loads, items.column("entry").to_pylist()), items.column("source").to_pylist()):
        uri, options, keep = sources[i]
        for table in _shard_rows(uri, options, entry, verify):
            table = keep(table) if keep is not None else table
            if table.num_rows:
                yield table


def _shard_rows(uri: str, options: dict, entry: dict, verify: bool) -> Iterator[pa.Table]:
    fs, root = storage.filesystem(uri, options)
    path = storage.join(root, entry["path"])
    if "row_groups" in entry:
        yield from stream_shard(fs, path, entry, verify)
        return
    with _verified_local_file(fs, path, entry, verify) as local:
        shard = pq.ParquetFile(local)
        if shard.metadata.num_rows != entry["rows"]:
            raise CorruptShardError(entry["path"], f"{shard.metadata.num_rows} rows, manifest says {entry['rows']}")
        for batch in shard.iter_batches(batch_size=_READ_ROWS):
            yield pa.Table.from_batches([batch])


def stream_shard(fs, path: str, entry: dict, verify: bool = True, columns: list[str] | None = None):
    """The rows of one shard in blocks of a few rows, read a row group at a time by ranged
    reads, each range checked against its manifest digest before it is parsed. With
    ``columns`` only those columns' bytes are fetched (and, being part of a row group,
    not checked: for token counts, never for training rows)."""
    meta = _shard_footer(fs, path, entry, verify)
    if meta.num_rows != entry["rows"] or meta.num_row_groups != len(entry["row_groups"]):
        raise CorruptShardError(entry["path"], f"{meta.num_rows} rows in {meta.num_row_groups} row groups, "
                                               f"manifest says {entry['rows']} in {len(entry['row_groups'])}")
    for i, group in enumerate(entry["row_groups"]):
        if columns is None:
            data = storage.read_range(fs, path, group["offset"], group["length"])
            if verify and hashlib.sha256(data).hexdigest() != group["sha256"]:
                raise CorruptShardError(entry["path"], f"row group {i}: sha256 differs from the manifest")
            pieces = [(group["offset"], data)]
        else:
            pieces = [(start, storage.read_range(fs, path, start, end - start))
                      for start, end in _column_ranges(meta.row_group(i), columns)]
        table = pq.ParquetFile(_RangeFile(pieces, entry["bytes"], entry["path"]), metadata=meta).read_row_group(
            i, columns=columns)
        if table.num_rows != group["rows"]:
            raise CorruptShardError(entry["path"], f"row group {i}: {table.num_rows} rows, manifest says "
                                                   f"{group['rows']}")
        for batch in table.to_batches(max_chunksize=_READ_ROWS):
            yield pa.Table.from_batches([batch])


def _column_ranges(group: pq.RowGroupMetaData, columns: list[str]) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of ``columns``' chunks in one row group, neighbours merged
    (the token columns sit side by side: one read)."""
    spans = []
    for j in range(group.num_columns):
        col = group.column(j)
        if col.path_in_schema.split(".")[0] in columns:
            start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
            spans.append((start, start + col.total_compressed_size))
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _shard_footer(fs, path: str, entry: dict, verify: bool) -> pq.FileMetaData:
    """The shard's Parquet metadata, from one ranged read of its footer (checked)."""
    foot = entry["footer"]
    data = storage.read_range(fs, path, foot["offset"], foot["length"])
    if verify and hashlib.sha256(data).hexdigest() != foot["sha256"]:
        raise CorruptShardError(entry["path"], "footer: sha256 differs from the manifest")
    size = int.from_bytes(data[-8:-4], "little")  # Parquet: metadata, its length (4 bytes), "PAR1"
    if data[-4:] != b"PAR1" or size + 8 > len(data):
        raise CorruptShardError(entry["path"], "footer: not a Parquet footer")
    return pq.read_metadata(pa.BufferReader(b"PAR1" + data[-8 - size:]))


class _RangeFile(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only ``pieces`` ((offset, bytes) each)
    are held: pyarrow reads one row group's column chunks through it; a read outside
    them (a row group spilling past its manifest entry) is a corrupt shard, never a fetch."""

    def __init__(self, pieces: list[tuple[int, bytes]], size: int, name: str):
        self.pieces = [(offset, memoryview(data)) for offset, data in pieces]
        self.size, self.name, self.pos = size, name, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + pos
        return self.pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        for offset, data in self.pieces:
            lo = self.pos - offset
            if 0 <= lo and lo + n <= len(data):
                buf[:n] = data[lo: lo + n]
                self.pos += n
                return n
        raise CorruptShardError(self.name, f"a row group reaches bytes {self.pos}..{self.pos + n}, outside its "
                                           "manifest range")


def response_token_counts(uri: str, storage_options: dict | None, vocab_size: int,
                          holdout_fraction: float = 0.0) -> torch.Tensor:
    """Response-token frequencies (V,) of a committed run's training rows, reading only
    the token columns: held-out shards never count, nor (in runs without them) the rows
    that ``holdout_fraction`` holds out by id hash."""
    import torch  # here: Ray Data's read tasks import this module and need no torch

    from pipelines.train.data import holdout_mask
    from specdec.draft_vocab import count_tokens

    uri = storage.absolute_uri(uri)
    options = storage.resolve_options(uri, storage_options)
    fs, root = storage.filesystem(uri, options)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    manifest = load_manifest(uri, options)
    if has_holdout_shards(manifest):
        holdout_fraction = 0.0  # the held-out rows are in their own shards
    for entry in manifest["shards"]:
        if shard_split(entry) == "holdout":
            continue
        path, columns = storage.join(root, entry["path"]), ["id", "input_ids", "loss_mask"]
        if "row_groups" in entry:
            tables = stream_shard(fs, path, entry, verify=False, columns=columns)
        else:
            with fs.open(path, "rb") as f:
                tables = [pq.read_table(f, columns=columns)]
        for table in tables:
            held = holdout_mask(table.column("id").to_pylist(), holdout_fraction) if holdout_fraction > 0 else None
            pairs = zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist())
            counts += count_tokens((p for i, p in enumerate(pairs) if held is None or not held[i]), vocab_size)
    return counts


def has_holdout_shards(manifest: dict) -> bool:
    """Whether the run wrote held-out rows to shards of their own (``storage.holdout_fraction``)."""
    return any(shard_split(e) == "holdout" for e in manifest["shards"])
