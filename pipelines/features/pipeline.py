"""Ray Data feature pipeline: prompts -> target regenerations -> teacher-forced hidden
states of the selected layers -> sharded Parquet in object storage, plus ``manifest.json``.

This module drives a run (:func:`run_features` (cfg) -> summary: runs or resumes it, writes
the manifest last) as one Ray Data stage graph. Its other parts have rooms of their own
(the file format: :mod:`pipelines.features.format`):

* planning, the shards and their plan files: :mod:`pipelines.features.plan`;
* committing and checking, ``manifest.json`` and :func:`verify_features` (uri) ->
  ``VerifyReport``: :mod:`pipelines.features.manifest`;
* reading, :func:`read_features` (uri, target_identity=, layer_ids=, hidden_size=) ->
  ``ray.data.Dataset`` over a committed run: :mod:`pipelines.features.reader`;
* the Ray Data actors: :mod:`pipelines.features.workers`.

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
import json
import logging
import sys
import time
from pathlib import Path

from pipelines import storage
from pipelines.config import ConfigError, FeaturesConfig
from pipelines.features.format import FORMAT, SCHEMA_VERSION
from pipelines.features.manifest import MANIFEST, human_size, utc_now, commit, committed_shards
from pipelines.features.plan import PLAN_DIR, plan_index, write_plan_files
from pipelines.features.shards import generation_actors
from pipelines.features.target_pass import resolve_layer_ids
from pipelines.features.workers import CapturedAnswers, DatasetAnswers, ExtractFeatures, GenerateAndWrite, Regenerate

log = logging.getLogger(__name__)
RUN_FILE = "run.json"


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
                                  "started_at": utc_now()})
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
    elif cfg.generation.backend == "captured":
        ds = ds.map_batches(
            CapturedAnswers, batch_size=1, batch_format="pyarrow",
            fn_constructor_kwargs={"generation": gen, "storage_options": options,
                                   "max_prompt_tokens": cfg.prompts.max_prompt_tokens},
            compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.25,  # reads JSON only
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
                 self.rows / dt, self.tokens / dt, self.gen_tokens / dt, human_size(self.bytes),
                 human_size(self.bytes / dt))

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


__all__ = ["run_features", "check_target_early"]
