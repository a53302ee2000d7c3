"""The training recipe: ``drafter:``, ``train:`` and ``registry:`` sections of a recipe
YAML, validated into dataclasses with errors that name the key's path
(``train.num_workers: expected an int >= 1 or [min, max], got [3, 1]``).

The target is the one the recipe's ``features:`` section describes (``features.target``);
its stored features are read from ``features.output`` unless ``train.features`` says
otherwise. One recipe file therefore describes data, drafter and training for a target.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from specdec.checkpoint_format import MIN_BLOCK_SIZE
from specdec.target import target_slug  # noqa: F401  (re-exported: recipes name models by it)
from pipelines.config import (FRACTION, NON_NEGATIVE, POSITIVE, ConfigError, FeaturesConfig, apply_overrides, option,
                              parse_section, read_yaml)

#: names the embedded default target goes by (see specdec.target.resolve_target_path)


@dataclass
class DrafterSection:
    num_layers: int = option(1, check=POSITIVE)  # draft decoder layers
    block_size: int = option(16, check=(lambda v: v >= MIN_BLOCK_SIZE, f">= {MIN_BLOCK_SIZE}"))  # B: anchor + B-1 drafts
    layer_ids: list[int] | None = None  # target layers fed as features; null: the feature run's layers
    num_features: int = option(5, check=POSITIVE)  # online mode without layer_ids: this many, paper spacing
    mask_token_id: int | None = option(None, check=NON_NEGATIVE)  # null: a spare special token of the tokenizer
    intermediate_size: int | None = option(None, check=POSITIVE)  # null: the target's
    init_from_target: bool = True  # draft layers and final norm start from target layers (shapes match)
    # start from a trained drafter directory instead (fine-tuning: pre-trained on cheaper
    # data, or a champion adapted to long context); its shape must match this section
    init_from: str | None = None
    # draft head over the N most frequent training-response tokens (+ stop tokens); null: the full vocabulary
    draft_vocab_size: int | None = option(None, check=POSITIVE)
    # sliding-window draft attention: each query sees the last W context positions, so draft
    # KV and draft cost stay bounded at long context (the target keeps full context);
    # layer_types: per layer "full_attention" / "sliding_attention" (null: all sliding when a window is set)
    sliding_window: int | None = option(None, check=POSITIVE)
    layer_types: list[str] | None = None
    # arch dflash2: grouped dynamic convolutions + a top-K candidate selector (specdec/dflash2.py);
    # dflash2: its dflash_config keys over the defaults (specdec.checkpoint_format.DFLASH2_DEFAULTS)
    arch: Literal["dflash", "dflash2"] = "dflash"
    dflash2: dict = option(factory=dict)


@dataclass
class StreamSection:
    """``train.stream``: the target actors of ``train.streamed`` (Ray Data), sized apart
    from the trainers."""

    actors: int = option(1, check=POSITIVE)  # target actors, each with the whole target
    num_cpus: float = option(1.0, check=POSITIVE)  # per actor (on a CPU, also its torch threads)
    num_gpus: float = option(0.0, check=NON_NEGATIVE)  # per actor; 0: the target runs on the CPU
    batch_size: int = option(8, check=POSITIVE)  # sequences per target forward pass


@dataclass
class ReplaySection:
    """``train.replay``: rows of the parent drafter's own training data mixed into a fine-tuning
    run (e.g. on captured traffic, with ``drafter.init_from``), so the drafter keeps the general
    domain it was trained on while it learns the new one."""

    features: Any = None  # the committed feature run(s) the parent was trained on: a run or a list
    share: float = option(0.3, check=(lambda v: 0 < v < 1, "in (0, 1)"))  # of the training rows, about

    def __post_init__(self):
        self.features = _feature_runs(self.features, "train.replay.features")

    @property
    def uris(self) -> list[str]:
        return [] if self.features is None else [self.features] if isinstance(self.features, str) else self.features


@dataclass
class TrainSection:
    run_name: str  # a Ray Train run; running the same name again resumes it
    storage_path: str = "runs/train"  # local directory or s3://bucket/prefix (checkpoints, export)
    storage_options: dict = option(factory=dict)  # s3: endpoint_url, region, key, secret (else AWS_* variables)
    # ---- data
    # a committed feature run, or a list of runs of the same target and layers read as one
    # training set (e.g. a second run over new prompts, features.prompts.skip); null: features.output
    features: Any = None
    online: bool = False  # compute features on the workers (the target runs there) instead of reading them
    # compute them on target actors of their own (train.stream) that stream rows into the workers,
    # nothing stored (pipelines/train/streamed.py); excludes online
    streamed: bool = False
    stream: StreamSection = option(factory=StreamSection)
    replay: ReplaySection = option(factory=ReplaySection)  # a share of the parent's data mixed in
    sequences: str | None = None  # online/streamed: token rows (Parquet/JSONL: input_ids + loss_mask or prompt_tokens)
    # a LongAlign JSONL ({"messages": [...]} per line): tokenized with the target's chat template
    # (pipelines.longalign), written once to <storage_path>/<run_name>/longalign.parquet and trained
    # on as online sequences (implies online: true; excludes sequences and features)
    longalign: str | None = None
    # online only: a local directory where each row's target features are kept (fp16) after
    # their first pass, so later epochs and evaluations skip the target (small long-context
    # sets trained for several epochs); costs tokens x layers x hidden x 2 bytes a row
    feature_cache: str | None = None
    holdout: str | None = None  # a separate committed feature run (or sequences) for evaluation
    holdout_fraction: float = option(0.05, check=FRACTION)  # without holdout: this share of rows, by id hash
    eval_samples: int = option(64, check=POSITIVE)  # held-out sequences per evaluation (cap)
    max_length: int = option(3072, check=POSITIVE)  # longer sequences are cut to their first max_length tokens
    shuffle_buffer: int = option(64, check=NON_NEGATIVE)  # rows of local shuffle per worker (0: stream order)
    # batches of similar lengths: each worker sorts a window of max(shuffle_buffer, 8 x batch_size)
    # rows (rounded to whole batches) by length, cuts it into batches and shuffles their order
    length_buckets: bool = False
    # recompute each draft layer in backward (torch.utils.checkpoint): less activation memory at long context
    gradient_checkpointing: bool = False
    # ---- optimisation (the paper's recipe by default)
    epochs: int = option(6, check=POSITIVE)
    max_steps: int | None = option(None, check=POSITIVE)  # stop after this many optimizer steps (smoke runs)
    batch_size: int = option(4, check=POSITIVE)  # sequences per worker per step
    num_anchors: int = option(512, check=POSITIVE)  # blocks sampled per sequence
    eval_anchors: int | None = option(None, check=POSITIVE)  # null: num_anchors
    # more blocks per sequence over the prompt, labelled by its own tokens (training only): at long
    # context the document is most of the sequence, and every position of it has target features
    context_anchors: int = option(0, check=NON_NEGATIVE)
    loss_lambda: float | None = option(None, check=POSITIVE)  # decay of the offset weights; null: paper's per B
    # alpha > 0: CE against the target's own law (top-K log-probs stored with the features,
    # features.storage.teacher_topk, or computed online) mixed in as (1 - alpha) * hard + alpha * soft
    distill: float = option(0.0, check=FRACTION)
    selector_alpha: float = option(1.0, check=NON_NEGATIVE)  # dflash2: weight of the selector's CE in the loss
    lr: float = option(6e-4, check=POSITIVE)
    min_lr_ratio: float = option(0.0, check=FRACTION)  # cosine ends at lr * min_lr_ratio
    warmup: float = option(0.04, check=FRACTION)  # share of the schedule spent warming up linearly
    weight_decay: float = option(0.0, check=NON_NEGATIVE)  # on matrices only (never norms)
    # residual dropout on the draft layers' attention and MLP outputs while training (small data)
    dropout: float = option(0.0, check=(lambda v: 0 <= v < 1, "in [0, 1)"))
    grad_clip: float = option(1.0, check=NON_NEGATIVE)  # 0: off
    seed: int = 0
    # ---- evaluation, checkpoints, logging
    eval_every: int = option(0, check=NON_NEGATIVE)  # steps between evaluations (0: once per epoch)
    keep_best: int = option(3, check=POSITIVE)  # checkpoints kept by held-out tau (the latest is always kept)
    early_stop_patience: int | None = option(None, check=POSITIVE)  # stop after N evals without a better tau
    log_every: int = option(10, check=POSITIVE)  # steps between progress lines / step metrics
    export: str | None = None  # drafter directory to export; null: <storage_path>/<run_name>/drafter
    export_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"  # auto: the training precision
    # ---- scaling
    num_workers: Any = 1  # an int, or [min, max] for elastic training
    use_gpu: bool = False
    cpus_per_worker: float = option(1.0, check=NON_NEGATIVE)
    threads_per_worker: int | None = option(None, check=POSITIVE)  # torch threads; null: cpus_per_worker
    strategy: Literal["ddp", "deepspeed"] = "ddp"
    zero_stage: Literal[2, 3] = 2  # deepspeed only
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    attention: Literal["auto", "dense", "flex"] = "auto"  # block mask kernel; auto: flex on GPU, dense on CPU
    max_failures: int = option(3, check=(lambda v: v >= -1, ">= -1"))  # worker failures survived (-1: forever)

    def __post_init__(self):
        self.num_workers = _workers(self.num_workers)
        self.features = _feature_runs(self.features)
        if isinstance(self.stream, dict):  # the workers rebuild the section from its dict
            self.stream = StreamSection(**self.stream)
        if isinstance(self.replay, dict):
            self.replay = ReplaySection(**self.replay)
        if self.replay.uris and self.from_target:
            raise ConfigError("train.replay.features: replays stored feature runs into a run that reads stored "
                              "features; it cannot be combined with train.online or train.streamed")
        mine = [self.features] if isinstance(self.features, str) else self.features or []
        if set(mine) & set(self.replay.uris):
            raise ConfigError(f"train.replay.features: {sorted(set(mine) & set(self.replay.uris))} is also in "
                              "train.features; its rows would count twice")
        if self.streamed and self.online:
            raise ConfigError("train.streamed: cannot be combined with train.online (online runs the target on "
                              "the trainers, streamed on actors of its own, train.stream); pick one")
        if self.longalign is not None:
            for other in ("sequences", "features"):
                if getattr(self, other) is not None:
                    raise ConfigError(f"train.longalign: cannot be combined with train.{other} (the LongAlign file "
                                      "is the training data); drop one of them")
            self.online = not self.streamed  # LongAlign rows are token sequences: the target computes their features
        if self.sequences is not None and not self.from_target:
            raise ConfigError("train.sequences: token sequences need train.online: true or train.streamed: true "
                              "(stored features carry their own sequences)")
        if self.feature_cache is not None and not self.online:
            raise ConfigError("train.feature_cache: caches online features; it needs train.online: true "
                              "(stored features are read from their run)")
        if self.feature_cache is not None and "://" in self.feature_cache:
            raise ConfigError(f"train.feature_cache: a local directory on each node, got {self.feature_cache!r}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.run_name):
            raise ConfigError(f"train.run_name: expected letters, digits, '.', '_' or '-', got {self.run_name!r}")

    @property
    def from_target(self) -> bool:
        """The features come from the target while training (online or streamed), not from storage."""
        return self.online or self.streamed

    @property
    def min_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[1]


def _feature_runs(value, path: str = "train.features") -> str | list[str] | None:
    """``train.features``: null, one run, or a list of distinct runs (one run in a list is that run)."""
    if value is None or (isinstance(value, str) and value):
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        if len(set(value)) != len(value):
            raise ConfigError(f"{path}: a feature run is listed twice in {value!r}; its rows would count double")
        return value[0] if len(value) == 1 else list(value)
    raise ConfigError(f"{path}: expected a feature run (string) or a non-empty list of them, got {value!r}")


def _workers(value) -> int | tuple[int, int]:
    ok_int = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1  # noqa: E731
    if ok_int(value):
        return value
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(map(ok_int, value)) and value[0] <= value[1]:
        return (value[0], value[1]) if value[0] != value[1] else value[0]
    raise ConfigError(f"train.num_workers: expected an int >= 1 or [min, max] with 1 <= min <= max, got {value!r}")


@dataclass
class RegistrySection:
    tracking_uri: str | None = None  # null: $MLFLOW_TRACKING_URI, else MLflow's default (sqlite:///mlflow.db here)
    experiment: str | None = None  # null: the model name
    model_name: str | None = None  # null: dflash-<target slug>, the name serving looks up
    register: bool = True  # register the exported drafter as a new model version
    # extra model-version tags, e.g. {context: long}; merged over the derived ones (train.longalign
    # set -> context: long)
    tags: dict = option(factory=dict)


@dataclass
class TrainRecipe:
    """Everything a training run needs, from one recipe file."""

    features: FeaturesConfig
    drafter: DrafterSection
    train: TrainSection
    registry: RegistrySection
    source: str = ""  # the recipe file, for the record

    @property
    def target_slug(self) -> str:
        return target_slug(self.features.target.model)

    @property
    def model_name(self) -> str:
        return self.registry.model_name or f"dflash-{self.target_slug}"

    @property
    def feature_uris(self) -> list[str]:
        """The feature runs training reads, in order."""
        runs = self.train.features or self.features.output
        return [runs] if isinstance(runs, str) else list(runs)

    @property
    def features_uri(self) -> str:
        """The feature run(s) as one string (lineage, tags): comma-separated when several."""
        return ",".join(self.feature_uris)

    @property
    def version_tags(self) -> dict[str, str]:
        """Model-version tags the recipe asks for: ``context: long`` for a LongAlign run,
        then ``registry.tags`` over it."""
        derived = {"context": "long"} if self.train.longalign else {}
        return {str(k): str(v) for k, v in (derived | dict(self.registry.tags)).items()}

    def as_dict(self) -> dict:
        return {"features": dataclasses.asdict(self.features), "drafter": dataclasses.asdict(self.drafter),
                "train": dataclasses.asdict(self.train), "registry": dataclasses.asdict(self.registry)}

    def config_hash(self) -> str:
        """sha256 of what decides the trained weights (data, drafter, optimisation), not of
        where things are written or logged."""
        d = self.as_dict()
        skip = {"run_name", "storage_path", "storage_options", "export", "log_every", "max_failures",
                "num_workers", "cpus_per_worker", "threads_per_worker", "stream"}
        content = {"target": d["features"]["target"], "features_uri": self.features_uri, "drafter": d["drafter"],
                   "train": {k: v for k, v in d["train"].items() if k not in skip}}
        # settings added after recipes were hashed count only when set, so a recipe that does
        # not use them keeps the hash its registered drafters carry
        for section, key, default in LATER_SETTINGS:
            if content[section].get(key) == default:
                content[section].pop(key)
        return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()


#: (section, key, default) of settings added after recipes were first hashed
LATER_SETTINGS = (("drafter", "arch", "dflash"), ("drafter", "dflash2", {}), ("train", "streamed", False),
                  ("train", "selector_alpha", 1.0), ("train", "replay", {"features": None, "share": 0.3}))


def parse_recipe(data: dict, source: str = "") -> TrainRecipe:
    """Validate the training sections of a recipe mapping."""
    if "features" not in data:
        raise ConfigError("features: section missing (it names the target and its feature run)")
    if "train" not in data:
        raise ConfigError("train: section missing")
    return TrainRecipe(
        features=parse_section(FeaturesConfig, data["features"], "features"),
        drafter=parse_section(DrafterSection, data.get("drafter"), "drafter"),
        train=parse_section(TrainSection, data["train"], "train"),
        registry=parse_section(RegistrySection, data.get("registry"), "registry"),
        source=source,
    )


def load_train_recipe(path: str | Path, overrides: list[str] = ()) -> TrainRecipe:
    """Read a recipe file (with ``key=value`` overrides) into a :class:`TrainRecipe`."""
    data = apply_overrides(read_yaml(path), list(overrides))
    return parse_recipe(data, str(path))
