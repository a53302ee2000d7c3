"""Ray Serve application serving a target with its DFlash drafter behind an OpenAI API.

    serve run serve_app:app                                  # embedded SmolLM2, defaults
    serve run serve_app:build_app drafter=/path/to/drafter max_replicas=4 speculation=auto
    serve deploy serve_app/config.yaml                       # every setting in one file

``build_app(args)`` is the app builder: ``args`` are the fields of
``serve_app.config.ServeConfig``. The ``hf`` backend composes three deployments:

    OpenAIIngress (FastAPI) --stream--> DFlashReplica x N (target + drafter, autoscaled)
            \\                                /
             `------- MetricsHub <-----------'   (replicas publish, /metrics renders)

The ``vllm`` backend returns Ray Serve LLM's OpenAI app with DFlash speculative decoding
(``serve_app/vllm_app.py``).
"""

from __future__ import annotations

from serve_app.config import ServeConfig, load_config

__all__ = ["app", "build_app", "ServeConfig"]


def build_app(args: dict | None = None):
    """App builder for ``serve run serve_app:build_app key=value ...`` and config.yaml."""
    cfg = load_config(args)
    if cfg.speculation_requested:
        from serve_app.registry import pin_tracking_uri

        cfg = pin_tracking_uri(cfg)  # every replica and engine node reads the driver's registry
    if cfg.backend == "vllm":
        from serve_app.vllm_app import build_vllm_app

        return build_vllm_app(cfg)

    from serve_app.autoscaling import autoscaling_config_dict
    from serve_app.ingress import OpenAIIngress
    from serve_app.metrics import MetricsHub
    from serve_app.replica import DFlashReplica
    from serve_app.resources import check_app_fits

    settings = cfg.model_dump()
    actor_options = {"num_cpus": cfg.replica_cpus}
    if cfg.replica_resources:
        actor_options["resources"] = dict(cfg.replica_resources)
    if cfg.replica_gpus:
        actor_options["num_gpus"] = cfg.replica_gpus
    hub = MetricsHub.bind(ttl_s=max(15.0, 5 * cfg.metrics_push_s))
    replica = DFlashReplica.options(
        autoscaling_config=autoscaling_config_dict(cfg),
        max_ongoing_requests=cfg.replica_max_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests,
        ray_actor_options=actor_options,
    ).bind(settings, hub)
    app = OpenAIIngress.options(num_replicas=cfg.ingress_replicas).bind(replica, hub, settings)
    check_app_fits(app, "replica_cpus / replica_gpus, min_replicas or replica_resources, or give the cluster "
                   "more CPUs/GPUs")
    return app


def __getattr__(name: str):
    """``serve_app.app`` (what ``serve run serve_app:app`` imports): the embedded default
    with default settings, built on first access so that importing a submodule (in a
    replica, or the autoscaling policy in the controller) does not build an app."""
    if name == "app":
        globals()["app"] = built = build_app({})
        return built
    raise AttributeError(f"module 'serve_app' has no attribute {name!r}")
