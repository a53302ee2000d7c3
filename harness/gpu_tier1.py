"""Tier 1 of the GPU check (``harness/gpu_check.py``): what the lent GPU machine runs with
torch + transformers + safetensors and our ``specdec`` alone -- no Ray, vLLM, MLflow, YAML
or ``pipelines`` package, no model weights, no hub.

Random weights at real shapes. The target is a Qwen3 model built in code from Qwen3-8B's
config (:data:`QWEN3_8B`); the drafter and the training step take ``configs/qwen3-8b.yaml``'s
shapes (:data:`RECIPE`, hard-coded so that nothing here reads YAML; ``tests/test_gpu_check.py``
asserts they equal the recipe's). ``--tiny`` swaps both for :data:`TINY` (the CPU smoke run).

* ``bf16_exactness``: greedy AR vs speculative greedy through ``specdec.engine.Engine``, on a
  random target (``--target-layers`` of its 36 layers; default all) with a random drafter of
  the recipe's shape, with a DFlash2 drafter built on it (``specdec/dflash2.py``: the
  selector's walk and the convolutions at work), and with an oracle proposer (the AR output as drafts: whole blocks
  accepted, the commit path at full depth); plus a control, AR at batch 1 vs the batched AR.
  Reported: the share of identical outputs and, per divergent prompt, the AR logit gap
  (top1 - top2, teacher-forced) at the first divergent token.
* ``train_step``: the DFlash training step (``specdec.objective.dflash_loss`` stepped as
  ``pipelines/train/runner.py`` steps it, without DDP/DeepSpeed) at the recipe's shapes with
  random bf16 features (stored-features mode: only the target's embedding and LM head take
  part, so the target has 1 layer), flex attention on the GPU, in the recipe's layout
  (DeepSpeed bf16: bf16 weights, fp32 master weights and AdamW) and then DDP's (fp32 weights
  under bf16 autocast); peak memory, step time, block tokens/s, and the capacity planner's
  estimate of the same step (``pipelines/train/capacity.py``) where that planner exists.
* ``cycle_cost``: one AR decode step, one verify of B tokens and one draft pass timed at
  batch 1 and 8 (B = 16): draft and verify cost in target steps, r_d and r_v, the oracle
  ceiling (every draft accepted: tau = B, speedup B / (r_d + r_v)), and a DFlash2 draft pass
  of the same shape against DFlash's.

What "exact" means in bf16. Verifying B tokens and decoding 1 run different GEMM shapes
(other kernels, other reduction orders), so where two logits are within rounding of each
other the argmax may flip -- as it does between two batch sizes of plain AR decoding. A
divergence is *explained* when the AR gap at the first divergent token is within the
rounding noise measured between the engine's shapes (:func:`path_noise`) or at most
:data:`TIE_ULPS` bf16 ulps of the top-1 logit; the check FAILs on any unexplained
divergence (a real bug: a wrong cache slot, mask or position moves logits by far more), and
reports the identical share against the >= 95% goal beside the control's.

Peaked logits. A freshly initialised target (std 0.02) has near-uniform next-token laws, so
greedy ties would decide everything. The embedding is redrawn with std :data:`EMBED_STD`
(token identity survives in the residual stream) and the LM head with std
``LOGIT_STD / sqrt(hidden)`` (logits of std :data:`LOGIT_STD`: a peaked softmax, top-1
probability high as in a trained model). A Gaussian head still leaves the top-1/top-2 gap
near 1/(2 ln V) of the top logit whatever the scale, so near-ties stay more frequent than
in a trained model: the share of AR steps within the tie bound is reported as ``near_tie_steps``.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from specdec.checkpoint_format import DrafterConfig
    from specdec.drafter import DFlashDrafter
    from specdec.engine import Engine
    from specdec.objective import StepOutput
    from specdec.target import Target

REPO = Path(__file__).resolve().parents[1]

#: Qwen3-8B's config.json (the shapes; its weights are never needed)
QWEN3_8B = {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "rope_theta": 1e6,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 40960}
#: configs/qwen3-8b.yaml: drafter.num_layers, drafter.block_size, train.num_anchors, train.max_length,
#: train.batch_size, features.num_layers, train.loss_lambda, train.lr, train.grad_clip
RECIPE = {"drafter_layers": 5, "block_size": 16, "num_anchors": 512, "seq_len": 3072, "batch_size": 4,
          "num_features": 5, "loss_lambda": 7.0, "lr": 6e-4, "grad_clip": 1.0}
#: the CPU smoke run's shapes (seconds on one core)
TINY = {"target": {"hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 16, "intermediate_size": 128, "vocab_size": 256, "rope_theta": 1e6,
                   "rms_norm_eps": 1e-6, "max_position_embeddings": 1024},
        "recipe": {**RECIPE, "drafter_layers": 2, "num_anchors": 16, "seq_len": 96, "batch_size": 2}}

EMBED_STD = 1.0  # token identity stays visible in the residual stream (module docstring)
LOGIT_STD = 8.0  # a peaked softmax: top-1 logit ~ 8 * sqrt(2 ln V) ~ 39 over a vocabulary of 152K
TIE_ULPS = 4  # a divergence within this many ulps of the top-1 logit is a rounding tie
GOAL_IDENTICAL = 0.95  # the goal: identical to AR on >= 95% of prompts
GOAL_CEILING = 5.0  # the goal: oracle ceiling >= 5x AR at batch 1


@dataclass(frozen=True)
class Shapes:
    """The sizes of one tier-1 run: real (Qwen3-8B + the recipe) or tiny."""

    name: str
    target: dict
    target_layers: int
    drafter_layers: int
    block_size: int
    num_anchors: int
    seq_len: int
    batch_size: int
    num_features: int
    loss_lambda: float
    lr: float
    grad_clip: float
    prompts: int = 32
    prompt_len: tuple[int, int] = (32, 256)
    new_tokens: int = 64
    control_prompts: int = 4
    noise_prompts: int = 4
    cycle_context: int = 512
    cycle_batches: tuple[int, ...] = (1, 8)
    reps: int = 10
    train_steps: int = 3

    @property
    def vocab(self) -> int:
        return int(self.target["vocab_size"])

    @property
    def mask_token_id(self) -> int:
        return self.vocab - 2  # prompts never hold it (random ids stay below it)

    @property
    def eos_token_id(self) -> int:
        return self.vocab - 1


def shapes_for(opts: dict) -> Shapes:
    """The run's shapes from the driver's options (``tiny``, ``target_layers``)."""
    if opts.get("tiny"):
        t = TINY["target"]
        return Shapes("tiny", t, int(opts.get("target_layers") or t["num_hidden_layers"]), **TINY["recipe"],
                      prompts=4, prompt_len=(8, 24), new_tokens=24, control_prompts=2, noise_prompts=2, cycle_context=32, reps=3,
                      train_steps=2)
    layers = int(opts.get("target_layers") or QWEN3_8B["num_hidden_layers"])
    return Shapes("qwen3-8b", QWEN3_8B, layers, **RECIPE)


# ============================================================================ building blocks
def setup(opts: dict) -> tuple[Shapes, torch.device, torch.dtype]:
    """Shapes, device and compute dtype (bf16 on CUDA, float32 on the CPU)."""
    s = shapes_for(opts)
    dev = torch.device(opts.get("device") or "cpu")
    if dev.type == "cpu" and s.name == "tiny":
        torch.set_num_threads(1)  # tiny models gain nothing from threads on a shared CPU
    torch.manual_seed(int(opts.get("seed", 0)))
    return s, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32


def build_target(s: Shapes, dev: torch.device, dtype: torch.dtype, layers: int | None = None,
                 seed: int = 0) -> Target:
    """A random Qwen3 ``Target`` of ``s``'s shapes, built on ``dev`` (no CPU copy of 8B
    weights), embedding and LM head redrawn for peaked logits (module docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.target import Target

    cfg = AutoConfig.for_model("qwen3", **{**s.target, "num_hidden_layers": layers or s.target_layers},
                               tie_word_embeddings=False, bos_token_id=None, eos_token_id=s.eos_token_id,
                               pad_token_id=None)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, EMBED_STD)
        model.get_output_embeddings().weight.normal_(0, LOGIT_STD / math.sqrt(cfg.hidden_size))
    return Target(model, None, model_id=f"random-{s.name}-{cfg.num_hidden_layers}-layers")


def drafter_config(target: Target, s: Shapes) -> DrafterConfig:
    """The recipe's drafter for ``target``: its layers and B, reading the paper's spacing of
    feature layers over the target's layers (the training step's 1-layer target reads no
    features: its drafter keeps the full-depth target's ids)."""
    from specdec.drafter import drafter_config_for_target
    from specdec.target import default_target_layer_ids

    depth = target.num_layers if target.num_layers >= 4 else int(s.target["num_hidden_layers"])
    return drafter_config_for_target(target, num_hidden_layers=s.drafter_layers, block_size=s.block_size,
                                     target_layer_ids=default_target_layer_ids(depth, s.num_features),
                                     mask_token_id=s.mask_token_id)


def build_drafter(target: Target, s: Shapes, dev: torch.device) -> DFlashDrafter:
    """A random inference drafter of the recipe's shape (``specdec.tiny.random_drafter``'s
    wide init, so drafts are peaky), built on ``dev``."""
    from specdec.tiny import random_drafter

    cfg = drafter_config(target, s)
    with torch.device(dev):
        return random_drafter(target, block_size=s.block_size, layers=s.drafter_layers, seed=1,
                              mask_token_id=s.mask_token_id, target_layer_ids=cfg.target_layer_ids)


def build_dflash2(drafter: DFlashDrafter, dev: torch.device, seed: int = 3) -> DFlashDrafter:
    """A DFlash2 drafter (``specdec/dflash2.py``, default settings) holding ``drafter``'s
    weights, its convolution and selector projections redrawn so that they do real work (fresh
    ones are neutral: the walk would be the head's argmax and the convolutions identities)."""
    import dataclasses

    from specdec.dflash2 import DFlash2Drafter

    with torch.device(dev):
        d2 = DFlash2Drafter(dataclasses.replace(drafter.config, dflash2={}))
    d2.load_state_dict(drafter.state_dict(), strict=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in d2.named_parameters():
            if name.endswith(("kernel_projection.weight", "hidden_projection.weight")):
                p.normal_(0, 0.5 / math.sqrt(p.shape[1]))
    return d2.to(next(drafter.parameters()).dtype).eval().requires_grad_(False)


def random_prompts(s: Shapes, n: int, seed: int, length: int | None = None) -> list[list[int]]:
    """``n`` prompts of random token ids (lengths drawn from ``s.prompt_len`` unless given)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (length, length) if length else s.prompt_len
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, s.mask_token_id, (L,), generator=g).tolist() for L in lens]


def proposer_classes() -> tuple[type, type]:
    """(DFlashProposer, OracleProposer) wherever this version of ``specdec`` keeps them."""
    try:
        from specdec.proposers import DFlashProposer, OracleProposer
    except ImportError:  # proposers still inside engine.py
        from specdec.engine import DFlashProposer, OracleProposer
    return DFlashProposer, OracleProposer


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], object], dev: torch.device) -> float:
    """Seconds ``fn`` takes, the device's queue drained before and after."""
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t0


def time_left(opts: dict) -> float:
    return float(opts.get("deadline") or math.inf) - time.time()


def ulp(x: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s numbers at ``|x|`` (bf16: 2^-7 of the power of two below)."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(x), torch.finfo(dtype).tiny)))


def describe(s: Shapes, dev: torch.device, dtype: torch.dtype, target_layers: int) -> dict:
    """What every tier-1 report says about its run."""
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"shapes": s.name, "device": str(dev), "device_name": name, "dtype": str(dtype).removeprefix("torch."),
            "target_layers": target_layers, "target_layers_full": int(s.target["num_hidden_layers"]),
            "target": dict(s.target), "drafter_layers": s.drafter_layers, "block_size": s.block_size,
            "torch": torch.__version__}


# ============================================================================ bf16_exactness
def generate(target: Target, proposer: object | None, prompts: list[list[int]], new_tokens: int, block: int,
             oracle: list[list[int]] | None = None) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs of one batch through our engine, and every cycle's accepted drafts."""
    from specdec.engine import Engine, Request

    reqs = [Request(p, new_tokens, stop_ids=frozenset(), oracle=o)
            for p, o in zip(prompts, oracle or [None] * len(prompts))]
    res = Engine(target, proposer, width=block, seed=0).generate(reqs)
    return [r.tokens for r in res], [a for r in res for a in r.stats.accepted]


@torch.no_grad()
def ar_gaps(target: Target, prompt: list[int], tokens: list[int]) -> tuple[list[float], list[float]]:
    """(top-1 logit, top1 - top2) of the target's law before each of ``tokens``, teacher-forced."""
    ids = torch.tensor([prompt + tokens[:-1]], device=target.device)
    hidden = target(ids, torch.arange(ids.shape[1], device=target.device)[None]).hidden[0, len(prompt) - 1:]
    top = target.logits(hidden).float().topk(2, dim=-1).values
    return top[:, 0].tolist(), (top[:, 0] - top[:, 1]).tolist()


@torch.no_grad()
def chunked_logits(target: Target, prompt: list[int], tokens: list[int], chunk: int) -> torch.Tensor:
    """The target's logits before each of ``tokens`` (teacher-forced), computed as the engine
    computes them: the prompt prefilled, then ``tokens[:-1]`` fed ``chunk`` at a time through
    the cache (1: AR decoding's shapes; B: verification's)."""
    from transformers import DynamicCache

    from specdec import kvcache

    dev, cache = target.device, DynamicCache()
    lens = torch.tensor([len(prompt)], device=dev)
    ids = torch.tensor([prompt], device=dev)
    out = [target(ids, torch.arange(len(prompt), device=dev)[None], cache,
                  kvcache.attention_mask(lens, 0, len(prompt), causal=True)).hidden[:, -1:]]
    fed = tokens[:-1]
    for i in range(0, len(fed), chunk):
        part = torch.tensor([fed[i:i + chunk]], device=dev)
        k, past = part.shape[1], len(prompt) + i
        mask = kvcache.attention_mask(torch.tensor([past], device=dev), past, k, causal=True)
        out.append(target(part, past + torch.arange(k, device=dev)[None], cache, mask).hidden)
    return target.logits(torch.cat(out, dim=1)[0]).float()


def path_noise(target: Target, prompts: list, ar: list, block: int, n: int) -> dict:
    """How far bf16 rounding alone moves the logits between the engine's shapes: for ``n``
    prompts, teacher-forced logits from one whole-sequence forward vs AR decoding's (chunks of
    1) and verification's (chunks of ``block``). An argmax can only flip between two shapes
    where the top-1/top-2 gap is at most |d top1| + |d top2|: ``bound`` is that sum's maximum
    over every position measured (a wrong cache slot, mask or position moves logits by far more)."""
    worst, per = 0.0, {}
    for name, chunk in (("decode", 1), ("verify", block)):
        sums = []
        for p, toks in zip(prompts[:n], ar[:n]):
            ids = torch.tensor([p + toks[:-1]], device=target.device)
            whole = target.logits(target(ids, torch.arange(ids.shape[1], device=target.device)[None])
                                  .hidden[0, len(p) - 1:]).float()
            top2 = whole.topk(2, dim=-1).indices
            delta = (whole - chunked_logits(target, p, toks, chunk)).abs().gather(-1, top2).sum(-1)
            sums.append(delta)
        d = torch.cat(sums)
        per[name] = {"max": round(float(d.max()), 4), "p99": round(float(d.quantile(0.99)), 4),
                     "median": round(float(d.median()), 4)}
        worst = max(worst, float(d.max()))
    return {"bound": round(worst, 4), "prompts": n, **per}


def compare(ar: list[list[int]], other: list[list[int]], gaps: list, dtype: torch.dtype, bound: float) -> dict:
    """Identical share of ``other`` against ``ar`` and, per divergent prompt, the AR gap at
    its first divergent token in logits and in ulps of the top-1 logit; a divergence is
    explained when that gap is within ``bound`` (the measured rounding noise between shapes,
    at least :data:`TIE_ULPS` ulps)."""
    div = []
    for i, (a, o) in enumerate(zip(ar, other)):
        j = next((k for k, (x, y) in enumerate(zip(a, o)) if x != y), None)
        if j is None and len(a) == len(o):
            continue
        if j is None or j >= len(gaps[i][0]):  # same tokens, different lengths: not a tie
            div.append({"prompt": i, "token": j, "gap": None, "gap_ulps": None, "explained": False})
            continue
        top1, gap = gaps[i][0][j], gaps[i][1][j]
        ulps = gap / ulp(top1, dtype)
        div.append({"prompt": i, "token": j, "ar": a[j], "other": o[j], "gap": round(gap, 5),
                    "gap_ulps": round(ulps, 2), "explained": ulps <= TIE_ULPS or gap <= bound})
    n = len(other)
    return {"prompts": n, "identical": (n - len(div)) / n if n else None, "divergences": div,
            "explained": all(d["explained"] for d in div)}


def exactness_runs(target: Target, drafter: DFlashDrafter, s: Shapes, prompts: list,
                   ar: list) -> dict[str, Callable[[], tuple]]:
    """The runs compared with the batched AR output, by name."""
    dflash, oracle = proposer_classes()
    control = prompts[: s.control_prompts]
    return {
        "dflash": lambda: generate(target, dflash(drafter, target), prompts, s.new_tokens, s.block_size),
        "ar_batch1": lambda: ([generate(target, None, [p], s.new_tokens, 1)[0][0] for p in control], []),
        "oracle": lambda: generate(target, oracle(), prompts, s.new_tokens, s.block_size, oracle=ar),
        "dflash2": lambda: generate(target, dflash(build_dflash2(drafter, target.device), target), prompts,
                                    s.new_tokens, s.block_size),
    }


def check_bf16_exactness(metrics: dict, opts: dict) -> str:
    """Speculative greedy == AR greedy, or every divergence explained by a rounding tie."""
    from specdec.engine import tau_of

    s, dev, dtype = setup(opts)
    metrics.update(describe(s, dev, dtype, s.target_layers), prompts=s.prompts, new_tokens=s.new_tokens,
                   tie_ulps=TIE_ULPS, embed_std=EMBED_STD, logit_std=LOGIT_STD)
    target = build_target(s, dev, dtype)
    drafter = build_drafter(target, s, dev)
    prompts = random_prompts(s, s.prompts, seed=1)
    t0 = time.perf_counter()
    ar, _ = generate(target, None, prompts, s.new_tokens, 1)
    ar_s = time.perf_counter() - t0
    gaps = [ar_gaps(target, p, a) for p, a in zip(prompts, ar)]
    flat = [(t, g) for top, gap in gaps for t, g in zip(top, gap)]
    metrics.update(ar_s=round(ar_s, 3), gap_median=round(statistics.median(g for _, g in flat), 4),
                   near_tie_steps=round(sum(g <= TIE_ULPS * ulp(t, dtype) for t, g in flat) / len(flat), 4))
    metrics["noise"] = noise = path_noise(target, prompts, ar, s.block_size, s.noise_prompts)
    metrics["within_noise_steps"] = round(sum(g <= noise["bound"] for _, g in flat) / len(flat), 4)
    modes, skipped = {}, []
    # what a run costs in batched AR runs: a DFlash cycle verifies B tokens and drafts (~2),
    # the oracle's few cycles (~1), the control one AR run per prompt
    cost = {"dflash": 2.0, "dflash2": 2.0, "oracle": 1.0, "ar_batch1": float(s.control_prompts)}
    for name, run in exactness_runs(target, drafter, s, prompts, ar).items():
        if time_left(opts) < 1.5 * cost[name] * ar_s + 5:  # too little time: keep the results we have
            skipped.append(name)
        else:
            tokens, accepted = run()
            modes[name] = {**compare(ar[: len(tokens)], tokens, gaps, dtype, noise["bound"]),
                           "tau": tau_of(accepted)}
        metrics.update(modes=modes, skipped_for_time=skipped)
    return exactness_verdict(metrics, modes, skipped, dtype)


def exactness_verdict(metrics: dict, modes: dict, skipped: list, dtype: torch.dtype) -> str:
    """PASS when every speculative divergence is a rounding tie (module docstring)."""
    spec = {k: v for k, v in modes.items() if k != "ar_batch1"}
    if not spec:
        raise AssertionError(f"no speculative run finished in the time left (skipped: {skipped})")
    bad = [(k, d) for k, v in spec.items() for d in v["divergences"] if not d["explained"]]
    worst = min(v["identical"] for v in spec.values())
    # the control (AR at batch 1 vs batched AR) is the same rounding question without speculation
    control = modes.get("ar_batch1", {}).get("identical")
    metrics.update(identical=worst, goal_identical=GOAL_IDENTICAL, control_identical=control,
                   goal_met=worst >= GOAL_IDENTICAL, at_least_control=None if control is None else worst >= control)
    parts = [f"{k} {round(v['identical'] * v['prompts'])}/{v['prompts']} identical" for k, v in modes.items()]
    noise = metrics["noise"]
    summary = (f"{', '.join(parts)} ({metrics['dtype']}, {metrics['target_layers']}-layer target); "
               f"{metrics['near_tie_steps']:.1%} of AR steps within {TIE_ULPS} ulps, "
               f"{metrics['within_noise_steps']:.1%} within the measured shape noise {noise['bound']:.2f}")
    if bad:
        k, d = bad[0]
        raise AssertionError(f"{len(bad)} divergence(s) not explained by rounding: {k} prompt {d['prompt']} "
                             f"token {d['token']}, AR gap {d['gap']} ({d['gap_ulps']} ulps > {TIE_ULPS}, "
                             f"> noise bound {noise['bound']}); {summary}")
    n_div = sum(len(v["divergences"]) for v in spec.values())
    ties = f"{n_div} speculative divergence(s), all rounding ties" if n_div else "no speculative divergence"
    return f"{summary}; {ties}" + (
        f"; skipped for time: {', '.join(skipped)}" if skipped else "")


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
        target = cap.TargetShape.from_hf({**t, "model_type": "qwen3"}, "harness/gpu_tier1.py")
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


# ============================================================================ cycle_cost
def time_steps(engine: Engine, prompts: list[list[int]], k: int, s: Shapes, dev: torch.device) -> float:
    """Median seconds of ``engine.step(k)`` over ``s.reps`` steps after warm-up."""
    from specdec.engine import Request

    warm = 2
    engine.add([Request(p, (warm + s.reps + 2) * k + 8, stop_ids=frozenset()) for p in prompts])
    for _ in range(warm):
        engine.step(k)
    return statistics.median(timed(lambda: engine.step(k), dev) for _ in range(s.reps))


def cycle_row(target: Target, drafter: DFlashDrafter, s: Shapes, bsz: int, dev: torch.device) -> dict:
    """AR step, verify of B tokens, draft pass and full DFlash cycle at batch ``bsz``."""
    from specdec.engine import Engine

    dflash, oracle = proposer_classes()
    B = s.block_size
    prompts = random_prompts(s, bsz, seed=2, length=s.cycle_context)
    ar = time_steps(Engine(target, None, width=1), prompts, 1, s, dev)
    verify = time_steps(Engine(target, oracle(), width=B), prompts, B, s, dev)  # drafts cost nothing
    engine = Engine(target, dflash(drafter, target), width=B, seed=0)
    cycle = time_steps(engine, prompts, B, s, dev)
    draft = statistics.median(timed(lambda: engine.proposer.propose(engine, B - 1), dev) for _ in range(s.reps))
    engine2 = Engine(target, dflash(build_dflash2(drafter, dev), target), width=B, seed=0)
    time_steps(engine2, prompts, B, s, dev)  # fills its cache to the same context
    draft2 = statistics.median(timed(lambda: engine2.proposer.propose(engine2, B - 1), dev) for _ in range(s.reps))
    r_d, r_v = draft / ar, verify / ar
    return {"draft2_ms": round(draft2 * 1000, 3), "dflash2_draft_ratio": round(draft2 / draft, 3),"batch": bsz, "context": s.cycle_context, "ar_step_ms": round(ar * 1000, 3),
            "verify_ms": round(verify * 1000, 3), "draft_ms": round(draft * 1000, 3),
            "cycle_ms": round(cycle * 1000, 3), "r_d": round(r_d, 3), "r_v": round(r_v, 3),
            "cycle_steps": round(cycle / ar, 3), "oracle_tau": B, "oracle_speedup": round(B / (r_d + r_v), 2)}


def check_cycle_cost(metrics: dict, opts: dict) -> str:
    """Draft and verify cost in target steps at B = 16, batch 1 and 8; the oracle ceiling."""
    s, dev, dtype = setup(opts)
    metrics.update(describe(s, dev, dtype, s.target_layers), reps=s.reps)
    target = build_target(s, dev, dtype)
    drafter = build_drafter(target, s, dev)
    rows = []
    for bsz in s.cycle_batches:
        if rows and time_left(opts) < 10:
            break
        rows.append(cycle_row(target, drafter, s, bsz, dev))
        metrics["batches"] = rows
    one = rows[0]
    metrics.update(goal_ceiling=GOAL_CEILING, goal_met=one["oracle_speedup"] >= GOAL_CEILING)
    timings = ("ar_step_ms", "verify_ms", "draft_ms")
    bad = [r for r in rows if not all(math.isfinite(r[k]) and r[k] > 0 for k in timings)]
    if bad:
        raise AssertionError(f"a timing is not a positive number: {bad[0]}")
    return f"B={s.block_size}, {metrics['target_layers']}-layer target: " + "; ".join(
        f"batch {r['batch']}: AR {r['ar_step_ms']:.1f} ms, draft {r['r_d']:.2f} + verify {r['r_v']:.2f} steps "
        f"-> oracle ceiling {r['oracle_speedup']:.1f}x, DFlash2 draft {r['dflash2_draft_ratio']:.2f}x DFlash's"
        for r in rows)


CHECKS: dict[str, Callable[[dict, dict], str]] = {
    "bf16_exactness": check_bf16_exactness,
    "train_step": check_train_step,
    "cycle_cost": check_cycle_cost,
}


def preload() -> None:
    """Import what the checks import, so that CPU checks forked from the driver start warm."""
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401

    import specdec.engine  # noqa: F401
    import specdec.objective  # noqa: F401
    import specdec.tiny  # noqa: F401

    proposer_classes()

