"""Ray Data feature pipeline: prompts -> target regenerations -> teacher-forced hidden
states of the selected layers -> sharded Parquet in object storage, plus ``manifest.json``.

Public API (the file format is documented in :mod:`pipelines.features.format`):

* :func:`run_features` (cfg) -> summary: runs or resumes a run, writes the manifest last.
* :func:`verify_features` (uri) -> :class:`VerifyReport`: re-checks counts and checksums.
* :func:`read_features` (uri, target_identity=, layer_ids=, hidden_size=) -> ``ray.data.Dataset``
  over a committed run, refusing a manifest made for another target.
* :func:`load_manifest` (uri) -> dict.

Exactly once: the prompt list (after split, dedup and caps, in source order) is cut into
shards of ``samples_per_shard`` with stable ids. A shard is written under a per-attempt
file name and then committed by ``progress/shard-<id>.json`` (path, rows, sha256); a
restart skips committed shards and redoes the rest, so a crash at any point loses at most
the shards in flight and duplicates nothing. ``manifest.json`` lists exactly one file per
shard and is written after every shard is committed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import json
import logging
import os
import posixpath
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from pipelines import storage
from pipelines.config import ConfigError, FeaturesConfig
from pipelines.features.format import (FORMAT, SCHEMA_VERSION, CorruptShardError, FeatureLayout, check_manifest)
from pipelines.features.workers import (DatasetAnswers, ExtractFeatures, GenerateAndWrite, Regenerate,
                                       resolve_layer_ids)

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
RUN_FILE = "run.json"
PLAN_DIR = "plan"  # one file per pending shard: its samples (removed when the run commits)
_READ_ROWS = 8  # rows per block the reader yields: features make rows large (MBs each)


# ---------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class ShardPlan:
    shard_id: str
    ids: tuple[str, ...]
    messages: tuple[str, ...]  # JSON, one per sample
    answers: tuple[str | None, ...] | None = None  # the dataset's answers (generation.backend: dataset)
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
    from specdec.prompts import iter_prompts

    p = cfg.prompts
    source = iter_prompts(p.source, split=p.split, holdout_fraction=p.holdout_fraction, multi_turn=p.multi_turn,
                          max_prompt_chars=p.max_prompt_chars, min_prompt_chars=p.min_prompt_chars, dedup=p.dedup)
    with_answers = cfg.generation.backend == "dataset"
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

    for prompt in itertools.islice(source, p.skip, None if p.limit is None else p.skip + p.limit):
        # Sources may repeat an id for different conversations; samples need unique keys.
        seen[prompt.id] += 1
        sample_id = prompt.id if seen[prompt.id] == 1 else f"{prompt.id}~{seen[prompt.id]}"
        text = json.dumps(prompt.messages, ensure_ascii=False, sort_keys=True)
        if digest is not None:
            digest.update(f"{sample_id}\x1f{text}\x1e".encode())
            if with_answers:
                digest.update(f"{prompt.reference}\x1e".encode())
        split = "holdout" if fraction and holdout_mask([sample_id], fraction)[0] else "train"
        buffers[split].append((sample_id, text, prompt.reference if with_answers else None))
        if len(buffers[split]) == n:
            yield cut(split)
    if not (count["train"] or count["holdout"] or buffers["train"] or buffers["holdout"]):
        raise ConfigError(f"features.prompts: no prompts left from {p.source!r} after the split and filters")
    for split in ("train", "holdout"):
        if buffers[split]:
            yield cut(split)


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


def _start_or_resume(fs, root: str, uri: str, cfg: FeaturesConfig, plan_hash: str, num_shards: int) -> str:
    """Record the run's settings, or check that a restart uses the same ones. Returns
    the run key every shard record carries."""
    content = cfg.content()
    path = storage.join(root, RUN_FILE)
    if storage.exists(fs, path):
        previous = storage.read_json(fs, path)
        diff = _first_difference(previous["content"], content)
        if diff is not None:
            key, old, new = diff
            raise ConfigError(f"features.{key}: the run at {uri} was started with {old!r}, the config now says "
                              f"{new!r}; use another features.output, or remove the old run")
        if previous["plan_sha256"] != plan_hash:
            raise ConfigError(f"features.prompts: the prompt list differs from the one the run at {uri} started "
                              "with (did the source change?); use another features.output")
        return previous["run_key"]
    run_key = hashlib.sha256(json.dumps([content, plan_hash], sort_keys=True).encode()).hexdigest()[:16]
    storage.write_json(fs, path, {"format": FORMAT, "schema_version": SCHEMA_VERSION, "content": content,
                                  "plan_sha256": plan_hash, "num_shards": num_shards, "run_key": run_key,
                                  "started_at": _now()})
    return run_key


def _first_difference(old, new, prefix: str = ""):
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            found = _first_difference(old.get(key), new.get(key), f"{prefix}{key}.")
            if found:
                return found
        return None
    return None if old == new else (prefix.rstrip("."), old, new)


def check_target_early(cfg: FeaturesConfig) -> None:
    """Resolve the target once in the driver and check the layers exist before any Ray
    work (workers check again). Resolving here also converts the embedded GGUF once,
    instead of in two actors at the same time."""
    from specdec.target import resolve_target_path

    path = Path(resolve_target_path(cfg.target.model))
    if not (path / "config.json").is_file():
        return  # not a local directory: the workers find out
    conf = json.loads((path / "config.json").read_text())
    layers = conf.get("num_hidden_layers") or (conf.get("text_config") or {}).get("num_hidden_layers")
    if layers:
        resolve_layer_ids(cfg.layer_ids, cfg.num_layers, int(layers))


def committed_shards(fs, root: str) -> dict[str, dict]:
    """Progress records by shard id (each one a committed shard)."""
    paths = storage.list_files(fs, storage.join(root, "progress"), ".json")
    return {r["shard_id"]: r for r in storage.read_json_many(fs, paths)}


# ---------------------------------------------------------------------------- the Ray Data pipeline
def build_dataset(shards: list[dict], cfg: FeaturesConfig, uri: str, options: dict, run_key: str):
    """Shard rows -> regenerate -> extract + write; yields one status row per shard. A row is a
    shard's samples (``ShardPlan.as_row``) or names its plan file (``plan_uri``)."""
    import ray.data

    ds = ray.data.from_items(shards, override_num_blocks=len(shards))
    target = dataclasses.asdict(cfg.target)
    gen = dataclasses.asdict(cfg.generation)
    storage_cfg = dataclasses.asdict(cfg.storage)
    if cfg.extract.from_generation:  # one stage: the generating actors write the shards
        return ds.map_batches(
            GenerateAndWrite, batch_size=1, batch_format="pyarrow",
            fn_constructor_kwargs={"run_uri": uri, "storage_options": options, "target": target,
                                   "layer_ids": cfg.layer_ids, "num_layers": cfg.num_layers,
                                   "storage_cfg": storage_cfg, "batch_size": cfg.extract.batch_size,
                                   "generation": gen, "max_prompt_tokens": cfg.prompts.max_prompt_tokens,
                                   "run_key": run_key},
            compute=generation_actors(cfg.generation.actors),
            num_cpus=cfg.generation.num_cpus, num_gpus=cfg.generation.num_gpus,
        )
    if cfg.generation.backend == "dataset":
        ds = ds.map_batches(
            DatasetAnswers, batch_size=1, batch_format="pyarrow",
            fn_constructor_kwargs={"target": target, "generation": gen, "storage_options": options,
                                   "max_prompt_tokens": cfg.prompts.max_prompt_tokens},
            compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.25,  # a tokenizer only
        )
    elif cfg.generation.backend == "hf":
        ds = ds.map_batches(
            Regenerate, batch_size=1, batch_format="pyarrow",
            fn_constructor_kwargs={"target": target, "generation": gen, "storage_options": options,
                                   "max_prompt_tokens": cfg.prompts.max_prompt_tokens},
            compute=generation_actors(cfg.generation.actors),
            num_cpus=cfg.generation.num_cpus, num_gpus=cfg.generation.num_gpus,
        )
    else:
        from pipelines.features.vllm_regen import check_room, regeneration_stage
        from specdec.target import resolve_target_path

        check_room(gen, dataclasses.asdict(cfg.extract))
        max_len = cfg.prompts.max_prompt_tokens + cfg.generation.max_new_tokens
        ds = regeneration_stage(ds, resolve_target_path(cfg.target.model), target, gen,
                                cfg.prompts.max_prompt_tokens, max_len, options)
    return ds.map_batches(
        ExtractFeatures, batch_size=1, batch_format="pyarrow",
        fn_constructor_kwargs={"run_uri": uri, "storage_options": options, "target": target,
                               "layer_ids": cfg.layer_ids, "num_layers": cfg.num_layers,
                               "storage_cfg": storage_cfg, "batch_size": cfg.extract.batch_size,
                               "num_gpus": cfg.extract.num_gpus, "num_cpus": cfg.extract.num_cpus,
                               "run_key": run_key},
        compute=ray.data.ActorPoolStrategy(size=cfg.extract.actors),
        num_cpus=cfg.extract.num_cpus, num_gpus=cfg.extract.num_gpus,
    )


def generation_actors(n: int):
    """The hf generation actors, one shard in flight each: Ray Data otherwise queues
    several shards on the first actor up while the others still load the model (a run of
    2 shards on 2 actors decoded both on one)."""
    import ray.data

    return ray.data.ActorPoolStrategy(size=n, max_tasks_in_flight_per_actor=1)


class Progress:
    """Rows/s, tokens/s and bytes written, logged as shards commit."""

    def __init__(self, total_shards: int, already_done: int):
        self.total, self.done, self.run = total_shards, already_done, 0
        self.rows = self.tokens = self.gen_tokens = self.bytes = 0
        self.t0 = time.perf_counter()

    def update(self, status: dict) -> None:
        self.done += 1
        self.run += 1
        self.rows += status["rows"]
        self.tokens += status["tokens"]
        self.gen_tokens += status["gen_tokens"]
        self.bytes += status["bytes"]
        dt = max(time.perf_counter() - self.t0, 1e-9)
        eta = (self.total - self.done) * dt / self.run
        log.info("shard %s committed | %d/%d shards, eta %.0f s | %d rows %.2f rows/s | %.0f tok/s (generated "
                 "%.0f tok/s) | %s written %s/s", status["shard_id"], self.done, self.total, eta, self.rows,
                 self.rows / dt, self.tokens / dt, self.gen_tokens / dt, _human(self.bytes), _human(self.bytes / dt))

    def as_dict(self) -> dict:
        dt = time.perf_counter() - self.t0
        return {"rows": self.rows, "tokens": self.tokens, "bytes": self.bytes, "seconds": round(dt, 3),
                "rows_per_s": self.rows / dt if dt else 0.0, "tokens_per_s": self.tokens / dt if dt else 0.0}


def run_features(cfg: FeaturesConfig) -> dict:
    """Run (or resume) the pipeline described by ``cfg`` on the connected Ray cluster and
    commit it. Returns a summary; a run already committed returns at once."""
    uri = storage.absolute_uri(cfg.output)
    options = storage.resolve_options(uri, cfg.storage.options)
    fs, root = storage.filesystem(uri, options)
    check_target_early(cfg)
    plan, plan_hash = plan_index(cfg)
    run_key = _start_or_resume(fs, root, uri, cfg, plan_hash, len(plan))
    if storage.exists(fs, storage.join(root, MANIFEST)):
        manifest = storage.read_json(fs, storage.join(root, MANIFEST))
        log.info("%s is already committed (%d samples); nothing to do", uri, manifest["num_samples"])
        return {"uri": uri, "already_committed": True, "shards_run": 0, "shards_skipped": len(plan),
                "num_samples": manifest["num_samples"]}
    done = committed_shards(fs, root)
    pending = [s.shard_id for s in plan if s.shard_id not in done]
    log.info("%s: %d shards planned, %d already committed, %d to run", uri, len(plan), len(plan) - len(pending),
             len(pending))
    written = write_plan_files(cfg, fs, root, set(pending))
    if written:
        log.info("wrote the samples of %d shard(s) to %s/", written, storage.join(uri, PLAN_DIR))
    progress = Progress(len(plan), len(plan) - len(pending))
    if not sys.stdout.isatty():  # our per-shard line says it all; Ray's would log every 10 s
        import ray.data

        ray.data.DataContext.get_current().enable_progress_bars = False
    # one Ray Data execution over every pending shard: the actors live as long as the run
    rows = [{"shard_id": sid, "plan_uri": storage.join(uri, PLAN_DIR, f"{sid}.json")} for sid in pending]
    for status in build_dataset(rows, cfg, uri, options, run_key).iter_rows() if rows else ():
        progress.update(status)
    manifest = commit(fs, root, uri, cfg, plan, run_key)
    return {"uri": uri, "already_committed": False, "shards_run": len(pending),
            "shards_skipped": len(plan) - len(pending), "num_samples": manifest["num_samples"],
            "num_tokens": manifest["num_tokens"], "num_bytes": manifest["num_bytes"], **progress.as_dict()}


# ---------------------------------------------------------------------------- commit
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
             manifest["num_samples"], manifest["num_tokens"], _human(manifest["num_bytes"]), len(ordered),
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
        "created_at": _now(),
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


# ---------------------------------------------------------------------------- manifest, verify
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
        _check_digest(entry, *storage.sha256_file(fs, path))
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


def _check_digest(entry: dict, sha256: str, nbytes: int) -> None:
    if nbytes != entry["bytes"]:
        raise CorruptShardError(entry["path"], f"{nbytes} bytes, manifest says {entry['bytes']}")
    if sha256 != entry["sha256"]:
        raise CorruptShardError(entry["path"], f"sha256 {sha256[:12]}..., manifest says {entry['sha256'][:12]}...")


@contextmanager
def _verified_local_file(fs, path: str, entry: dict, verify: bool) -> Iterator[str]:
    """Shards listed without row-group digests (runs made before them): a local file
    holding the shard (the file itself on a local filesystem, else a streamed temporary
    copy), checked against its whole-file sha256 before any row is read."""
    if storage.is_local(fs):
        if verify:
            _check_digest(entry, *storage.sha256_file(fs, path))
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="feature-shard-") as tmp:
        local = os.path.join(tmp, "shard.parquet")
        digest = storage.download(fs, path, local)
        if verify:
            _check_digest(entry, *digest)
        yield local


# ---------------------------------------------------------------------------- reader
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
    import ray.data

    uri = storage.absolute_uri(uri)
    options = storage.resolve_options(uri, storage_options)
    manifest = load_manifest(uri, options)
    check_manifest(manifest, uri, target_identity=target_identity, layer_ids=layer_ids, hidden_size=hidden_size,
                   tokenizer_hash=tokenizer_hash)
    entries = [{"entry": json.dumps(e)} for e in manifest["shards"] if split is None or shard_split(e) == split]
    if not entries:
        raise ValueError(f"the feature run at {uri} has no {split} shards (see features.storage.holdout_fraction)")
    ds = ray.data.from_items(entries, override_num_blocks=len(entries))
    ds = ds.map_batches(_read_shards, batch_size=1, batch_format="pyarrow",
                        fn_kwargs={"uri": uri, "options": options, "verify": verify_checksums})
    # each yielded part leaves the task as its own block: Ray Data would otherwise gather
    # parts up to 128 MB (a whole small shard) before the first row reaches a consumer
    ds.context.target_max_block_size = 1
    return ds


def shard_split(entry: dict) -> str:
    """"holdout" for a shard written as held-out rows, else "train"."""
    return entry.get("split", "train")


def _read_shards(entries: pa.Table, uri: str, options: dict, verify: bool):
    """Yield the rows of each listed shard in small batches, each part checked first."""
    fs, root = storage.filesystem(uri, options)
    for entry in map(json.loads, entries.column("entry").to_pylist()):
        path = storage.join(root, entry["path"])
        if "row_groups" in entry:
            yield from stream_shard(fs, path, entry, verify)
            continue
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


# ---------------------------------------------------------------------------- small helpers
def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


__all__ = ["run_features", "verify_features", "read_features", "load_manifest", "plan_shards", "commit",
           "has_holdout_shards", "shard_split", "stream_shard",
           "check_target_early", "VerifyReport", "ShardPlan"]
