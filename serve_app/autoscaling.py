"""Replica autoscaling from measured acceptance and concurrency.

Every replica publishes, through ``record_autoscaling_stats()``:

* ``ongoing``      -- requests in its engine batch or waiting for a slot,
* ``tau``          -- mean tokens committed per request per engine cycle (1.0 when
                      speculation is off or the replica is idle),
* ``tokens_per_s`` -- tokens it sent to clients per second.

Serve averages each over ``look_back_period_s`` and calls the policy with them. The
policy (documented in docs/serving.md):

    load     = max(total requests Serve counts for the deployment, sum_i ongoing_i)
    tau_bar  = sum_i tau_i * tps_i / sum_i tps_i      (mean tau if nobody is emitting)
    capacity = target_ongoing_requests * min(max(tau_bar, 1), tau_cap) ** tau_exponent
    replicas = ceil(load / capacity)

A replica whose drafter commits tau tokens per cycle finishes each request in ~1/tau of
the cycles, so it carries more concurrent requests at the same per-request latency; the
exponent (default 0.5) discounts that credit for the verify pass growing with the block.
At high concurrency the replicas' adaptive controllers turn speculation off, tau drops
to 1 and the policy falls back to plain concurrency targeting. Serve then applies
min/max replicas, ``upscale_delay_s``/``downscale_delay_s`` and the scaling factors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

POLICY_PATH = "serve_app.autoscaling:AcceptanceAwarePolicy"
METRIC_ONGOING, METRIC_TAU, METRIC_TPS = "ongoing", "tau", "tokens_per_s"


@dataclass(frozen=True)
class ReplicaLoad:
    ongoing: float = 0.0
    tau: float = 1.0
    tokens_per_s: float = 0.0


def fleet_tau(replicas: list[ReplicaLoad]) -> float:
    """Throughput-weighted mean tau (plain mean if no replica emits, 1.0 if none reports)."""
    if not replicas:
        return 1.0
    weight = sum(max(r.tokens_per_s, 0.0) for r in replicas)
    if weight > 0:
        return sum(r.tau * max(r.tokens_per_s, 0.0) for r in replicas) / weight
    return sum(r.tau for r in replicas) / len(replicas)


def desired_replicas(load: float, replicas: list[ReplicaLoad], target_ongoing_requests: float,
                     tau_exponent: float = 0.5, tau_cap: float = 4.0) -> tuple[int, dict]:
    """The replica count the formula asks for (before Serve's bounds and delays)."""
    load = max(load, sum(r.ongoing for r in replicas), 0.0)
    tau = fleet_tau(replicas)
    capacity = target_ongoing_requests * min(max(tau, 1.0), tau_cap) ** tau_exponent
    n = math.ceil(load / capacity - 1e-9) if load > 0 else 0
    return n, {"load": load, "tau": tau, "capacity_per_replica": capacity, "desired": n}


class AcceptanceAwarePolicy:
    """Deployment-level Serve autoscaling policy (``AutoscalingPolicy(policy_function=
    POLICY_PATH, policy_kwargs={...})``); Serve instantiates it once and calls it every
    control-loop tick with an ``AutoscalingContext``."""

    def __init__(self, tau_exponent: float = 0.5, tau_cap: float = 4.0):
        self.tau_exponent = tau_exponent
        self.tau_cap = tau_cap

    def __call__(self, ctx) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics or {}
        replicas = [
            ReplicaLoad(ongoing=float(metrics.get(METRIC_ONGOING, {}).get(rid, 0.0)),
                        tau=float(metrics.get(METRIC_TAU, {}).get(rid, 1.0)),
                        tokens_per_s=float(metrics.get(METRIC_TPS, {}).get(rid, 0.0)))
            for rid in ctx.running_replicas
        ]
        target = ctx.config.get_target_ongoing_requests() if ctx.config is not None else 2.0
        n, info = desired_replicas(float(ctx.total_num_requests or 0.0), replicas, target,
                                   self.tau_exponent, self.tau_cap)
        return n, info


def autoscaling_config_dict(cfg) -> dict:
    """``autoscaling_config`` for the paired-replica deployment (a ServeConfig in)."""
    out = {
        "min_replicas": cfg.min_replicas,
        "max_replicas": cfg.max_replicas,
        "target_ongoing_requests": cfg.target_ongoing_requests,
        "upscale_delay_s": cfg.upscale_delay_s,
        "downscale_delay_s": cfg.downscale_delay_s,
        "look_back_period_s": cfg.look_back_period_s,
        "policy": {"policy_function": POLICY_PATH,
                   "policy_kwargs": {"tau_exponent": cfg.tau_exponent, "tau_cap": cfg.tau_cap}},
    }
    if cfg.initial_replicas is not None:
        out["initial_replicas"] = cfg.initial_replicas
    if cfg.metrics_interval_s is not None:
        out["metrics_interval_s"] = cfg.metrics_interval_s
    return out
