"""Driver-side planning of a training run (:func:`prepare`): reads the target's config,
tokenizer and weights identity without loading its weights (the identity decides which
feature runs are acceptable and is the drafter's lineage; ``specdec/frozen.py``), checks
the feature runs, builds the drafter config, its initial weights and draft vocabulary,
reads the training and held-out rows, and opens (or reopens) the MLflow run; the result is
a :class:`RunPlan` the trainer and the export work from.

One room just over 400 lines: :func:`prepare` is one sequence read top to bottom, and its
steps' checks (a resumed run's drafter shape, the feature runs' layouts) sit beside it."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from dataclasses import dataclass

import torch

from pipelines import registry, storage
from pipelines.config import ConfigError
from pipelines.train.config import TrainRecipe
from pipelines.train.data import (keep_replayed, keep_split, manifest_sha256, read_sequences, replay_fraction,
                                  split_holdout)
from pipelines.train.heldout import HeldOut, held_out_blocks
from pipelines.train.longalign_rows import longalign_rows
from pipelines.train.runner import TrainState, latest_checkpoint_state
from pipelines.train.streamed import stream_datasets, stream_layout

log = logging.getLogger(__name__)


@dataclass
class RunPlan:
    """What the driver worked out before starting the trainer."""

    target: dict
    drafter_config: object
    draft_vocab: list[int] | None
    init_state: dict
    datasets: dict  # {"train": the training rows (Ray Data, split among the workers)}
    holdout: HeldOut  # the held-out blocks, each worker reading its own
    layout: dict | None
    train_rows: int
    lineage: dict
    tracking_uri: str
    run_id: str
    run_uri: str
    storage_options: dict
    resume: TrainState | None
    mlflow_live: bool  # workers can reach the tracking store (else the driver logs evaluations at the end)


def prepare(recipe: TrainRecipe) -> RunPlan:
    """Everything that can be checked is checked here, cheapest first, before any worker
    starts: the target, its feature run, the drafter shape against an existing run."""
    import ray

    from pipelines.features.format import tokenizer_fingerprint
    from specdec.frozen import load_target_shell

    tc, spec = recipe.train, recipe.features.target
    # config, tokenizer and identity only: the weights load where they run (the workers)
    target = load_target_shell(spec.model, dtype=spec.dtype, trust_remote_code=spec.trust_remote_code)
    tok_hash = tokenizer_fingerprint(target.tokenizer)["hash"] if target.tokenizer is not None else None
    options = storage.resolve_options(recipe.feature_uris[0], recipe.features.storage.options)
    run_uri = storage.join(storage.absolute_uri(tc.storage_path), tc.run_name)
    tracking_uri = registry.resolve_tracking_uri(recipe.registry.tracking_uri)

    # LongAlign conversations -> token rows in the run directory (checked before anything is written)
    longalign = longalign_rows(recipe, target, run_uri) if tc.longalign else {}
    sequences = tc.sequences or longalign.get("uri")
    manifests = _load_manifests(recipe, options, sequences)
    manifest_uri, manifest = next(iter(manifests.items()), (None, None))
    layer_ids = _layer_ids(recipe, target, manifest, manifest_uri)
    layout = (stream_layout(recipe, layer_ids, target.hidden_size) if tc.streamed
              else _feature_layout(recipe, manifests))

    cfg, resume, resume_cfg = _drafter_config(recipe, target, layer_ids, run_uri)
    drafter, parent = _initial_drafter(recipe, cfg, target, tracking_uri)
    init_state = {k: v.detach().float().clone() for k, v in drafter.state_dict().items()}
    datasets, train_rows, replay = _datasets(recipe, target, tok_hash, layer_ids, manifests, options, sequences,
                                             layout)
    _choose_draft_vocab(recipe, drafter, target, manifests, options, datasets["train"])
    if tc.streamed:  # from token rows to rows with features, computed by target actors of their own
        datasets = stream_datasets(recipe, datasets, dataclasses.asdict(spec) | {"identity": target.identity},
                                   layer_ids, target.hidden_size)
    holdout = held_out_blocks(datasets.pop("holdout"))

    lineage = {
        "target_model": spec.model, "target_identity": target.identity, "tokenizer_hash": tok_hash,
        "features_uri": ",".join(manifests) or storage.absolute_uri(sequences),
        "features_manifest_sha256": _manifests_sha256(list(manifests), options) if manifests else None,
        "config_sha256": recipe.config_hash(), "git_commit": registry.git_commit(), "run_name": tc.run_name,
        "recipe": recipe.source, "block_size": cfg.block_size, "num_layers": cfg.num_hidden_layers,
        "target_layer_ids": list(cfg.target_layer_ids), "online_features": tc.online,
        **({"streamed_features": True} if tc.streamed else {}), **parent,
        **{k: v for k, v in longalign.items() if k != "uri"}, **replay, **recipe.version_tags,
    }
    run_id = _start_mlflow_run(recipe, tracking_uri, lineage, run_uri, resume_cfg)
    lineage["mlflow_run_id"] = run_id
    cfg.extra = dict(lineage)
    return RunPlan(target=dataclasses.asdict(spec) | {"identity": target.identity}, drafter_config=cfg,
                   draft_vocab=drafter.draft_vocab.tolist() if drafter.draft_vocab is not None else None,
                   init_state=ray.put(init_state), datasets=datasets, holdout=holdout,
                   layout=_collate_layout(layout, tc.distill), train_rows=train_rows,
                   lineage=lineage, tracking_uri=tracking_uri, run_id=run_id, run_uri=run_uri,
                   storage_options=tc.storage_options, resume=resume, mlflow_live=_mlflow_live(tracking_uri))


def _replay(recipe: TrainRecipe, new_rows: int, layout, options: dict) -> tuple[list, dict]:
    """``train.replay``: a share of the parent's training rows (by a hash of their ids; never
    their held-out shards), as parts read beside the new runs'. Returns (parts, lineage fields);
    ([], {}) without a replay."""
    from pipelines.features import RunPart, has_holdout_shards, load_manifest
    from pipelines.features.format import FeatureLayout

    rp = recipe.train.replay
    if not rp.uris:
        return [], {}
    uris, splits, rows = list(map(storage.absolute_uri, rp.uris)), [], 0
    for uri in uris:
        try:
            m = load_manifest(uri, options)
        except FileNotFoundError as e:
            raise ConfigError(f"train.replay.features: {e}") from None
        if layout is not None and FeatureLayout.from_manifest(m) != layout:
            raise ConfigError(f"train.replay.features: the feature run {uri} stores {FeatureLayout.from_manifest(m)}, "
                              f"but the training runs store {layout}; a replay needs the same layers and layout")
        held = has_holdout_shards(m)
        rows += m["num_samples"] - (m.get("holdout", {}).get("num_samples", 0) if held else 0)
        splits.append("train" if held else None)
    fraction = replay_fraction(new_rows, rows, rp.share)
    parts = [RunPart(uri, split, functools.partial(keep_replayed, fraction=fraction)) for uri, split in zip(uris, splits)]
    log.info("replaying %.1f%% of %d rows of %s among %d new rows (train.replay.share %.2f)", 100 * fraction, rows,
             ", ".join(rp.uris), new_rows, rp.share)
    return parts, {"replay_features_uri": ",".join(uris), "replay_manifest_sha256": _manifests_sha256(uris, options),
                   "replay_share": rp.share, "replay_fraction": round(fraction, 6),
                   "replay_rows": int(round(fraction * rows))}


def _load_manifests(recipe: TrainRecipe, options: dict, sequences: str | None) -> dict:
    """uri -> manifest of each feature run, in the recipe's order (the first one fixes
    layers and layout); none when training online from token sequences."""
    from pipelines.features import load_manifest

    tc = recipe.train
    manifests = {}
    if tc.from_target and sequences:
        return manifests
    for uri in map(storage.absolute_uri, recipe.feature_uris):
        try:
            manifests[uri] = load_manifest(uri, options)
        except FileNotFoundError as e:
            raise ConfigError(f"{'train.features' if tc.features else 'features.output'}: {e}") from None
    return manifests


def _feature_layout(recipe: TrainRecipe, manifests: dict):
    """The storage layout the workers decode (stored features only): the same in every
    feature run, with the teacher's log-probs when ``train.distill`` needs them."""
    from pipelines.features.format import FeatureLayout

    tc = recipe.train
    manifest_uri, manifest = next(iter(manifests.items()), (None, None))
    layout = FeatureLayout.from_manifest(manifest) if manifest is not None and not tc.online else None
    for uri, m in manifests.items():
        if layout is not None and FeatureLayout.from_manifest(m) != layout:
            raise ConfigError(f"train.features: the feature run {uri} stores {FeatureLayout.from_manifest(m)}, "
                              f"but {manifest_uri} stores {layout}; runs trained on together need the same "
                              "layers and storage layout")
        if tc.distill and not tc.from_target and not m.get("teacher_topk"):
            raise ConfigError(f"train.distill: {tc.distill} needs the target's log-probs, which the feature run "
                              f"{uri} does not store; make it with features.storage.teacher_topk > 0 "
                              "(or train with train.online or train.streamed: true)")
    return layout


def _collate_layout(layout, distill) -> dict | None:
    """The layout as the workers' Collate takes it."""
    collate_layout = layout.as_dict() if layout is not None else None
    if collate_layout is not None and not distill:
        collate_layout["teacher_topk"] = 0  # stored teacher log-probs the loss will not use are never decoded
    return collate_layout


def _drafter_config(recipe: TrainRecipe, target, layer_ids: list[int], run_uri: str):
    """(drafter config, the run's latest state, its saved drafter config): an existing run
    must have trained the same drafter shape."""
    from specdec.drafter import drafter_config_for_target

    tc, dc = recipe.train, recipe.drafter
    try:
        cfg = drafter_config_for_target(target, num_hidden_layers=dc.num_layers, block_size=dc.block_size,
                                        target_layer_ids=layer_ids, mask_token_id=dc.mask_token_id,
                                        intermediate_size=dc.intermediate_size, sliding_window=dc.sliding_window,
                                        layer_types=dc.layer_types)
        if dc.arch == "dflash2":
            cfg.dflash2 = dict(dc.dflash2)
            cfg = type(cfg)(**cfg.as_dict())  # validated (errors name the key)
        elif dc.dflash2:
            raise ValueError("dflash2: set only with drafter.arch: dflash2")
    except ValueError as e:  # the window rules (>= block size, <= context, one kind per layer)
        raise ConfigError(f"drafter.{e}") from None
    resume, resume_cfg = latest_checkpoint_state(run_uri, tc.storage_options)
    if resume_cfg is not None:
        _check_same_drafter(resume_cfg, cfg, tc.run_name, run_uri)
    return cfg, resume, resume_cfg


def _initial_drafter(recipe: TrainRecipe, cfg, target, tracking_uri: str):
    """(the drafter with its starting weights, the lineage of the drafter it fine-tunes)."""
    from specdec.dflash2 import build_drafter
    from specdec.drafter import init_from_target

    dc = recipe.drafter
    torch.manual_seed(recipe.train.seed)
    drafter = build_drafter(cfg)
    parent = {}  # lineage of the drafter this run fine-tunes
    if dc.init_from:
        parent = _init_from_drafter(drafter, dc.init_from, target, tracking_uri)
    elif dc.init_from_target:
        if getattr(target, "source_path", None) is not None:  # a shell: read only the layers it starts from
            from specdec.drafter import init_layer_picks
            from specdec.frozen import materialize

            picks = init_layer_picks(len(drafter.layers), target.num_layers)
            materialize(target, [target.layers[i] for i in picks] + [m for m in (getattr(target.base, "norm", None),)
                                                                     if m is not None])
        init_from_target(drafter, target)
    return drafter, parent


def _choose_draft_vocab(recipe: TrainRecipe, drafter, target, manifests: dict, options: dict, train_ds) -> None:
    """The parent's draft vocabulary when it has the recipe's size, else one built from the
    training rows, or none (the whole target vocabulary)."""
    dc = recipe.drafter
    inherited = drafter.draft_vocab
    if dc.draft_vocab_size and inherited is not None and inherited.numel() == dc.draft_vocab_size:
        log.info("draft vocabulary: the parent's %d tokens", inherited.numel())
    elif dc.draft_vocab_size:
        drafter.set_draft_vocab(_draft_vocab(recipe, target, list(manifests), options, train_ds))
    else:
        drafter.set_draft_vocab(None)


def _start_mlflow_run(recipe: TrainRecipe, tracking_uri: str, lineage: dict, run_uri: str,
                      resume_cfg: dict | None) -> str:
    """The MLflow run id: a new run, or the one a resumed training logged to."""
    run_id = registry.start_run(
        tracking_uri, recipe.registry.experiment or recipe.model_name, recipe.train.run_name,
        tags={f"dflash.{k}": v for k, v in lineage.items() if v is not None} | {"dflash.run_uri": run_uri},
        resume_run_id=(resume_cfg or {}).get("dflash_ray", {}).get("mlflow_run_id"))
    registry.log_params(tracking_uri, run_id, recipe.as_dict())
    return run_id


def _mlflow_live(tracking_uri: str) -> bool:
    """Whether the workers can log to the tracking store themselves."""
    live = not registry.is_local_store(tracking_uri) or _single_node()
    if not live:
        log.warning("MLflow store %s is local to this node and the cluster has several: workers will not log "
                    "live metrics (the driver logs the evaluations at the end); set MLFLOW_TRACKING_URI to a "
                    "server for live metrics", tracking_uri)
    return live


def _single_node() -> bool:
    import ray

    return len([n for n in ray.nodes() if n.get("Alive")]) <= 1


def _init_from_drafter(drafter, path: str, target, tracking_uri: str) -> dict:
    """Copy a trained drafter's weights into ``drafter`` (same shape; the draft vocabulary
    is an index set over the target's LM head, so the new run's own one is kept).
    ``path`` is a drafter directory or a registry version (``models:/name@alias``,
    ``models:/name/<version>``, downloaded through pipelines.registry). Returns the
    parent's lineage fields."""
    from specdec.checkpoint import DrafterMismatchError, load_drafter

    parent = {"parent_drafter": path, "parent_uri": path}
    local = path
    if registry.is_registry_uri(path):
        try:
            found, _, version = registry.resolve_drafter(tracking_uri, path)
        except (ValueError, registry.RegistryError) as e:
            raise ConfigError(f"drafter.init_from: {e}") from None
        local = str(found)
        parent["parent_version"] = version
    try:
        source = load_drafter(local, dtype=torch.float32, target=target)
    except (FileNotFoundError, DrafterMismatchError) as e:
        raise ConfigError(f"drafter.init_from: {e}") from None
    mine, theirs = drafter.config, source.config
    if theirs.dflash2 is not None and mine.dflash2 is None:
        raise ConfigError(f"drafter.init_from: {path} is a DFlash2 drafter; set drafter.arch: dflash2")
    shape = ("num_hidden_layers", "block_size", "target_layer_ids", "intermediate_size", "mask_token_id")
    for name in shape + (("dflash2",) if theirs.dflash2 is not None else ()):
        if getattr(mine, name) != getattr(theirs, name):
            raise ConfigError(f"drafter.init_from: {path} has {name}={getattr(theirs, name)!r} but the recipe "
                              f"builds {getattr(mine, name)!r}")
    # a DFlash parent of a DFlash2 drafter: its parts load, the new ones stay neutral
    missing, _ = drafter.load_state_dict(source.state_dict(), strict=type(source) is type(drafter))
    if any(".attention_conv." not in k and ".mlp_conv." not in k and not k.startswith("candidate_selector.")
           for k in missing):
        raise ConfigError(f"drafter.init_from: {path} lacks tensors {sorted(missing)}")
    log.info("drafter initialised from %s%s", path, f" (v{parent['parent_version']})" if "parent_version" in parent
             else "")
    # the parent's draft vocabulary, built on its (larger) data: a fine-tuning set of a few
    # hundred answers would give a vocabulary that covers little of what the parent drafts
    drafter.set_draft_vocab(source.draft_vocab)
    return parent | {"parent_mlflow_run_id": theirs.extra.get("mlflow_run_id")}


def _manifests_sha256(uris: list[str], options: dict) -> str:
    """One run: its manifest's sha256; several: the sha256 of theirs, in order."""
    shas = [manifest_sha256(uri, options) for uri in uris]
    return shas[0] if len(shas) == 1 else hashlib.sha256(",".join(shas).encode()).hexdigest()


def _draft_vocab(recipe: TrainRecipe, target, manifest_uris: list[str], options: dict, train_ds) -> torch.Tensor:
    """The ``drafter.draft_vocab_size`` most frequent response tokens of the training rows
    (held-out rows never count), plus the target's stop tokens."""
    from pipelines.features import response_token_counts
    from specdec.draft_vocab import build_vocab, count_tokens, coverage

    size = recipe.drafter.draft_vocab_size
    if size > target.vocab_size:
        raise ConfigError(f"drafter.draft_vocab_size: {size} exceeds the target vocabulary ({target.vocab_size})")
    tc = recipe.train
    if manifest_uris:  # stored features: read just the token columns of each shard
        holdout = 0.0 if tc.holdout else tc.holdout_fraction
        counts = sum(response_token_counts(uri, options, target.vocab_size, holdout) for uri in manifest_uris)
    else:
        rows = train_ds.select_columns(["input_ids", "loss_mask"]).iter_rows()
        counts = count_tokens(((r["input_ids"], r["loss_mask"]) for r in rows), target.vocab_size)
    ids = build_vocab(counts, size, always=target.stop_token_ids())
    log.info("draft vocabulary: %d tokens cover %.2f%% of %d training response tokens", ids.numel(),
             100 * coverage(counts, ids), int(counts.sum()))
    return ids


def _layer_ids(recipe: TrainRecipe, target, manifest: dict | None, manifest_uri: str | None) -> list[int]:
    """The target layers the drafter reads: stored features fix them; online features
    take the recipe's (or the paper's spacing)."""
    from specdec.checkpoint_format import default_target_layer_ids

    dc = recipe.drafter
    if recipe.train.from_target:
        layer_ids = list(dc.layer_ids or default_target_layer_ids(target.num_layers, dc.num_features))
    else:
        layer_ids = list(dc.layer_ids or manifest["layer_ids"])
        if layer_ids != list(manifest["layer_ids"]):
            raise ConfigError(f"drafter.layer_ids: {layer_ids} but the feature run at {manifest_uri} holds layers "
                              f"{manifest['layer_ids']}; leave it null or train with online features")
    if any(not 0 <= i < target.num_layers for i in layer_ids) or len(set(layer_ids)) != len(layer_ids):
        raise ConfigError(f"drafter.layer_ids: {layer_ids} are not distinct layers of a {target.num_layers}-layer "
                          "target")
    return layer_ids


def _datasets(recipe: TrainRecipe, target, tok_hash, layer_ids, manifests: dict, options, sequences=None,
              layout=None) -> tuple[dict, int, dict]:
    """({"train": streamed rows, "holdout": materialised rows}, training rows, replay lineage).
    Feature runs are checked against the target (identity, tokenizer; layers and width unless
    the features are computed online); several runs, and a replay of the parent's
    (``train.replay``), are read as one stream with their shards interleaved."""
    from pipelines.features import RunPart, has_holdout_shards, read_runs

    tc = recipe.train
    expect = {"target_identity": target.identity, "tokenizer_hash": tok_hash}
    if not tc.from_target:
        expect.update(layer_ids=list(layer_ids), hidden_size=target.hidden_size)

    def read(parts: list):
        ds = read_runs(parts, storage_options=options, **expect)
        return ds.select_columns(["id", "input_ids", "loss_mask"]) if tc.from_target else ds

    # runs that wrote held-out shards (features.storage.holdout_fraction) never train on them
    held = [uri for uri, m in manifests.items() if has_holdout_shards(m)]
    on_sequences = tc.from_target and sequences
    runs = [] if on_sequences else [RunPart(storage.absolute_uri(u), "train" if u in held else None) for u in manifests]
    train_ds = read_sequences(sequences, tc.storage_options or options,
                              "train.longalign" if tc.longalign else "train.sequences") if on_sequences else None
    if tc.holdout:
        holdout_ds = (read_sequences(tc.holdout, tc.storage_options or options, "train.holdout") if on_sequences
                      else read([RunPart(storage.absolute_uri(tc.holdout))]))
    elif held and not on_sequences:
        log.info("evaluating on the held-out shards of %s (train.holdout_fraction is not used)", ", ".join(held))
        holdout_ds = read([RunPart(storage.absolute_uri(u), "holdout") for u in held])
    elif tc.holdout_fraction > 0 and on_sequences:
        holdout_ds = split_holdout(train_ds, tc.holdout_fraction, holdout=True)
        train_ds = split_holdout(train_ds, tc.holdout_fraction, holdout=False)
    elif tc.holdout_fraction > 0:
        def share(holdout: bool) -> list:
            keep = functools.partial(keep_split, fraction=tc.holdout_fraction, holdout=holdout)
            return [dataclasses.replace(p, keep=keep) for p in runs]
        holdout_ds, runs = read(share(True)), share(False)
    else:
        raise ConfigError("train.holdout_fraction: evaluation needs held-out rows; set a fraction > 0 or "
                          "train.holdout")
    holdout_ds.context.enable_progress_bars = False  # workers print their own progress lines
    holdout_ds = holdout_ds.limit(tc.eval_samples).materialize()
    holdout_ds.context.enable_progress_bars = False
    if holdout_ds.count() == 0:
        raise ConfigError("train.holdout_fraction: no sequence falls in the held-out share; raise it or set "
                          "train.holdout")
    if on_sequences:
        train_rows, replay = train_ds.count(), {}
    else:
        samples = sum(m["num_samples"] for m in manifests.values())
        held_rows = sum(m.get("holdout", {}).get("num_samples", 0) for m in manifests.values())
        train_rows = int(samples - held_rows if held else samples * (1 if tc.holdout else 1 - tc.holdout_fraction))
        replayed, replay = _replay(recipe, max(1, train_rows), layout, options)
        train_ds = read(runs + replayed)
    train_ds.context.enable_progress_bars = False
    return {"train": train_ds, "holdout": holdout_ds}, max(1, train_rows) + replay.get("replay_rows", 0), replay


def _check_same_drafter(saved: dict, cfg, run_name: str, run_uri: str) -> None:
    """A resumed run must train the same drafter shape; name the first field that differs."""
    now = cfg.to_hf_dict()
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "block_size", "sliding_window", "layer_types",
                "architectures"):
        if saved.get(key, now.get(key) if key == "layer_types" else None) != now.get(key):
            field_name = {"num_hidden_layers": "drafter.num_layers", "block_size": "drafter.block_size",
                          "intermediate_size": "drafter.intermediate_size", "sliding_window": "drafter.sliding_window",
                          "layer_types": "drafter.layer_types",
                          "architectures": "drafter.arch"}.get(key, f"drafter ({key})")
            raise ConfigError(f"{field_name}: run '{run_name}' at {run_uri} was trained with {key}={saved.get(key)}, "
                              f"the recipe now gives {now.get(key)}; use another train.run_name to start afresh")
    for key in ("target_layer_ids", "mask_token_id"):
        if saved["dflash_config"].get(key) != now["dflash_config"].get(key):
            raise ConfigError(f"drafter.{'layer_ids' if key == 'target_layer_ids' else key}: run '{run_name}' at "
                              f"{run_uri} was trained with {saved['dflash_config'].get(key)}, the recipe now gives "
                              f"{now['dflash_config'].get(key)}; use another train.run_name")
