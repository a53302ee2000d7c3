"""Shared helpers for the serving tests (this module holds no tests): a tiny target
with the real SmolLM2 tokenizer, random drafters, an MLflow sqlite registry, SSE
parsing, and a Serve instance on a free loopback port."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch

from specdec.checkpoint import save_drafter
from specdec.drafter import DFlashDrafter, drafter_config_for_target
from specdec.engine import Engine, Request
from specdec.target import load_target
from specdec.tiny import save_tiny_target

BLOCK = 8


def tiny_target_dir(root: Path) -> Path:
    return save_tiny_target(root / "tiny-target", num_layers=6, hidden_size=64)


def make_drafter(target, out_dir: Path, seed: int = 0, identity: str | None = None, block_size: int = BLOCK) -> Path:
    """A random drafter for ``target``; ``identity`` overrides the recorded target identity."""
    torch.manual_seed(seed)
    cfg = drafter_config_for_target(target, block_size=block_size, num_hidden_layers=1)
    cfg.extra["target_identity"] = identity or target.identity
    return save_drafter(DFlashDrafter(cfg), out_dir)


def register_drafter(tracking_uri: str, name: str, drafter_dir: Path, alias: str | None = "champion") -> str:
    """Log a drafter directory as run artifacts, register it as a new version of ``name``
    and (optionally) point ``alias`` at it. Returns the version."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    client = mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    artifacts = Path(tracking_uri.removeprefix("sqlite:///")).parent / "artifacts"
    exp = client.get_experiment_by_name("drafters")
    exp_id = exp.experiment_id if exp else client.create_experiment("drafters", artifact_location=artifacts.as_uri())
    with mlflow.start_run(experiment_id=exp_id) as run:
        mlflow.log_artifacts(str(drafter_dir), artifact_path="drafter")
    try:
        client.get_registered_model(name)
    except mlflow.exceptions.MlflowException:
        client.create_registered_model(name)
    mv = client.create_model_version(name, source=f"{run.info.artifact_uri}/drafter", run_id=run.info.run_id)
    if alias:
        client.set_registered_model_alias(name, alias, mv.version)
    return str(mv.version)


@contextlib.contextmanager
def private_dir(prefix: str):
    """A temporary directory of our own. Not pytest's numbered ``tmp_path_factory`` dirs:
    other pytest runs on a shared machine prune those, and replicas read these files
    long after the fixture created them."""
    path = Path(tempfile.mkdtemp(prefix=f"dflash-{prefix}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def cache_with_embedded_target(cache: Path) -> Path:
    """A private ``DFLASH_CACHE`` (drafters downloaded there stay the test's own) holding the
    embedded target's converted copy, linked: each process that finds the cache without it
    converts the GGUF again, 25 s of CPU (replicas starting together each do)."""
    from specdec.target import resolve_target_path

    cache.mkdir(parents=True, exist_ok=True)
    (cache / "smollm2-135m-instruct").symlink_to(resolve_target_path(None))
    return cache


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ar_tokens(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target-only greedy continuation (no drafter), batch of one."""
    return Engine(target, None, seed=0).generate([Request(prompt, max_new_tokens=max_new_tokens)])[0].tokens


def load(path) -> object:
    return load_target(str(path))


def sse_events(response) -> list[dict | str]:
    """Parse an httpx streaming response into JSON payloads (and the final "[DONE]")."""
    out: list[dict | str] = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_for(predicate, timeout: float, interval: float = 0.25, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


#: Serve pushes autoscaling metrics every 0.5 s (the controller and replicas inherit these)
FAST_METRICS = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
                "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}

#: app settings under which the policy acts within seconds: 1 to 2 replicas, 1 ongoing
#: request per replica as the target, no API key
FAST_SCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0,
                "downscale_delay_s": 2, "look_back_period_s": 2, "metrics_interval_s": 0.5, "metrics_push_s": 0.5,
                "api_key_env": "DFLASH_TEST_NO_KEY"}


def replica_states(app: str, deployment: str) -> dict[str, int]:
    """``{state: count}`` of a deployment's replicas (states with none left out)."""
    from ray import serve

    states = serve.status().applications[app].deployments[deployment].replica_states
    return {str(getattr(k, "value", k)): v for k, v in states.items() if v}


def load_until(send, condition, clients: int, timeout: float, interval: float, what: str) -> tuple[list, float]:
    """Run ``clients`` threads calling ``send()`` (a response) in a loop until ``condition()``
    holds; returns the texts of non-200 responses and the seconds it took."""
    import threading

    stop, errors = threading.Event(), []

    def client():
        while not stop.is_set():
            r = send()
            if r.status_code != 200:
                errors.append(r.text)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    try:
        wait_for(condition, timeout, interval=interval, what=what)
        return errors, time.monotonic() - t0
    finally:
        stop.set()
        for t in threads:
            t.join(300)


def metric_value(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (Prometheus text)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == str(v) for k, v in labels.items()):
                total += sample.value
    return total


def restore_env(saved: dict[str, str | None]) -> None:
    """Put environment variables back as ``saved`` recorded them (None: was unset)."""
    import os

    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def ingress_fastapi_app(application):
    """The FastAPI app a built Serve application's ingress serves (Serve freezes a copy of
    it into the ingress class when the app is built): the routes a client can reach."""
    from fastapi import FastAPI

    init = application._bound_deployment.func_or_class.__dict__["__init__"]
    (app,) = [c.cell_contents for c in init.__closure__ or () if isinstance(c.cell_contents, FastAPI)]
    return app


def route_statuses(fastapi_app, url: str, headers: dict) -> dict[str, int]:
    """The status of one request to every route of ``fastapi_app`` served at ``url``
    (path parameters filled with 'x', POST bodies '{}'), keyed by 'METHOD path'."""
    import re

    import httpx

    out = {}
    for route in fastapi_app.routes:
        for method in sorted(set(getattr(route, "methods", None) or ()) - {"HEAD", "OPTIONS"}):
            path = re.sub(r"\{[^}]*\}", "x", route.path)
            r = httpx.request(method, url + path, headers=headers, timeout=120,
                              json={} if method == "POST" else None)
            out[f"{method} {route.path}"] = r.status_code
    return out
