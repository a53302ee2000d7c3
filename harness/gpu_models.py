"""The GPU check's tier 1 set-up (harness/gpu_tier1.py): random weights at real shapes. Qwen3-8B's
config (:data:`QWEN3_8B`) and ``configs/qwen3-8b.yaml``'s training shapes (:data:`RECIPE`, hard-coded:
nothing here reads YAML), or :data:`TINY` for the CPU smoke run; building the random target
(peaked logits, see gpu_tier1.py's docstring), drafters and prompts; timing on the device.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from specdec.checkpoint_format import DrafterConfig
    from specdec.drafter import DFlashDrafter
    from specdec.target import Target


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
    from specdec.checkpoint_format import default_target_layer_ids

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
