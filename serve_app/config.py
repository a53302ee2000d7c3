"""The application's settings: one validated model shared by ``build_app`` (app-builder
arguments, ``serve_app/config.yaml``) and every deployment. Defaults fit a 2-core
machine serving the embedded SmolLM2 target; raise the limits on a cluster."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specdec.assets import target_slug


class CaptureSettings(BaseModel):
    """``ServeConfig.capture``: where captured requests go and how many."""
    model_config = ConfigDict(extra="forbid")

    uri: str = Field(description="a directory or s3:// prefix the capture files are written under")
    rate: float = Field(1.0, gt=0, le=1, description="share of requests captured (by a hash of the request id)")
    max_buffer: int = Field(1024, ge=1, description="records waiting to be written; past it new ones are dropped")
    batch_rows: int = Field(256, ge=1, description="records per file (a file is written at this many)")
    flush_s: float = Field(30.0, gt=0, description="a waiting record is written within this many seconds")

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("expected a directory or an s3:// prefix, got an empty string")
        return v.strip()


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # ---------------------------------------------------------------- what is served
    target: str | None = Field(None, description="Target model: the embedded default (None/'smollm2'), "
                               "a local HF directory, a .gguf file or a hub id already cached")
    model_name: str | None = Field(None, description="Name clients pass as 'model' (default: from target)")
    drafter: str | None = Field("auto", description="'auto' (models:/dflash-<model_name>@champion if "
                                "registered, else the packaged reference drafter of an embedded target, else "
                                "speculation off), a drafter directory, models:/<name>@<alias> or "
                                "models:/<name>/<version>, or 'none'")
    tracking_uri: str | None = Field(None, description="MLflow tracking/registry URI (default: MLflow's own)")
    registry_poll_s: float = Field(30.0, ge=0, description="How often replicas re-resolve a registry "
                                   "alias and swap to a moved drafter (0 = never)")
    backend: Literal["hf", "vllm"] = "hf"
    dtype: str = "float32"
    device: str = "cpu"
    seed: int | None = None

    # ---------------------------------------------------------------- speculation
    speculation: int | Literal["auto", "off"] = Field(
        "auto", description="The serving mode. 'auto': each replica picks the block to verify (1 = off) from "
        "measured acceptance and concurrency; N (an int >= 2): always verify blocks of N tokens (at most the "
        "drafter's B); 'off': plain AR decoding")
    lookup_block: int = Field(8, ge=0, description="Prompt lookup beside the drafter: where a row's context "
                              "repeats its last 2-4 tokens, the block is the continuation found there, up to "
                              "lookup_block tokens (the drafter drafts its own B elsewhere); 0 or 1: the drafter "
                              "alone. Exact like any draft; with speculation 'auto' the controller still decides "
                              "whether to speculate at all")

    # ---------------------------------------------------------------- limits
    max_batch_size: int = Field(16, ge=1, description="Rows a replica's engine decodes together")
    max_prefill_tokens: int = Field(1024, ge=1, description="Padded prompt tokens (rows x longest prompt) "
                                    "prefilled per engine turn (at least one request): bounds the stall a burst "
                                    "of prompts causes and keeps short prompts out of long ones' padding")
    max_ongoing_requests: int | None = Field(None, ge=1, description="Per replica, running + waiting "
                                             "(default: 2 x max_batch_size)")
    max_queued_requests: int = Field(256, description="Requests Serve queues before answering 503 (-1: no limit)")
    max_tokens_limit: int = Field(1024, ge=1, description="Largest max_tokens a request may ask for")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none")
    request_timeout_s: float = Field(300.0, gt=0, description="Ingress gives up waiting for a replica")

    # ---------------------------------------------------------------- replicas
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    initial_replicas: int | None = None
    target_ongoing_requests: float = Field(8.0, gt=0, description="Requests per replica at tau = 1")
    tau_exponent: float = Field(0.5, ge=0, description="Capacity credit for speculation: capacity = "
                                "target_ongoing_requests * tau ** tau_exponent")
    tau_cap: float = Field(4.0, ge=1)
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    look_back_period_s: float = Field(15.0, gt=0)
    metrics_interval_s: float | None = Field(None, gt=0, description="How often replicas push autoscaling "
                                             "stats to the controller (Serve's default: 10 s)")
    replica_cpus: float = Field(1.0, ge=0)
    replica_gpus: float = Field(0.0, ge=0)
    replica_resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources "
                                                "each engine replica needs (pins replicas to labelled nodes)")
    torch_threads: int | None = Field(None, ge=1, description="Default: the replica's CPUs (at least 1)")
    ingress_replicas: int = Field(1, ge=1)

    # ---------------------------------------------------------------- API and telemetry
    api_key_env: str = Field("DFLASH_API_KEY", description="Env var holding the bearer key; unset or "
                             "empty = no authentication")
    metrics_push_s: float = Field(1.0, gt=0, description="How often replicas publish their metrics")

    # ---------------------------------------------------------------- vLLM backend (serve_app/vllm_app.py)
    accelerator_type: str | None = None
    tensor_parallel_size: int = Field(1, ge=1)
    vllm_engine_kwargs: dict = Field(default_factory=dict, description="Extra vLLM engine arguments")
    vllm_plain_pool: bool = Field(False, description="With a drafter: a second engine pool of the target "
                                  "without speculation; the ingress sends a request there while "
                                  "speculative_max_inflight requests are already speculating (speculation off "
                                  "under load; serve_app/vllm_routing.py)")
    vllm_rollout_surge: bool = Field(True, description="A hot swap (a moved registry alias) starts each new "
                                     "engine replica before an old one stops, so requests never wait for an "
                                     "engine (the cluster needs room for one more engine replica); False: stop "
                                     "first, requests wait in Serve's queue meanwhile")
    speculative_max_inflight: int = Field(4, ge=0, description="vllm_plain_pool: requests an ingress replica "
                                          "sends to the speculative pool at once; the rest decode plain")
    plain_min_replicas: int | None = Field(None, ge=0, description="vllm_plain_pool: the plain pool's replica "
                                           "bounds (default: min_replicas / max_replicas). Past the bound "
                                           "every further request decodes plain, so under load it is the plain "
                                           "pool that needs room to grow")
    plain_max_replicas: int | None = Field(None, ge=1)

    # ---------------------------------------------------------------- traffic capture (serve_app/capture.py)
    capture: CaptureSettings | None = Field(None, description="Capture served requests (the prompt's and "
                                            "the answer's token ids, sampling, accepted lengths) as Parquet "
                                            "under capture.uri, for adapting the drafter to the traffic; off "
                                            "by default. A request with \"store\": false is never captured")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        # block_size now only names a drafter's B; the serving mode has its own key
        if isinstance(data, dict) and "block_size" in data:
            raise ValueError("block_size was renamed to speculation (auto|off|N), the serving mode; block_size "
                             "now only means a drafter's B")
        return data

    @field_validator("speculation", mode="before")
    @classmethod
    def _speculation(cls, v):
        """The one check of the serving mode: 'auto', 'off' or N >= 2 (CLI strings
        coerced; 'none', 0 and 1 mean off)."""
        if isinstance(v, str) and v.strip().lower() in ("auto", "off", "none", "0", "1"):
            return "auto" if v.strip().lower() == "auto" else "off"
        if isinstance(v, str):
            try:
                v = int(v)
            except ValueError:
                raise ValueError(f"speculation must be 'auto', 'off' or an integer >= 2, got {v!r}") from None
        if isinstance(v, int) and not isinstance(v, bool):
            return "off" if v <= 1 else v
        raise ValueError(f"speculation must be 'auto', 'off' or an integer >= 2, got {v!r}")

    @field_validator("replica_resources", "vllm_engine_kwargs", "capture", mode="before")
    @classmethod
    def _json_object(cls, v):
        """`serve run ... key=value` passes strings: a dict setting may be given as JSON."""
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"expected a JSON object, got {v!r} ({e.msg})") from None
        return v

    @field_validator("drafter", mode="before")
    @classmethod
    def _drafter(cls, v):
        if v is None or (isinstance(v, str) and v.strip().lower() in ("none", "off", "")):
            return None
        return str(v).strip()

    @model_validator(mode="after")
    def _check(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        lo, hi = self.plain_replicas
        if lo > hi:
            raise ValueError(f"plain_min_replicas ({lo}) > plain_max_replicas ({hi})")
        if self.default_max_tokens > self.max_tokens_limit:
            self.default_max_tokens = self.max_tokens_limit
        return self

    # ---------------------------------------------------------------- derived
    @property
    def plain_replicas(self) -> tuple[int, int]:
        """(min, max) replicas of the vllm backend's plain pool."""
        lo = self.min_replicas if self.plain_min_replicas is None else self.plain_min_replicas
        return lo, self.max_replicas if self.plain_max_replicas is None else self.plain_max_replicas

    @property
    def served_model_name(self) -> str:
        # the training job registers dflash-<slug>: the same slug names the served model
        return self.model_name or target_slug(self.target)

    @property
    def drafter_source(self) -> str | None:
        """Where the drafter comes from, with 'auto' spelled out."""
        if self.drafter == "auto":
            return f"models:/dflash-{self.served_model_name}@champion"
        return self.drafter

    @property
    def reference_drafter(self) -> str | None:
        """With drafter 'auto' and an embedded target: the packaged reference drafter
        (``serve_app.registry.choose_drafter`` serves it until the registry has a champion)."""
        from specdec.assets import reference_drafter_for

        path = reference_drafter_for(self.target) if self.drafter == "auto" else None
        return str(path) if path is not None else None

    @property
    def speculation_requested(self) -> bool:
        return self.speculation != "off" and self.drafter is not None

    @property
    def replica_max_ongoing_requests(self) -> int:
        return self.max_ongoing_requests or 2 * self.max_batch_size

    @property
    def replica_torch_threads(self) -> int:
        return self.torch_threads or max(1, int(round(self.replica_cpus)))


def load_config(args: dict | ServeConfig | None) -> ServeConfig:
    """Validate app-builder arguments (strings from the CLI are coerced)."""
    if isinstance(args, ServeConfig):
        return args
    return ServeConfig.model_validate(dict(args or {}))
