"""Packed oneDNN linears (specdec/cpu_kernels.py): same numbers as nn.Linear, same state
dict, autograd falls back, in-place weight changes are picked up, float64 is left alone."""

import pytest
import torch
from torch import nn

from specdec import cpu_kernels
from specdec.cpu_kernels import PackedLinear, pack_linears

pytestmark = pytest.mark.unit  # the pinned torch wheel (Makefile TORCH_SPEC) has oneDNN: cpu_kernels.available() holds


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(1, 64), (3, 8, 64), (2, 1, 64)])
def test_packed_equals_linear(dtype, tol, shape):
    """On every CPU: packed where this CPU has oneDNN's path for ``dtype`` (bf16 needs more than
    AVX2), left a plain linear where it has not, and the output equals the linear's either way."""
    assert cpu_kernels.available()
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True).to(dtype)
    x = torch.randn(*shape, dtype=dtype)
    ref = lin(x)
    model = nn.Sequential(lin)
    packs = dtype in cpu_kernels.packable_dtypes()
    assert pack_linears(model) == int(packs)
    assert isinstance(model[0], PackedLinear) if packs else type(model[0]) is nn.Linear
    with torch.no_grad():
        got = model(x)
    assert got.shape == ref.shape and got.dtype == dtype
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def test_state_dict_tied_weights_and_module_tree_are_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16, bias=False), nn.Linear(16, 50, bias=False))
    model[2].weight = model[0].weight  # a tied LM head
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert pack_linears(model) == 2
    assert isinstance(model[2], PackedLinear) and model[2].weight is model[0].weight
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_autograd_falls_back_and_in_place_updates_are_repacked():
    torch.manual_seed(0)
    lin = nn.Linear(32, 8, bias=False)
    packed = PackedLinear(lin)
    x = torch.randn(4, 32, requires_grad=True)
    packed(x).sum().backward()  # would fail on the packed path: it has no backward
    assert x.grad is not None and lin.weight.grad is not None
    with torch.no_grad():
        lin.weight.mul_(2.0)  # an optimizer step / load_state_dict changes the weight in place
        torch.testing.assert_close(packed(x.detach()), x.detach() @ lin.weight.T, rtol=1e-5, atol=1e-5)
    lin.weight.data = torch.zeros_like(lin.weight)  # a swapped tensor (module.to(...)) too
    with torch.no_grad():
        assert torch.count_nonzero(packed(x.detach())) == 0


def test_a_dtype_this_cpu_cannot_pack_stays_a_plain_linear(monkeypatch):
    """bf16 on a CPU without oneDNN's bf16 path (AVX2-only): left to F.linear, still runs."""
    monkeypatch.setattr(cpu_kernels, "packable_dtypes", lambda: (torch.float32,))
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8))
    assert pack_linears(model) == 1 and type(model[0]) is nn.Linear and isinstance(model[1], PackedLinear)
    assert model[0](torch.randn(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_float64_and_non_linear_modules_stay():
    model = nn.Sequential(nn.Linear(8, 8).double(), nn.LayerNorm(8))
    assert pack_linears(model) == 0 and type(model[0]) is nn.Linear
