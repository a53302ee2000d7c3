"""``train.longalign``: LongAlign conversations tokenised with the target's chat template
into the token rows a run trains on, written once to ``<run>/longalign.parquet`` (a
resumed run reuses the file and refuses a source whose rows changed)."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

from pipelines import storage
from pipelines.config import ConfigError
from pipelines.train.config import TrainRecipe
from pipelines.train.data import sequences_sha256, simulated_padding

log = logging.getLogger(__name__)

LONGALIGN_FILE = "longalign.parquet"  # train.longalign's rows, in the run directory


def longalign_rows(recipe: TrainRecipe, target, run_uri: str) -> dict:
    """Read ``train.longalign`` with the target's chat template and write its token rows to
    ``<run>/longalign.parquet`` (once: a resumed run reuses the file, and refuses a source
    whose rows changed). Returns the rows' URI and the lineage fields."""
    tc = recipe.train
    data = _read_conversations(recipe, target)
    print(f"longalign: {len(data.rows)} sequences, {data.tokens} tokens, {data.skipped_too_long} skipped "
          f"(longer than max_length)", flush=True)
    # in a stable pseudo-random order: files often come sorted by length, and Ray Data splits
    # the rows file into contiguous shares, one per worker (measured: one DDP worker got every
    # 4K-8K conversation and ran at 93% CPU while the other waited at 27%)
    rows = sorted(data.rows, key=_hashed_order)
    sha = sequences_sha256(rows)
    lengths = [len(r["input_ids"]) for r in rows]
    pad = simulated_padding(lengths, tc.batch_size, tc.shuffle_buffer, tc.seed)
    log.info("longalign padding at batch size %d: %.1f%% in random batches, %.1f%% length-bucketed (%s)",
             tc.batch_size, 100 * pad["random"], 100 * pad["bucketed"],
             "on: train.length_buckets" if tc.length_buckets else "off")
    uri = storage.join(run_uri, LONGALIGN_FILE)
    _keep_or_write(rows, sha, uri, recipe)
    return {"uri": uri, "longalign": storage.absolute_uri(tc.longalign), "longalign_sha256": sha,
            "longalign_sequences": len(data.rows), "longalign_tokens": data.tokens}


def _read_conversations(recipe: TrainRecipe, target):
    """``train.longalign`` read and tokenised (pipelines.longalign); every problem a
    ConfigError that names the field, and the line where there is one."""
    from pipelines.longalign import LongAlignError, read_longalign

    tc = recipe.train
    if target.tokenizer is None:
        raise ConfigError(f"train.longalign: the target {recipe.features.target.model} has no tokenizer")
    source = storage.absolute_uri(tc.longalign)
    src_fs, src_path = storage.filesystem(source, tc.storage_options)
    try:
        if not src_fs.isfile(src_path):
            raise ConfigError(f"train.longalign: {source} is not a file (expected a LongAlign JSONL)")
        with tempfile.TemporaryDirectory(prefix="dflash-longalign-") as tmp:
            local = src_path
            if not storage.is_local(src_fs):  # object storage: read a local copy
                local = str(Path(tmp) / Path(src_path).name)
                src_fs.get_file(src_path, local)
            data = read_longalign(local, target.tokenizer, tc.max_length)
    except LongAlignError as e:  # "<path>:<line>: <field>: ..."
        raise ConfigError(f"train.longalign: {e}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"train.longalign: {source}: {e}") from None
    if not data.rows:
        raise ConfigError(f"train.longalign: {tc.longalign} has no conversation of at most {tc.max_length} tokens "
                          f"({data.lines} lines, {data.skipped_too_long} longer than train.max_length)")
    return data


def _keep_or_write(rows: list[dict], sha: str, uri: str, recipe: TrainRecipe) -> None:
    """Write the rows file at ``uri``, or check that the one there holds the same rows."""
    from pipelines.longalign import write_sequences

    tc = recipe.train
    fs, path = storage.filesystem(uri, tc.storage_options)
    if fs.exists(path):
        import pyarrow.parquet as pq

        with fs.open(path, "rb") as f:
            # content, not order: a rows file written before the hashed order still resumes
            have = sequences_sha256(sorted(pq.read_table(f, columns=["id", "input_ids", "loss_mask"]).to_pylist(),
                                           key=_hashed_order))
        if have != sha:
            raise ConfigError(f"train.longalign: run '{tc.run_name}' was started on other rows ({uri} has content "
                              f"sha256 {have[:12]}.., {tc.longalign} now gives {sha[:12]}..); use another "
                              "train.run_name to start afresh")
    elif storage.is_local(fs):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        write_sequences(rows, tmp)
        os.replace(tmp, path)
    else:
        with tempfile.TemporaryDirectory(prefix="dflash-longalign-") as tmp:
            write_sequences(rows, str(Path(tmp) / LONGALIGN_FILE))
            fs.put_file(str(Path(tmp) / LONGALIGN_FILE), path)


def _hashed_order(row: dict) -> bytes:
    return hashlib.sha256(row["id"].encode()).digest()
