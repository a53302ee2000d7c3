"""Elastic resize keeps the optimizer: DeepSpeed ZeRO-2 (pipelines/train/portable_optimizer.py)
and DDP train on 2 CPU workers (gloo), save, and 1 worker resumes with the same fp32 (master)
weights, AdamW moments and step count; then back to 2 workers. Plain processes (no Ray: DDP's
``prepare_model`` is the DDP wrapper Ray Train would apply): the runners are under test."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, os, sys, torch
from pathlib import Path
torch.set_num_threads(1)
rank, world, mode, ckpt, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5])
strategy = sys.argv[6]
os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
if strategy == "deepspeed":
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    deepspeed.init_distributed("gloo")
else:  # DDP never imports DeepSpeed (seconds per process on 2 cores), as in a DDP training worker
    torch.distributed.init_process_group("gloo")
import ray.train.torch
ray.train.torch.prepare_model = lambda m: torch.nn.parallel.DistributedDataParallel(m) if world > 1 else m
from pipelines.train.data import Batch
from pipelines.train.runner import DrafterLoss, TrainState, make_runner
from specdec.tiny import random_drafter, tiny_target
target = tiny_target("llama", dtype=torch.float32, vocab_size=96)
drafter = random_drafter(target, block_size=4, layers=1).float().requires_grad_(True).train()
runner = make_runner(strategy, DrafterLoss(drafter, target, False, None), torch.device("cpu"), False,
                     grad_clip=1.0, lr=1e-3, weight_decay=0.0, zero_stage=2, micro_batch=2, portable=True)
state = TrainState(world_size=world, strategy=strategy)
if mode != "fresh":
    saved = TrainState.load(ckpt)
    runner.load(ckpt, saved)
    state = TrainState(step=saved.step, world_size=world, strategy=strategy)
def full():
    if strategy == "ddp":  # every worker holds the whole AdamW state
        st = runner.optimizer.state
        return {n: [p.detach().clone()] + [st[p][k] for k in ("exp_avg", "exp_avg_sq")]
                for n, p in runner.drafter.named_parameters()}
    return {n: [safe_get_full_fp32_param(p)] + [safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")]
            for n, p in runner.drafter.named_parameters()}
if mode != "fresh" and rank == 0:
    torch.save(full(), out / f"restored-w{world}.pt")
elif mode != "fresh":
    full()  # the gathers are collectives: every rank joins
g = torch.Generator().manual_seed(100 + state.step * 10 + rank)
losses = []
for _ in range(3):
    ids = torch.randint(3, 96, (2, 40), generator=g)
    feats = torch.randn(2, 40, len(drafter.config.target_layer_ids) * target.hidden_size, generator=g)
    mask = torch.ones(2, 40, dtype=torch.bool); mask[:, :8] = False
    batch = Batch(ids, mask, torch.full((2,), 40), feats, ["a", "b"])
    losses.append(float(runner.train_step(batch, 6, 1e-3, torch.Generator().manual_seed(state.step)).loss))
    state.step += 1
new = out / f"ckpt-{mode}-w{world}"
new.mkdir(exist_ok=True)
runner.save(new, state, rank)
if rank == 0:
    torch.save(full(), out / f"saved-{mode}-w{world}.pt")
else:
    full()
    (out / f"done-{mode}-w{world}-{rank}").write_text(json.dumps(losses))
if rank == 0:
    (out / f"done-{mode}-w{world}-0").write_text(json.dumps(losses))
"""


def _run(world: int, mode: str, ckpt: Path, out: Path, strategy: str = "deepspeed") -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(world), mode, str(ckpt), str(out), strategy],
                              env=env,
                              cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return json.loads((out / f"done-{mode}-w{world}-0").read_text())


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(x, y) for n in a for x, y in zip(a[n], b[n]))


@pytest.mark.slow
def test_zero2_resize_keeps_weights_moments_and_step(tmp_path):
    import torch

    _run(2, "fresh", tmp_path, tmp_path)  # 3 steps on 2 workers, then a checkpoint
    saved = torch.load(tmp_path / "saved-fresh-w2.pt")
    ckpt2 = tmp_path / "ckpt-fresh-w2"
    assert (ckpt2 / "optimizer_full" / "meta.json").is_file()
    # 2 -> 1: the one worker holds every parameter's full fp32 weights and moments, as saved
    losses1 = _run(1, "resumed", ckpt2, tmp_path)
    assert _same(torch.load(tmp_path / "restored-w1.pt"), saved), "2 -> 1 workers lost optimizer state"
    assert all(torch.count_nonzero(m[1]) > 0 for m in saved.values())  # moments were there to lose
    assert json.loads((ckpt2 / "state.json").read_text())["step"] == 3
    assert json.loads((tmp_path / "ckpt-resumed-w1" / "state.json").read_text())["step"] == 6
    # 1 -> 2 again: the same re-shard the other way
    (tmp_path / "restored-w1.pt").unlink()
    _run(2, "resumed", tmp_path / "ckpt-resumed-w1", tmp_path)
    assert _same(torch.load(tmp_path / "restored-w2.pt"), torch.load(tmp_path / "saved-resumed-w1.pt"))
    assert all(torch.isfinite(torch.tensor(losses1)))


@pytest.mark.slow
def test_ddp_resize_keeps_weights_moments_and_step(tmp_path):
    import torch

    _run(2, "fresh", tmp_path, tmp_path, "ddp")
    ckpt2 = tmp_path / "ckpt-fresh-w2"
    assert (ckpt2 / "optimizer.pt").is_file()
    _run(1, "resumed", ckpt2, tmp_path, "ddp")
    assert _same(torch.load(tmp_path / "restored-w1.pt"), torch.load(tmp_path / "saved-fresh-w2.pt"))
    (tmp_path / "restored-w1.pt").unlink()
    _run(2, "resumed", tmp_path / "ckpt-resumed-w1", tmp_path, "ddp")
    assert _same(torch.load(tmp_path / "restored-w2.pt"), torch.load(tmp_path / "saved-resumed-w1.pt"))
    assert json.loads((tmp_path / "ckpt-resumed-w2" / "state.json").read_text())["step"] == 9
