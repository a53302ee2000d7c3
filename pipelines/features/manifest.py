"""Committing and verifying a feature run. A shard is committed by ``progress/shard-<id>.json``
(path, rows, sha256) once its file is written; :func:`commit` writes ``manifest.json`` last,
listing exactly one file per shard, and removes what no commit names (files of attempts that
died). :func:`verify_features` re-checks every shard's rows, size and checksum against it.
"""

from __future__ import annotations

import logging
import posixpath
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone

import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines import storage
from pipelines.config import FeaturesConfig
from pipelines.features.format import FORMAT, SCHEMA_VERSION, CorruptShardError, FeatureLayout
from pipelines.features.plan import PLAN_DIR, ShardRef, ids_digest

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"


def committed_shards(fs, root: str) -> dict[str, dict]:
    """Progress records by shard id (each one a committed shard)."""
    paths = storage.list_files(fs, storage.join(root, "progress"), ".json")
    return {r["shard_id"]: r for r in storage.read_json_many(fs, paths)}


_SAME_IN_EVERY_SHARD = ("run_key", "target", "tokenizer", "layout")


def commit(fs, root: str, uri: str, cfg: FeaturesConfig, plan: list[ShardRef], run_key: str) -> dict:
    """Check the committed shards cover the plan exactly once; write ``manifest.json``."""
    records = committed_shards(fs, root)
    missing = [s.shard_id for s in plan if s.shard_id not in records]
    if missing:
        raise RuntimeError(f"{len(missing)} of {len(plan)} shards are not committed (first: {missing[0]}); "
                           "run the job again to finish them")
    ordered = [records[s.shard_id] for s in plan]
    for rec in ordered:
        if rec["run_key"] != run_key:
            raise RuntimeError(f"shard {rec['shard_id']} belongs to another run ({rec['run_key']} != {run_key})")
        for key in _SAME_IN_EVERY_SHARD:
            if rec[key] != ordered[0][key]:
                raise RuntimeError(f"shard {rec['shard_id']} was written with a different {key} than shard "
                                   f"{ordered[0]['shard_id']}: {rec[key]} != {ordered[0][key]}")
    for shard, rec in zip(plan, ordered):
        if ids_digest(rec["ids"] + list(rec["skipped"])) != shard.ids_sha256:
            raise RuntimeError(f"shard {shard.shard_id} does not hold exactly its planned samples")
    manifest = _manifest(cfg, ordered, [s.split for s in plan])
    storage.write_json(fs, storage.join(root, MANIFEST), manifest)  # the run's commit point
    _remove_orphans(fs, root, {entry["path"] for entry in manifest["shards"]})
    for path in storage.list_files(fs, storage.join(root, PLAN_DIR), ".json"):  # served their purpose
        fs.rm(path)
    log.info("committed %s: %d samples, %d tokens, %s in %d shards (%.1f bytes/token, nominal %d)", uri,
             manifest["num_samples"], manifest["num_tokens"], human_size(manifest["num_bytes"]), len(ordered),
             manifest["bytes_per_token"], manifest["nominal_bytes_per_token"])
    return manifest


def _manifest(cfg: FeaturesConfig, records: list[dict], splits: list[str]) -> dict:
    first = records[0]
    layout = first["layout"]
    nominal = FeatureLayout.from_manifest(layout).nominal_bytes_per_token
    tokens = sum(r["tokens"] for r in records)
    nbytes = sum(r["bytes"] for r in records)
    skipped = Counter(reason for r in records for reason in r["skipped"].values())
    content = cfg.content()
    return {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "created_at": utc_now(),
        "run_key": first["run_key"],
        "target": first["target"],
        "tokenizer": first["tokenizer"],
        "layer_ids": layout["layer_ids"],
        "hidden_size": layout["hidden_size"],
        "feature_dim": layout["feature_dim"],
        "dtype": layout["dtype"],
        "scale_dtype": layout["scale_dtype"],
        "teacher_topk": layout.get("teacher_topk", 0),
        "generation": content["generation"],
        # "generation": kept from the decoding passes (each sequence's last token is zero)
        "extraction": "generation" if cfg.extract.from_generation else "teacher_forced",
        "prompts": content["prompts"],
        "num_samples": sum(r["rows"] for r in records),
        "num_tokens": tokens,
        "num_response_tokens": sum(r["response_tokens"] for r in records),
        "num_bytes": nbytes,
        "bytes_per_token": nbytes / tokens if tokens else 0.0,
        "nominal_bytes_per_token": nominal,
        "num_skipped": sum(skipped.values()),
        "skipped": dict(skipped),
        "holdout": {"fraction": cfg.storage.holdout_fraction,
                    "num_samples": sum(r["rows"] for r, s in zip(records, splits) if s == "holdout"),
                    "num_shards": splits.count("holdout")},
        "shards": [entry for r, s in zip(records, splits) for entry in _shard_entries(r, s)],
    }


def _shard_entries(record: dict, split: str) -> list[dict]:
    """A shard's manifest entries, one per file (shards sized by bytes may have several);
    each with the byte range and sha256 of every row group and of the footer, so that
    readers stream and check a row group at a time (records written before those existed
    have one file and none: their readers check the whole file)."""
    tag = {"split": split} if split == "holdout" else {}
    if "files" not in record:
        return [{k: record[k] for k in ("shard_id", "path", "rows", "tokens", "bytes", "sha256")} | tag]
    keys = ("path", "rows", "tokens", "bytes", "sha256", "row_groups", "footer")
    return [{"shard_id": record["shard_id"], "part": k, **{key: f[key] for key in keys}, **tag}
            for k, f in enumerate(record["files"])]


def _remove_orphans(fs, root: str, keep: set[str]) -> None:
    """Delete shard files of failed or superseded attempts (never listed anywhere)."""
    for path in storage.list_files(fs, storage.join(root, "shards"), ".parquet"):
        rel = f"shards/{posixpath.basename(path)}"
        if rel not in keep:
            fs.rm(path)


def load_manifest(uri: str, storage_options: dict | None = None) -> dict:
    """The committed manifest of a run; FileNotFoundError if the run never finished."""
    uri = storage.absolute_uri(uri)
    fs, root = storage.filesystem(uri, storage_options)
    path = storage.join(root, MANIFEST)
    if not storage.exists(fs, path):
        raise FileNotFoundError(f"no {MANIFEST} at {uri}: the feature run is not committed (finish it with "
                                "jobs/generate_features.py) or the path is wrong")
    return storage.read_json(fs, path)


@dataclass
class VerifyReport:
    uri: str
    shards: int = 0
    rows: int = 0
    tokens: int = 0
    problems: list[tuple[str, str]] = field(default_factory=list)  # (shard path or "manifest", reason)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        if self.ok:
            return f"OK {self.uri}: {self.rows} samples, {self.tokens} tokens in {self.shards} shards"
        lines = [f"BAD {self.uri}: {len(self.problems)} problem(s)"]
        lines += [f"  {where}: {why}" for where, why in self.problems]
        return "\n".join(lines)


def verify_features(uri: str, storage_options: dict | None = None, threads: int = 8) -> VerifyReport:
    """Re-read every shard of a committed run: size, sha256, row and token counts, unique
    ids; every problem names its shard."""
    uri = storage.absolute_uri(uri)
    manifest = load_manifest(uri, storage_options)
    fs, root = storage.filesystem(uri, storage_options)
    report = VerifyReport(uri, shards=len(manifest["shards"]))
    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(lambda e: _check_shard(fs, root, e), manifest["shards"]))
    ids: Counter[str] = Counter()
    for entry, (problem, shard_ids, tokens) in zip(manifest["shards"], results):
        if problem:
            report.problems.append((entry["path"], problem))
            continue
        ids.update(shard_ids)
        report.rows += len(shard_ids)
        report.tokens += tokens
    dupes = [i for i, c in ids.items() if c > 1]
    if dupes:
        report.problems.append(("manifest", f"{len(dupes)} sample ids occur more than once (e.g. {dupes[0]!r})"))
    if report.ok and (report.rows, report.tokens) != (manifest["num_samples"], manifest["num_tokens"]):
        report.problems.append(("manifest", f"shards hold {report.rows} samples / {report.tokens} tokens, the "
                                            f"manifest says {manifest['num_samples']} / {manifest['num_tokens']}"))
    return report


def _check_shard(fs, root: str, entry: dict) -> tuple[str | None, list[str], int]:
    """(problem or None, ids, tokens) of one manifest entry; reads the shard in chunks."""
    path = storage.join(root, entry["path"])
    try:
        check_digest(entry, *storage.sha256_file(fs, path))
        with fs.open(path, "rb") as f:
            # no Arrow thread pool inside our own threads: with it, about 1 exit in 4 aborted
            # ("terminate called without an active exception", pyarrow 2026-12, 8 threads)
            table = pq.read_table(f, columns=["id", "num_tokens"], use_threads=False)
    except CorruptShardError as e:
        return e.reason, [], 0
    except FileNotFoundError:
        return "missing", [], 0
    except Exception as e:  # an unreadable file is a bad shard, whatever the library says
        return f"unreadable: {e}", [], 0
    if table.num_rows != entry["rows"]:
        return f"{table.num_rows} rows, manifest says {entry['rows']}", [], 0
    tokens = int(pc.sum(table["num_tokens"]).as_py() or 0)
    if tokens != entry["tokens"]:
        return f"{tokens} tokens, manifest says {entry['tokens']}", [], 0
    return None, table["id"].to_pylist(), tokens


def check_digest(entry: dict, sha256: str, nbytes: int) -> None:
    """A shard file's size and sha256 against its manifest entry."""
    if nbytes != entry["bytes"]:
        raise CorruptShardError(entry["path"], f"{nbytes} bytes, manifest says {entry['bytes']}")
    if sha256 != entry["sha256"]:
        raise CorruptShardError(entry["path"], f"sha256 {sha256[:12]}..., manifest says {entry['sha256'][:12]}...")


def utc_now() -> str:
    """Now, UTC, ISO 8601 to the second (the records' and manifest's time stamps)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def human_size(n: float) -> str:
    """Bytes for a log line: ``532.4 KB``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
