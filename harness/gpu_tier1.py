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

This file is the tier's index (:data:`CHECKS`) and its method; the set-up (shapes, random
models, timing) is ``gpu_models.py``'s, each check has a file of its own: ``gpu_exactness.py``,
``gpu_train_step.py``, ``gpu_cycle_cost.py``.
"""

from __future__ import annotations

from typing import Callable

from harness.gpu_cycle_cost import check_cycle_cost
from harness.gpu_exactness import check_bf16_exactness
from harness.gpu_models import proposer_classes
from harness.gpu_train_step import check_train_step


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
