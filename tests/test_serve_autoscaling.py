"""Autoscaling from measured acceptance and concurrency.

The policy is a pure function of an ``AutoscalingContext``: checked on synthetic
contexts. Then for real: a short load raises the replica count of a Serve app (tiny
target, max 2 replicas, short delays) and idling lowers it again.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest
import ray
from ray import serve
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from serve_app.autoscaling import (POLICY_PATH, AcceptanceAwarePolicy, ReplicaLoad, autoscaling_config_dict,
                                   desired_replicas)
from serve_app.config import load_config
from serve_helpers import (FAST_METRICS, FAST_SCALING, free_port, load, load_until, make_drafter, private_dir,
                           replica_states, restore_env, tiny_target_dir, wait_for)

DEP = DeploymentID(name="DFlashReplica", app_name="dflash")


def context(total: float, per_replica: list[dict], target_ongoing: float = 8.0, current: int | None = None):
    ids = [ReplicaID(unique_id=f"r{i}", deployment_id=DEP) for i in range(len(per_replica))]
    metrics: dict = {}
    for rid, m in zip(ids, per_replica):
        for key, value in m.items():
            metrics.setdefault(key, {})[rid] = value
    n = len(ids) if current is None else current
    return AutoscalingContext(
        deployment_id=DEP, deployment_name=DEP.name, app_name=DEP.app_name, current_num_replicas=n,
        target_num_replicas=n, running_replicas=ids, total_num_requests=total, total_queued_requests=0.0,
        aggregated_metrics=metrics, raw_metrics={}, capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=16, policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=time.time(), config=AutoscalingConfig(min_replicas=1, max_replicas=16,
                                                           target_ongoing_requests=target_ongoing))


@pytest.mark.parametrize("total,replicas,expected", [
    (0, [{"ongoing": 0, "tau": 1.0, "tokens_per_s": 0}], 0),  # idle: down to min_replicas
    (8, [{"ongoing": 8, "tau": 1.0, "tokens_per_s": 50}], 1),  # exactly at target
    (16, [{"ongoing": 16, "tau": 1.0, "tokens_per_s": 90}], 2),  # AR at 2x target
    (16, [{"ongoing": 16, "tau": 4.0, "tokens_per_s": 90}], 1),  # tau 4: capacity 8 * 4 ** 0.5 = 16
    (40, [{"ongoing": 20, "tau": 2.25, "tokens_per_s": 100}, {"ongoing": 20, "tau": 2.25, "tokens_per_s": 100}],
     4),  # capacity 8 * 1.5 = 12 -> ceil(40 / 12)
    (24, [{"ongoing": 12, "tau": 4.0, "tokens_per_s": 100}, {"ongoing": 12, "tau": 1.0, "tokens_per_s": 0}], 2),
    # an idle replica's stale tau carries no weight (tau_bar = 4 -> capacity 16)
    (30, [{"ongoing": 2, "tau": 1.0, "tokens_per_s": 20}], 4),  # requests queued at handles count as load
    (12, [{}, {}], 2),  # no custom metrics yet (fresh replicas, vLLM backend): tau = 1
    (9, [{"ongoing": 9, "tau": 100.0, "tokens_per_s": 10}], 1),  # tau capped at 4 -> capacity 16
])
def test_policy_on_synthetic_contexts(total, replicas, expected):
    n, state = AcceptanceAwarePolicy(tau_exponent=0.5, tau_cap=4.0)(context(total, replicas))
    assert n == expected, state
    assert state["desired"] == expected and state["capacity_per_replica"] >= 8.0


def test_policy_formula_and_config_wiring():
    assert desired_replicas(10, [ReplicaLoad(5, 1.0, 1.0)], 2.0, tau_exponent=0.0) == (5, pytest.approx(
        {"load": 10, "tau": 1.0, "capacity_per_replica": 2.0, "desired": 5}))
    assert desired_replicas(10, [ReplicaLoad(5, 9.0, 1.0)], 2.0, tau_exponent=1.0, tau_cap=9.0)[0] == 1
    cfg = load_config({"max_replicas": 6, "tau_exponent": 0.7, "target_ongoing_requests": 3})
    auto = AutoscalingConfig(**autoscaling_config_dict(cfg))  # what Serve builds from our options
    assert auto.policy.policy_function == POLICY_PATH and auto.max_replicas == 6
    policy_cls = auto.policy.get_policy()
    policy = policy_cls(**auto.policy.policy_kwargs)  # Serve instantiates class policies once, with kwargs
    assert policy.tau_exponent == 0.7
    n, _ = policy(context(7, [{"ongoing": 7, "tau": 1.0, "tokens_per_s": 1}], target_ongoing=3))
    assert n == 3


# ---------------------------------------------------------------------- real scaling
APP = "autoscale"


@pytest.fixture(scope="module")
def scaling_app():
    with private_dir("serve-autoscale") as root:
        yield from _scaling_app(root)


def _scaling_app(root):
    target_dir = tiny_target_dir(root)
    drafter_dir = make_drafter(load(target_dir), root / "drafter")
    saved = {k: os.environ.get(k) for k in FAST_METRICS}
    os.environ.update(FAST_METRICS)  # the controller and replicas inherit these
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    from serve_app import build_app

    serve.run(build_app({"target": str(target_dir), "model_name": "tiny", "drafter": str(drafter_dir),
                         "max_batch_size": 4, "max_tokens_limit": 400, **FAST_SCALING}), name=APP, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        restore_env(saved)


def _replicas() -> dict:
    return replica_states(APP, "DFlashReplica")


def test_short_load_scales_up_and_idle_scales_down(scaling_app):
    assert _replicas() == {"RUNNING": 1}
    with httpx.Client(base_url=scaling_app, timeout=120) as c:
        errors, up_s = load_until(
            lambda: c.post("/v1/completions", json={"prompt": "load", "max_tokens": 200, "temperature": 0}),
            lambda: _replicas().get("RUNNING", 0) == 2, clients=4, timeout=75, interval=0.5, what="a second replica")
    assert not errors, errors[:2]
    t1 = time.monotonic()
    wait_for(lambda: _replicas() == {"RUNNING": 1}, 60, interval=0.5, what="scale down to one replica")
    down_s = time.monotonic() - t1
    print(f"scaled up in {up_s:.1f}s under load, down in {down_s:.1f}s when idle")
    assert httpx.get(scaling_app + "/health", timeout=30).status_code == 200
