"""Acceptance math, checked exhaustively on small vocabularies and by sampling."""

import itertools

import pytest
import torch

from specdec.sampling import SamplingParams, probs_from_logits, sample
from specdec.verify import acceptance_prob, greedy_accept, residual_law, speculative_accept

pytestmark = pytest.mark.unit


def _law(V, gen):
    x = torch.rand(V, generator=gen, dtype=torch.float64) ** 3 + 1e-3
    return x / x.sum()


def test_greedy_accept_prefix_and_correction():
    draft = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 3]])
    argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [4, 2, 3, 0]])
    n, toks = greedy_accept(draft, argmax)
    assert n.tolist() == [3, 1, 0]
    assert toks[0].tolist() == [5, 6, 7, 8]  # all accepted + bonus
    assert toks[1, :2].tolist() == [5, 6]  # accepted 5, correction 6 at the mismatch
    assert toks[2, 0].item() == 4  # correction at position 0


@pytest.mark.parametrize("V", [2, 3, 5])
def test_one_position_law_is_exactly_p(V):
    gen = torch.Generator().manual_seed(V)
    for _ in range(20):
        p, q = _law(V, gen), _law(V, gen)
        out = torch.zeros(V, dtype=torch.float64)
        res = residual_law(p, q)
        for y in range(V):
            a = acceptance_prob(p[y], q[y])
            out[y] += q[y] * a
            out += q[y] * (1 - a) * res
        torch.testing.assert_close(out, p, rtol=0, atol=1e-12)


@pytest.mark.parametrize("V", [2, 3, 4])
def test_two_position_joint_law_is_target_law(V):
    """Drafts y1 ~ q1, y2 ~ q2 (independent, as DFlash drafts in parallel); target laws p0,
    p1(.|x0). The first token's law is p0 and, given the first token was an accepted draft
    x0, the second token's law is p1(.|x0)."""
    gen = torch.Generator().manual_seed(10 + V)
    p0, q1, q2 = _law(V, gen), _law(V, gen), _law(V, gen)
    p1 = {x: _law(V, gen) for x in range(V)}
    first = torch.zeros(V, dtype=torch.float64)
    second = torch.zeros(V, V, dtype=torch.float64)  # [x0, x1] mass where x0 was an accepted draft
    acc_first = torch.zeros(V, dtype=torch.float64)
    for y1, y2 in itertools.product(range(V), repeat=2):
        w = q1[y1] * q2[y2]
        a1 = acceptance_prob(p0[y1], q1[y1])
        first[y1] += w * a1
        first += w * (1 - a1) * residual_law(p0, q1)
        acc_first[y1] += w * a1
        a2 = acceptance_prob(p1[y1][y2], q2[y2])
        second[y1, y2] += w * a1 * a2
        second[y1] += w * a1 * (1 - a2) * residual_law(p1[y1], q2)
    torch.testing.assert_close(first, p0, rtol=0, atol=1e-12)
    for x0 in range(V):
        torch.testing.assert_close(second[x0] / acc_first[x0], p1[x0], rtol=0, atol=1e-12)


def test_residual_when_p_equals_q_is_p():
    p = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    torch.testing.assert_close(residual_law(p, p.clone()), p)


def test_speculative_accept_samples_the_target_law():
    """Monte Carlo through the real sampler: many rows of the same (p, q)."""
    V, N = 4, 200_000
    gen = torch.Generator().manual_seed(0)
    p0, q1, q2 = _law(V, gen), _law(V, gen), _law(V, gen)
    p1 = torch.stack([_law(V, gen) for _ in range(V)])  # p1[x0]
    y1 = torch.multinomial(q1, N, replacement=True, generator=gen)
    y2 = torch.multinomial(q2, N, replacement=True, generator=gen)
    draft = torch.stack([y1, y2], 1)
    p = torch.stack([p0.expand(N, V), p1[y1], _law(V, gen).expand(N, V)], 1)
    q = torch.stack([q1.expand(N, V), q2.expand(N, V)], 1)
    n, toks = speculative_accept(draft, q, p, gen)
    freq = torch.bincount(toks[:, 0], minlength=V).double() / N
    sigma = (p0 * (1 - p0) / N).sqrt()
    assert ((freq - p0).abs() < 5 * sigma + 1e-4).all(), (freq, p0)
    # second token given an accepted first draft x0
    for x0 in range(V):
        rows = (n >= 1) & (toks[:, 0] == x0)
        f = torch.bincount(toks[rows, 1], minlength=V).double() / rows.sum()
        s = (p1[x0] * (1 - p1[x0]) / rows.sum()).sqrt()
        assert ((f - p1[x0]).abs() < 5 * s + 1e-3).all(), (x0, f, p1[x0])


def test_deterministic_proposals_never_accept_impossible_tokens():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]]], dtype=torch.float64)
    draft = torch.tensor([[0]])
    for seed in range(50):
        n, toks = speculative_accept(draft, None, p, torch.Generator().manual_seed(seed))
        assert n.item() == 0 and toks[0, 0].item() == 1


def test_sampling_transforms():
    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.0]]])
    g = probs_from_logits(logits, [SamplingParams()])
    assert g[0, 0].tolist() == [1.0, 0.0, 0.0, 0.0]
    k2 = probs_from_logits(logits, [SamplingParams(temperature=1.0, top_k=2)])[0, 0]
    assert (k2[2:] == 0).all() and abs(k2.sum().item() - 1) < 1e-12
    full = torch.softmax(logits[0, 0].double(), -1)
    torch.testing.assert_close(k2[:2], full[:2] / full[:2].sum())
    # top_p keeps the smallest prefix reaching the mass: full[0] ~ 0.64 < 0.7 -> two tokens
    p7 = probs_from_logits(logits, [SamplingParams(temperature=1.0, top_p=0.7)])[0, 0]
    assert (p7 > 0).tolist() == [True, True, False, False]
    tiny_p = probs_from_logits(logits, [SamplingParams(temperature=1.0, top_p=1e-6)])[0, 0]
    assert tiny_p.tolist() == [1.0, 0.0, 0.0, 0.0]
    hot = probs_from_logits(logits, [SamplingParams(temperature=2.0)])[0, 0]
    torch.testing.assert_close(hot, torch.softmax(logits[0, 0].double() / 2, -1))
    mixed = probs_from_logits(logits.expand(2, 1, 4), [SamplingParams(), SamplingParams(temperature=1.0)])
    assert mixed[0, 0, 0] == 1 and mixed[1, 0, 0] < 1
    assert sample(g).item() == 0


@pytest.mark.parametrize("kw, field", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                       ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k")])
def test_sampling_params_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)
