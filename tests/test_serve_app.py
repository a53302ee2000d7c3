"""Real HTTP against the app started by Ray Serve on loopback, with a tiny target and a
random drafter served from an MLflow (sqlite) registry alias.

Covers: chat and completions, streaming and not; 8 concurrent greedy requests each
equal to the target-only output (and sharing verify passes); every bad input -> 4xx
OpenAI error while the server stays healthy; bearer API key; client disconnect cancels
the generation and frees its slot; an alias move swaps the drafter without failing an
in-flight request; a crashed replica gives a clean error and is replaced; a drafter
trained for another target is refused with a clear error; served traffic is captured
(serve_app/capture.py) unless a request says "store": false.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray
from ray import serve

from serve_helpers import (ar_tokens, free_port, ingress_fastapi_app, load, make_drafter, metric_value, private_dir,
                           register_drafter, restore_env, route_statuses, sse_events, tiny_target_dir, wait_for)

API_KEY = "test-key-123"
MODEL = "tiny"
REGISTERED = "dflash-tiny"
LIMIT = 1500
APP = "dflash"


class Server:
    def __init__(self, url, target, tracking_uri, root):
        self.url = url
        self.target = target
        self.tracking_uri = tracking_uri
        self.root = root
        self.client = httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"})

    def chat(self, content: str, max_tokens: int, **kw):
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                "temperature": 0, **kw}
        return self.client.post("/v1/chat/completions", json=body)

    def reference_chat(self, content: str, max_tokens: int) -> str:
        ids = self.target.encode_chat([{"role": "user", "content": content}])
        return self.target.decode(ar_tokens(self.target, ids, max_tokens))

    def metrics(self) -> str:
        return self.client.get("/metrics").text

    def models(self) -> dict:
        return self.client.get("/v1/models").json()["data"][0]


@pytest.fixture(scope="module")
def server():
    with private_dir("serve-app") as root:
        yield from _serve(root)


def _serve(root):
    import torch

    torch.set_num_threads(1)  # the replica decodes with 1 thread; same reductions for the reference
    target_dir = tiny_target_dir(root)
    target = load(target_dir)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    register_drafter(uri, REGISTERED, make_drafter(target, root / "drafter-v1", seed=1))
    saved = {k: os.environ.get(k) for k in ("DFLASH_API_KEY", "DFLASH_CACHE")}
    os.environ["DFLASH_API_KEY"] = API_KEY  # replicas inherit the driver's environment
    os.environ["DFLASH_CACHE"] = str(root / "cache")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    from serve_app import build_app

    serve.run(build_app({
        "target": str(target_dir), "model_name": MODEL, "drafter": f"models:/{REGISTERED}@champion",
        "tracking_uri": uri, "registry_poll_s": 1, "min_replicas": 1, "max_replicas": 1, "max_batch_size": 8,
        "max_tokens_limit": LIMIT, "default_max_tokens": 16, "metrics_push_s": 0.3, "seed": 0,
        "request_timeout_s": 60, "capture": {"uri": str(root / "captured"), "flush_s": 0.3},
    }), name=APP, route_prefix="/")
    srv = Server(f"http://127.0.0.1:{port}", target, uri, root)
    try:
        yield srv
    finally:
        srv.client.close()
        serve.shutdown()
        ray.shutdown()
        restore_env(saved)


# ---------------------------------------------------------------------- happy paths
def test_health_models_and_metrics(server):
    health = server.client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    card = server.models()
    assert card["id"] == MODEL and card["drafter"]["version"] == "1" and card["drafter"]["block_size"] == 8
    def published():
        text = server.metrics()
        return text if "dflash_queue_depth{" in text else None
    text = wait_for(published, 30, what="replica metrics")
    assert metric_value(text, "dflash_replicas") == 1


def test_chat_non_streaming_equals_target_output(server):
    r = server.chat("Tell me about Ray Serve.", 24)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert choice["message"]["content"] == server.reference_chat("Tell me about Ray Serve.", 24)
    use = body["usage"]
    assert use["completion_tokens"] == 24 and use["total_tokens"] == use["prompt_tokens"] + 24
    spec = use["speculative"]  # the request's accepted-length statistics
    assert spec["cycles"] >= 1 and spec["mean_accepted_length"] >= 1.0 and spec["max_block_size"] == 8
    assert sum(spec["accepted_length_histogram"].values()) == spec["cycles"]


def test_served_traffic_is_captured_unless_store_is_false(server):
    """Each finished request's prompt (token ids after the chat template), the target's answer
    (exact: the target-only greedy tokens), sampling, finish reason, drafter version and accepted
    lengths reach Parquet under capture.uri within flush_s; "store": false keeps a request out;
    /metrics counts the captured records."""
    import pyarrow.parquet as pq

    from serve_app.metrics import scrape_totals

    asks = [("capture: kept", {}), ("capture: not stored", {"store": False}), ("capture: kept too", {"store": True})]
    ids = []
    for content, extra in asks:
        r = server.chat(content, 12, **extra)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])

    def captured() -> dict:
        files = sorted((server.root / "captured").glob("date=*/*.parquet"))
        return {r["request_id"]: r for f in files for r in pq.read_table(f).to_pylist()}

    # written in the order offered: once the last is on disk, the not-stored one would be too
    rows = wait_for(lambda: (c := captured()).get(ids[2]) and c, 60, what="the captured requests")
    assert ids[1] not in rows and ids[0] in rows
    rec = rows[ids[0]]
    prompt = server.target.encode_chat([{"role": "user", "content": "capture: kept"}])
    assert rec["prompt_ids"] == prompt and rec["answer_ids"] == ar_tokens(server.target, prompt, 12)
    assert rec["model"] == MODEL and rec["drafter_source"] == f"models:/{REGISTERED}@champion"
    assert rec["drafter_version"] and rec["finish_reason"] == "length" and rec["max_tokens"] == 12
    assert rec["temperature"] == 0 and rec["accepted"] and min(rec["accepted"]) >= 0
    assert sum(a + 1 for a in rec["accepted"]) <= len(rec["answer_ids"])  # a cycle commits A + 1 tokens
    totals = wait_for(lambda: (t := scrape_totals(server.metrics()))["capture_records_total"].get("captured", 0) >= 2
                      and t, 30, what="capture counts in /metrics")
    assert totals["capture_bytes_total"] > 0 and totals["capture_errors_total"] == 0


def test_chat_streaming_matches_non_streaming(server):
    with server.client.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Stream please"}], "max_tokens": 20,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == server.reference_chat("Stream please", 20)
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finals] == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20


def test_completions_streaming_and_not(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    want = server.target.decode(ar_tokens(server.target, server.target.encode("Once upon a time"), 12))
    plain = server.client.post("/v1/completions", json=body)
    assert plain.status_code == 200, plain.text
    assert plain.json()["object"] == "text_completion" and plain.json()["choices"][0]["text"] == want
    with server.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
    ids = server.target.encode("Once upon a time")
    by_ids = server.client.post("/v1/completions", json={**body, "prompt": ids})
    assert by_ids.json()["choices"][0]["text"] == want


def test_eight_concurrent_requests_are_batched_and_exact(server):
    prompts = [f"Question {i}: " + "why? " * (i + 1) for i in range(8)]
    want = [server.reference_chat(p, 32) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda p: server.chat(p, 32), prompts))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    got = [r.json()["choices"][0]["message"]["content"] for r in responses]
    assert got == want
    rows = [r.json()["usage"]["speculative"]["max_batch_rows"] for r in responses]
    assert max(rows) >= 2, rows  # they shared verify passes


def test_loadtest_drives_the_endpoint_and_reports_every_level(server):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "jobs" / "loadtest.py"
    spec = importlib.util.spec_from_file_location("loadtest_job", path)
    loadtest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loadtest)

    prompts = server.root / "lt-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about item number {i}."}) + "\n" for i in range(6)))
    out = server.root / "loadtest"
    assert loadtest.main(["--url", server.url, "--ar-url", server.url, "--concurrency", "1,2", "--requests", "3",
                          "--max-tokens", "6", "--prompts", str(prompts), "--model", MODEL, "--api-key", API_KEY,
                          "--out", str(out)]) == 0
    report = json.loads((out / "loadtest.json").read_text())
    for mode in ("spec", "ar"):
        rows = report["results"][mode]
        assert [r["concurrency"] for r in rows] == [1, 2]
        for r in rows:
            assert r["requests"] == 3 and r["errors"] == 0, r
            assert r["completion_tokens"] == 18 and r["tokens_per_s"] > 0  # 6 tokens each: no EOS here
            assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
            assert r["replica_cpu_s_per_token"] is not None and r["replica_cpu_s_per_token"] > 0
    assert set(report["speedup"]) == {"1", "2"}
    assert (out / "loadtest.png").stat().st_size > 0


def test_sampling_and_stop_strings(server):
    r = server.chat("Sample something", 16, temperature=0.8, top_p=0.9, top_k=50)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    ref = server.reference_chat("Stop early please", 24)
    stop = ref[10:14]
    r = server.chat("Stop early please", 24, stop=[stop])
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == ref[: ref.find(stop)] and choice["finish_reason"] == "stop"


# ---------------------------------------------------------------------- bad input
LONG = "hello " * 2100  # > the tiny target's 2048-token context

BAD = [
    ("invalid json", "/v1/chat/completions", b"{not json", 400, None),
    ("body not an object", "/v1/chat/completions", [1, 2], 400, None),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("messages wrong type", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("content wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": {"a": 1}}]}, 400,
     "messages[0].content"),
    ("max_tokens wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": "many"}, 400, "max_tokens"),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]},
     404, "model"),
    ("max_tokens zero", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     400, "max_tokens"),
    ("max_tokens negative", "/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("max_tokens above limit", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                        "max_tokens": LIMIT + 1}, 400, "max_tokens"),
    ("prompt longer than context", "/v1/completions", {"prompt": LONG, "max_tokens": 4}, 400, "prompt"),
    ("chat longer than context", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400,
     "messages"),
    ("negative temperature", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                      "temperature": -1}, 400, "temperature"),
    ("top_p zero", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400,
     "top_p"),
    ("top_p above one", "/v1/completions", {"prompt": "x", "top_p": 1.01}, 400, "top_p"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("prompt wrong type", "/v1/completions", {"prompt": {"text": "x"}}, 400, "prompt"),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gives_openai_error_and_server_stays_healthy(server, name, path, body, status, param):
    if isinstance(body, bytes):
        r = server.client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = server.client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]
    assert server.client.get("/health").json()["status"] == "ok"


def test_api_key_guards_every_route(server):
    """Every route of the built app (FastAPI's docs included) answers 401 without the right
    key and something else with it."""
    from serve_app import build_app

    app = ingress_fastapi_app(build_app({"drafter": "none"}))
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert set(route_statuses(app, server.url, headers).values()) == {401}
    keyed = route_statuses(app, server.url, {"Authorization": f"Bearer {API_KEY}"})
    assert {"GET /health", "GET /metrics", "GET /v1/models", "GET /openapi.json"} <= set(keyed)
    assert all(s != 401 and s < 500 for s in keyed.values()), keyed


# ---------------------------------------------------------------------- faults
def _cancelled(server) -> float:
    return metric_value(server.metrics(), "dflash_requests_total", finish_reason="cancelled")


def test_client_disconnect_cancels_generation_and_frees_the_slot(server):
    before = _cancelled(server)
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "a long story", "max_tokens": LIMIT,
                                                       "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data: ")
                if n >= 3:
                    break
    # the connection is closed here, long before 1500 tokens
    wait_for(lambda: _cancelled(server) >= before + 1, 30, what="a cancelled request in /metrics")

    def idle():
        text = server.metrics()
        return metric_value(text, "dflash_active_requests") == 0 and metric_value(text, "dflash_queue_depth") == 0
    wait_for(idle, 30, what="the batch slot to be freed")


def test_alias_move_swaps_drafter_without_failing_in_flight_requests(server):
    prompt = "Keep going while the drafter changes"
    want = server.reference_chat(prompt, LIMIT)
    result = {}

    def long_request():
        result["r"] = server.chat(prompt, LIMIT)

    t = threading.Thread(target=long_request)
    t.start()
    wait_for(lambda: metric_value(server.metrics(), "dflash_active_requests") >= 1, 30, interval=0.1,
             what="the long request to start")
    v2 = register_drafter(server.tracking_uri, REGISTERED, make_drafter(server.target, server.root / "drafter-v2",
                                                                        seed=2))
    card = wait_for(lambda: (m := server.models())["drafter"]["version"] == v2 and m, 30,
                    what="the replica to swap drafters")
    assert t.is_alive(), "the long request finished before the swap; make it longer"
    assert card["drafter"]["generations"] == 2  # the live row finishes on drafter 1, new rows use drafter 2
    t.join(120)
    r = result["r"]
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
    after = server.chat("after the swap", 8)
    assert after.status_code == 200
    assert after.json()["choices"][0]["message"]["content"] == server.reference_chat("after the swap", 8)
    assert server.models()["drafter_error"] is None


def _replica_actor_names() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if "DFlashReplica" in a["name"] and a["name"].startswith("SERVE_REPLICA")]


def test_replica_crash_gives_clean_error_and_is_replaced(server):
    (name,) = _replica_actor_names()
    out = {"events": []}
    streaming_started = threading.Event()

    def streaming():
        with server.client.stream("POST", "/v1/completions", json={"prompt": "crash test", "max_tokens": LIMIT,
                                                                   "temperature": 0, "stream": True}) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    out["events"].append(data if data == "[DONE]" else json.loads(data))
                    streaming_started.set()

    t = threading.Thread(target=streaming)
    t.start()
    # kill only once tokens flow: a replica that dies before its first event is a 503 (the request below)
    assert streaming_started.wait(60), f"the stream did not start: {out}"
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    t.join(90)
    assert not t.is_alive(), "the in-flight stream hung after its replica died"
    events = out["events"]
    assert out["status"] == 200 and events[-1] == "[DONE]", (out["status"], events[-3:])
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors and errors[0]["error"]["type"] == "server_error", events[-3:]
    assert not any(isinstance(e, dict) and e.get("choices") and e["choices"][0].get("finish_reason")
                   for e in events), "a killed generation must not look finished"

    t0 = time.monotonic()
    during = server.chat("during the restart", 4)  # queued until a replica is back, or a clean 503
    assert during.status_code in (200, 503), during.text
    if during.status_code == 503:
        assert during.json()["error"]["code"] in ("replica_unavailable", "timeout")
    assert time.monotonic() - t0 < 90
    wait_for(lambda: server.client.get("/health").status_code == 200, 120, interval=1, what="a replacement replica")
    wait_for(lambda: _replica_actor_names() and _replica_actor_names() != [name], 60, what="a new replica actor")
    r = server.chat("after the crash", 6)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == server.reference_chat("after the crash", 6)


def test_drafter_for_another_target_is_refused(server):
    before = server.models()["drafter"]["version"]
    bad = register_drafter(server.tracking_uri, REGISTERED,
                           make_drafter(server.target, server.root / "drafter-alien", seed=3, identity="0" * 64))
    card = wait_for(lambda: (m := server.models())["drafter_error"] and m, 30, what="the refusal")
    assert f"version {bad}" in card["drafter_error"] and "target_identity" in card["drafter_error"]
    assert card["drafter"]["version"] == before  # still serving with the good drafter
    r = server.chat("still fine", 6)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == server.reference_chat("still fine", 6)
