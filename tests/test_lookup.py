"""Prompt lookup and the lookup + DFlash hybrid: the index finds what a brute-force search
finds, and the engine stays exact (greedy identity, the target's law under sampling) when
blocks come from either source, or both."""

import random

import pytest
import torch

from specdec.engine import Engine, Request
from specdec.lookup import NgramIndex
from specdec.proposers import DFlashProposer, HybridProposer, LookupProposer
from specdec.sampling import SamplingParams
from specdec.tiny import random_drafter
from tests.test_engine import NO_STOP, PROMPTS, ar_reference, joint_law_pvalue

pytestmark = pytest.mark.unit

# prompts that repeat themselves, so lookups fire from the first cycle on
REPEATING = [[1, 5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [1, 10, 11, 12, 10, 11], PROMPTS[2], [1, 40, 41, 40]]


def brute_force_lookup(seq: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: longest suffix n-gram first, its latest occurrence that is not the
    suffix itself, the k tokens after it."""
    for n in range(min(max_n, len(seq)), min_n - 1, -1):
        suffix = seq[-n:]
        for i in range(len(seq) - n - 1, -1, -1):
            if seq[i:i + n] == suffix:
                return seq[i + n:i + n + k]
    return []


@pytest.mark.parametrize("min_n,max_n", [(1, 3), (2, 4), (3, 3)])
def test_index_equals_brute_force_while_growing(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for trial in range(30):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
        index = NgramIndex(list(seq), min_n, max_n)
        for _ in range(40):
            k = rng.randrange(1, 9)
            assert index.lookup(k) == brute_force_lookup(seq, k, min_n, max_n), (seq, k)
            new = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
            seq += new
            index.extend(new)


def test_index_prefers_longest_then_latest_and_never_matches_its_own_suffix():
    assert NgramIndex([7, 8, 9]).lookup(4) == []  # the suffix (8, 9) only occurs as itself
    assert NgramIndex([1, 2, 3, 9, 2, 3, 4, 2, 3], max_n=4).lookup(2) == [4, 2]  # latest (2, 3)
    # (1, 2, 3) beats the later (2, 3): the longer match wins
    assert NgramIndex([1, 2, 3, 5, 6, 2, 3, 7, 1, 2, 3], max_n=4).lookup(2) == [5, 6]
    assert NgramIndex([4, 4, 4]).lookup(3) == [4]  # overlapping occurrences are fine


@pytest.mark.parametrize("batch", [1, 4])
def test_lookup_alone_is_greedy_exact_and_drafts_variable_lengths(tiny, batch):
    t = tiny("llama")
    ref = ar_reference(t, REPEATING, 30)
    eng = Engine(t, LookupProposer(), width=8)
    if batch == 1:
        res = [eng.generate([Request(p, 30, stop_ids=NO_STOP)])[0] for p in REPEATING]
    else:
        res = eng.generate([Request(p, 30, stop_ids=NO_STOP) for p in REPEATING])
    assert [r.tokens for r in res] == ref
    assert any(a > 0 for r in res for a in r.stats.accepted), "the repeating prompts should be matched"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [1, 4])
def test_hybrid_is_greedy_exact_with_both_sources(tiny, family, batch):
    t = tiny(family)
    prompts = REPEATING + PROMPTS[:2]
    ref = ar_reference(t, prompts, 32)
    prop = HybridProposer(DFlashProposer(random_drafter(t, block_size=4), t), block_size=4)
    eng = Engine(t, prop, width=8)
    if batch == 1:
        got = [eng.generate([Request(p, 32, stop_ids=NO_STOP)])[0].tokens for p in prompts]
    else:
        got = [r.tokens for r in eng.generate([Request(p, 32, stop_ids=NO_STOP) for p in prompts])]
    assert got == ref
    assert prop.tally["lookup"] and prop.tally["dflash"], "both sources should have drafted"


def test_hybrid_drafter_context_stays_complete_through_lookup_cycles(tiny):
    """Cycles drafted by lookup skip the drafter; its context cache must still hold every
    committed position when it drafts again (equal to a fresh computation)."""
    from specdec import kvcache

    t = tiny("llama")
    drafter = random_drafter(t, block_size=4)
    prop = HybridProposer(DFlashProposer(drafter, t, max_pending=3), block_size=4)
    eng = Engine(t, prop, width=8)
    eng.add([Request(p, 40, stop_ids=NO_STOP) for p in REPEATING[:2]])
    for _ in range(6):
        eng.step()
    assert prop.tally["lookup"], "lookup should have drafted some cycles"
    prop.dflash.flush()
    for b, row in enumerate(eng.rows):
        ids = torch.tensor([row.request.prompt + row.tokens[:-1]])
        out = t(ids, torch.arange(ids.shape[1])[None], None, None, prop.layer_ids)
        want = drafter.context_kv(out.features, torch.arange(ids.shape[1])[None])
        for (wk, wv), (gk, gv) in zip(want, kvcache.row_kv(prop.dflash.cache, b, int(prop.dflash.lens[b]))):
            torch.testing.assert_close(gk, wk[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(gv, wv[0], atol=1e-4, rtol=1e-4)


def test_hybrid_q_is_one_hot_on_lookup_positions_and_the_drafters_law_elsewhere(tiny):
    """A row whose lookup continuation is shorter than the block keeps the drafter's tokens
    and laws after it; every lookup position is certain (q one-hot on its token)."""
    t = tiny("llama", vocab_size=12)
    params = SamplingParams(temperature=1.0)
    drafter = random_drafter(t, block_size=6)
    prop = HybridProposer(DFlashProposer(drafter, t), block_size=6)
    eng = Engine(t, prop, width=6, seed=0)
    # row 0 will end in (2, 3), seen once before and followed by 4, 2, 3: a 3-token lookup
    eng.add([Request([1, 2, 3, 4, 2], 20, params=params, stop_ids=NO_STOP),
             Request([1, 5, 6, 7], 20, params=params, stop_ids=NO_STOP)])
    eng.anchors[:] = torch.tensor([3, 8])  # the token each row emitted last, as the index sees it
    for row, a in zip(eng.rows, (3, 8)):
        row.tokens[-1] = a
    draft, q = prop.propose(eng, 5)
    assert prop.proposed == [("lookup", 3), ("dflash", 5)]
    c = prop.lookup.index[0].lookup(5)
    assert len(c) < 5 and draft[0, :len(c)].tolist() == c
    for j, tok in enumerate(c):
        assert q[0, j, tok] == 1 and q[0, j].sum() == 1
    assert torch.allclose(q[0, len(c):].sum(-1), torch.ones(5 - len(c), dtype=q.dtype))
    assert (q[0, len(c):] < 1).all(), "positions after the lookup keep the drafter's law"
    assert (q[1] < 1).all()


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4)])
def test_hybrid_sampling_follows_target_law(tiny, params):
    """Chi-square of (x1, x2) against the target's exact joint law: whether the x2 cycle is
    drafted by lookup or by the drafter depends on x1, so both sources are exercised, in
    one batch (rows of both kinds in one verify pass)."""
    t = tiny("llama", vocab_size=12)
    prompt = [1, 9, 3, 5, 9, 4, 6, 9, 7, 2, 9]  # x1 in {3, 4, 7} makes the suffix (9, x1) seen before
    N = 6000
    prop = HybridProposer(DFlashProposer(random_drafter(t, block_size=4), t), block_size=4)
    eng = Engine(t, prop, width=4, seed=4321)
    res = eng.generate([Request(prompt, 3, params=params, stop_ids=NO_STOP) for _ in range(N)])
    assert joint_law_pvalue(t, prompt, params, res)[0] > 1e-3
    assert len(prop.tally["lookup"]) > 100 and len(prop.tally["dflash"]) > 100
    if params.top_k == 0:  # (under top-k the tokens this prompt's lookups propose may be excluded)
        assert sum(prop.tally["lookup"]) > 0, "some lookup drafts should be accepted"
