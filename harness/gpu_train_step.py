"""Tier 1's ``train_step`` check: the DFlash training step at the recipe's shapes with random bf16
features, flex attention on the GPU, in DeepSpeed's bf16 layout and DDP's autocast layout;
peak memory, step time, block tokens/s, and the capacity planner's estimate of the same step.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable

import torch

from harness.gpu_models import Shapes, build_target, describe, drafter_config, setup, time_left, timed

if TYPE_CHECKING:
    from specdec.drafter import DFlashDrafter
    from specdec.objective import StepOutput
    from specdec.target import Target


REPO = Path(__file__).resolve().parents[1]
# ============================================================================ train_step
#: how a worker holds the drafter: the recipe's DeepSpeed bf16 (``DeepSpeedRunner``: bf16
#: weights and grads, fp32 master weights and AdamW moments, no autocast) and DDP on CUDA
#: (``DDPRunner``: fp32 weights and AdamW under bf16 autocast)
LAYOUTS = ("deepspeed_bf16", "ddp_autocast")


def random_batch(s: Shapes, dev: torch.device, feature_dtype: torch.dtype, hidden: int) -> dict:
    """A batch of the recipe's shape: random ids, the first third prompt (anchors fall in
    the responses), full lengths, random stored features of ``feature_dtype``."""
    g = torch.Generator().manual_seed(0)
    B, T = s.batch_size, s.seq_len
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    loss_mask[:, T // 3:] = True
    return {"input_ids": torch.randint(0, s.mask_token_id, (B, T), generator=g).to(dev),
            "loss_mask": loss_mask.to(dev), "lengths": torch.full((B,), T, device=dev),
            "features": torch.randn(B, T, s.num_features * hidden, device=dev, dtype=feature_dtype)}


class Optimizer:
    """AdamW with gradient clipping over ``params``; with ``master`` the DeepSpeed bf16
    layout at world 1: the model's bf16 weights and grads, fp32 copies stepped here."""

    def __init__(self, params: list, lr: float, fused: bool, master: bool):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params] if master else None
        self.opt = torch.optim.AdamW(self.master or self.params, lr=lr, weight_decay=0.0, fused=fused)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self, clip: float) -> None:
        stepped = self.master or self.params
        if self.master is not None:
            for m, p in zip(self.master, self.params):
                m.grad = None if p.grad is None else p.grad.float()
        torch.nn.utils.clip_grad_norm_(stepped, clip)
        self.opt.step()
        if self.master is not None:
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    p.copy_(m)


def flex_path() -> str:
    """How the library's draft layers run flex attention (its source says whether compiled)."""
    import inspect

    import specdec.drafter as drafter_module

    compiled = "torch.compile" in inspect.getsource(drafter_module)
    return "flex, compiled by the library" if compiled else "flex, EAGER (materialises every score)"


def plan_gib(s: Shapes, layout: str, attention: str, act_bytes: int, feature_bytes: int) -> tuple[float | None, str]:
    """The capacity planner's per-GPU memory (``pipelines/train/capacity.py``) for this very
    step on one worker in ``layout``; loaded by path, since importing ``pipelines.train``
    imports Ray. None and why where the planner is missing or its interface moved."""
    path = REPO / "pipelines" / "train" / "capacity.py"
    if not path.is_file():
        return None, "no capacity planner in this tree (pipelines/train/capacity.py): compare by hand"
    try:
        spec = importlib.util.spec_from_file_location("_gpu_check_capacity", path)
        cap = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
        spec.loader.exec_module(cap)
        t = s.target
        target = cap.TargetShape.from_hf({**t, "model_type": "qwen3"}, "harness/gpu_models.py")
        step = cap.StepShape(batch=s.batch_size, seq=s.seq_len, anchors=s.num_anchors, block=s.block_size,
                             layers=s.drafter_layers, hidden=t["hidden_size"], intermediate=t["intermediate_size"],
                             heads=t["num_attention_heads"], kv_heads=t["num_key_value_heads"],
                             head_dim=t["head_dim"], features=s.num_features, target_hidden=t["hidden_size"],
                             draft_vocab=s.vocab, act_bytes=act_bytes, feature_bytes=feature_bytes,
                             attention=attention)
        strategy = "deepspeed" if layout == "deepspeed_bf16" else "ddp"
        recipe = SimpleNamespace(train=SimpleNamespace(strategy=strategy, zero_stage=2, online=False),
                                 features=SimpleNamespace(target=SimpleNamespace(dtype="bfloat16")))
        memory = cap.plan_memory(recipe, target, step, 1)
        return round(sum(memory.values()) / cap.GIB, 2), f"pipelines/train/capacity.py, {strategy} on 1 worker"
    except Exception as e:  # noqa: BLE001 - the planner's interface may move; the measurement stands
        return None, f"capacity planner not usable here ({type(e).__name__}: {e})"


def train_step_fn(drafter: DFlashDrafter, target: Target, opt: Optimizer, batch: dict, s: Shapes, dev: torch.device,
                  autocast: bool) -> Callable[[int], StepOutput]:
    """One step as the runners take it (without DDP/DeepSpeed): loss, backward, clip, AdamW."""
    from specdec.draft_vocab import DraftHead
    from specdec.objective import dflash_loss

    head = DraftHead(target)  # the frozen LM head, as DrafterLoss builds it

    def step(i: int) -> StepOutput:
        gen = torch.Generator(device=dev).manual_seed(i)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            out = dflash_loss(drafter, target.embed, head, batch["input_ids"], batch["loss_mask"], batch["features"],
                              batch["lengths"], s.num_anchors, s.loss_lambda, gen, use_flex=dev.type == "cuda")
        opt.zero_grad()
        out.loss.backward()
        opt.step(s.grad_clip)
        return out

    return step


def run_layout(layout: str, target: Target, batch: dict, s: Shapes, dev: torch.device, opts: dict) -> dict:
    """The first step (compilation included) apart, then up to ``s.train_steps`` timed ones,
    with the drafter and optimizer held as ``layout`` holds them."""
    from specdec.drafter import DFlashDrafter

    cuda = dev.type == "cuda"
    if cuda:  # the previous layout's drafter and optimizer are gone: its peak must not count here
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    with torch.device(dev):
        drafter = DFlashDrafter(drafter_config(target, s)).train()
    bf16 = layout == "deepspeed_bf16"
    drafter.to(torch.bfloat16 if bf16 else torch.float32)
    target.to(torch.bfloat16 if cuda or bf16 else torch.float32)  # the frozen head meets the drafter's dtype
    opt = Optimizer(list(drafter.parameters()), s.lr, fused=cuda, master=bf16)
    step = train_step_fn(drafter, target, opt, batch, s, dev, autocast=cuda and not bf16)
    outs, res = [], {"weights": "bf16 + fp32 master" if bf16 else "fp32", "autocast": cuda and not bf16}
    res["first_step_s"] = round(timed(lambda: outs.append(step(0)), dev), 3)
    if cuda:
        res["peak_gib_first_step"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for i in range(1, s.train_steps + 1):
        if times and time_left(opts) < 3 * max(times) + 5:
            break
        times.append(timed(lambda i=i: outs.append(step(i)), dev))
    step_s = statistics.median(times or [res["first_step_s"]])
    block_tokens = outs[-1].n_blocks * s.block_size
    losses = [round(float(o.loss.detach()), 4) for o in outs]
    res.update(steps_timed=len(times), step_s=round(step_s, 4), losses=losses, tau=round(float(outs[-1].tau), 4),
               block_tokens_per_step=block_tokens, block_tokens_per_s=round(block_tokens / step_s, 1),
               peak_gib=round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if cuda else None)
    res["plan_gib"], res["plan_note"] = plan_gib(s, layout, "flex" if cuda else "dense", 2 if (cuda or bf16) else 4,
                                                 2 if cuda else 4)
    if res["peak_gib"] and res["plan_gib"]:
        res["plan_error"] = round(res["peak_gib"] / res["plan_gib"] - 1, 3)
    if not all(math.isfinite(x) for x in losses):
        raise AssertionError(f"{layout}: non-finite loss {losses}")
    return res


def check_train_step(metrics: dict, opts: dict) -> str:
    """The recipe's training step with random features in each layout: memory, time, block tokens/s."""
    s, dev, dtype = setup(opts)
    cuda = dev.type == "cuda"
    metrics.update(describe(s, dev, dtype, 1), num_anchors=s.num_anchors, seq_len=s.seq_len,
                   batch_size=s.batch_size, mode="stored features (target: embedding + LM head only)",
                   attention=flex_path() if cuda else "dense mask (CPU)")
    if cuda:
        metrics["gpu_gib"] = round(torch.cuda.mem_get_info(dev)[1] / 2**30, 1)
    target = build_target(s, dev, dtype, layers=1)
    batch = random_batch(s, dev, dtype, int(s.target["hidden_size"]))
    layouts, errors, t0 = {}, {}, time.perf_counter()
    for layout in LAYOUTS:
        if layout != LAYOUTS[0] and time_left(opts) < 1.2 * (time.perf_counter() - t0) + 10:
            errors[layout] = "skipped for time"
            continue
        try:
            layouts[layout] = run_layout(layout, target, batch, s, dev, opts)
        except Exception as e:  # noqa: BLE001 - one layout failing leaves the other's measurement
            errors[layout] = f"{type(e).__name__}: {str(e)[:600]}"
            if cuda and isinstance(e, torch.cuda.OutOfMemoryError):
                errors[layout] += f" (peak {torch.cuda.max_memory_allocated(dev) / 2**30:.1f} GiB)"
        metrics.update(layouts=layouts, errors=errors)
    return train_verdict(metrics, s, layouts, errors)


def train_verdict(metrics: dict, s: Shapes, layouts: dict, errors: dict) -> str:
    """The recipe's layout (DeepSpeed bf16) headlines; any layout that failed FAILs the check."""
    head = layouts.get(LAYOUTS[0]) or next(iter(layouts.values()), None)
    if head is not None:
        metrics.update({k: head[k] for k in ("step_s", "block_tokens_per_s", "peak_gib", "plan_gib", "plan_note")})
    shape = f"{s.drafter_layers} layers B={s.block_size} {s.num_anchors} anchors x {s.seq_len} tokens x {s.batch_size}"
    parts = []
    for name, r in layouts.items():
        mem = f", peak {r['peak_gib']} GiB" if r["peak_gib"] is not None else ""
        plan = f" (plan {r['plan_gib']})" if r["plan_gib"] is not None else ""
        parts.append(f"{name} {r['step_s'] * 1000:.0f} ms/step (first {r['first_step_s']:.2f} s), "
                     f"{r['block_tokens_per_s']:,.0f} block tokens/s{mem}{plan}")
    failed = {k: v for k, v in errors.items() if v != "skipped for time"}
    summary = f"{shape}, {metrics['attention']}: " + "; ".join(parts)
    if failed or not layouts:
        raise AssertionError(f"{'; '.join(f'{k}: {v}' for k, v in failed.items())} -- {summary}")
    skipped = [k for k, v in errors.items() if v == "skipped for time"]
    return summary + (f"; skipped for time: {', '.join(skipped)}" if skipped else "")
