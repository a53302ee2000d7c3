"""Faster frozen linears on CPU: oneDNN matmuls with weights packed once.

PyTorch's default fp32 CPU matmul goes to MKL, whose small-M paths are slow on many
CPUs (measured on a 2-core AMD EPYC, SmolLM2-135M, fp32): a one-token decode step took
57 ms and verifying 8 tokens 81 ms (1.4 AR steps), the 49152 x 576 LM head alone 10 ms
at M=1 and 15 ms at M=8. With the same weights packed for oneDNN the step takes 40 ms,
verifying 8 tokens 45 ms (1.1 AR steps) and the LM head 4 ms at any M <= 8. Both the
autoregressive baseline and speculative decoding get the faster kernels, so speedups
stay honest; speculation gains most because its verify pass has M = block size.

Only inference: a packed linear has no backward, so when autograd is recording through
it (training a drafter against the target's LM head) it falls back to ``F.linear``; a
weight changed in place (an optimizer step, ``load_state_dict``) is repacked on next use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN packs on this CPU: float32, and bfloat16 only where the CPU has
    oneDNN's bf16 path (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU refuses to pack
    bf16). float64, used by the exactness tests, stays on MKL."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


class PackedLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is also kept in oneDNN's packed layout.

    ``weight``/``bias`` stay the original parameters (state dicts, fingerprints and tied
    embeddings are unchanged); the packed copy is a plain attribute, never saved."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.repack()

    def repack(self) -> None:
        """Pack the current weight (done again by itself whenever the weight changes)."""
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self._stamp = self._weight_stamp()

    def _weight_stamp(self) -> tuple[int, int]:
        return self.weight._version, self.weight.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.device.type != "cpu" or (
                torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return F.linear(x, self.weight, self.bias)
        if self._weight_stamp() != self._stamp:  # trained, loaded or moved since packing
            self.repack()
        bias = self.bias.detach() if self.bias is not None else None
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_linears(module: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` under ``module`` (CPU, a dtype of
    :func:`packable_dtypes`) by a ``PackedLinear`` in place; returns how many were packed
    (0 when oneDNN is missing)."""
    if not available():
        return 0
    packable, n = packable_dtypes(), 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype in packable:
                setattr(parent, name, PackedLinear(child))
                n += 1
    return n
