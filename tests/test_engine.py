"""The engine's promises: greedy output is token-identical to the target alone for ANY
drafter, sampling follows the target's law, and caches keep no rejected state."""

import pytest
import torch
from scipy.stats import chisquare

from specdec import kvcache
from specdec.engine import Engine, Request
from specdec.proposers import DFlashProposer, OracleProposer
from specdec.sampling import SamplingParams
from specdec.tiny import random_drafter

pytestmark = pytest.mark.unit

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 10, 11], [1, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [1, 40]]
NO_STOP = frozenset()


def ar_reference(target, prompts, n):
    """The target alone, one prompt at a time."""
    return [Engine(target).generate([Request(p, n, stop_ids=NO_STOP)])[0].tokens for p in prompts]


class NoisyOracle(OracleProposer):
    """Proposes the true continuation with random corruptions: every acceptance length."""

    def __init__(self, p_wrong=0.3, seed=0):
        self.p_wrong, self.gen = p_wrong, torch.Generator().manual_seed(seed)

    def propose(self, engine, k):
        draft, _ = super().propose(engine, k)
        wrong = torch.rand(draft.shape, generator=self.gen) < self.p_wrong
        return torch.where(wrong, (draft + 1) % engine.target.vocab_size, draft), None


class DrafterWithNoisyOracleTokens(DFlashProposer):
    """Runs the real drafter (so its caches evolve) but emits noisy-oracle tokens, so that
    acceptance lengths vary and the draft cache is tested across them."""

    def __init__(self, drafter, target, seed=0):
        super().__init__(drafter, target)
        self.noisy = NoisyOracle(seed=seed)

    def propose(self, engine, k):
        super().propose(engine, k)
        return self.noisy.propose(engine, k)


def test_ar_matches_hf_generate(tiny):
    t = tiny("llama")
    for p in PROMPTS[:2]:
        hf = t.model.generate(torch.tensor([p]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        ours = Engine(t).generate([Request(p, 20, stop_ids=NO_STOP)])[0].tokens
        assert ours == hf


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral", "gemma"])
@pytest.mark.parametrize("block", [2, 8, 16])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_exact_with_random_drafter(tiny, family, block, batch):
    t = tiny(family)
    ref = ar_reference(t, PROMPTS, 24)
    eng = Engine(t, DFlashProposer(random_drafter(t, block_size=16), t), width=block)
    if batch == 1:
        got = [eng.generate([Request(p, 24, stop_ids=NO_STOP)])[0].tokens for p in PROMPTS]
    else:
        got = [r.tokens for r in eng.generate([Request(p, 24, stop_ids=NO_STOP) for p in PROMPTS])]
    assert got == ref


@pytest.mark.parametrize("block", [2, 8, 16])
def test_greedy_exact_across_acceptance_lengths(tiny, block):
    t = tiny("qwen3")
    ref = ar_reference(t, PROMPTS, 40)
    reqs = [Request(p, 40, stop_ids=NO_STOP, oracle=r) for p, r in zip(PROMPTS, ref)]
    res = Engine(t, DrafterWithNoisyOracleTokens(random_drafter(t), t), width=block).generate(reqs)
    assert [r.tokens for r in res] == ref
    accepted = [a for r in res for a in r.stats.accepted]
    assert len(set(accepted)) >= min(3, block), "noisy oracle should produce several acceptance lengths"


def test_oracle_accepts_whole_blocks(tiny):
    t = tiny("llama")
    ref = ar_reference(t, PROMPTS, 33)
    reqs = [Request(p, 33, stop_ids=NO_STOP, oracle=r) for p, r in zip(PROMPTS, ref)]
    res = Engine(t, OracleProposer(), width=8).generate(reqs)
    assert [r.tokens for r in res] == ref
    for r in res:  # 1 token from prefill, then 4 full cycles of 8
        assert r.stats.accepted == [7, 7, 7, 7] and r.stats.tau == 8.0


def test_caches_equal_fresh_prefill_after_rejections(tiny):
    t = tiny("llama")
    ref = ar_reference(t, PROMPTS, 30)
    drafter = random_drafter(t)
    prop = DrafterWithNoisyOracleTokens(drafter, t, seed=3)
    eng = Engine(t, prop, width=8)
    eng.add([Request(p, 30, stop_ids=NO_STOP, oracle=r) for p, r in zip(PROMPTS, ref)])
    for _ in range(3):
        eng.step()
    prop.flush()  # pending accepted features enter the draft cache
    assert any(a < 7 for row in eng.rows for a in row.stats.accepted), "need rejections"
    for b, row in enumerate(eng.rows):
        committed = row.request.prompt + row.tokens[:-1]  # the last token is the pending anchor
        L = len(committed)
        assert eng.lens[b].item() == L and prop.lens[b].item() == L
        fresh = kvcache.DynamicCache()
        ids = torch.tensor([committed])
        out = t(ids, torch.arange(L)[None], fresh, kvcache.attention_mask(torch.tensor([L]), 0, L, True),
                drafter.config.target_layer_ids)
        for (k, v), layer in zip(kvcache.row_kv(eng.cache, b, L), fresh.layers):
            torch.testing.assert_close(k, layer.keys[0], rtol=0, atol=1e-10)
            torch.testing.assert_close(v, layer.values[0], rtol=0, atol=1e-10)
        fresh_ctx = drafter.context_kv(out.features, torch.arange(L)[None])
        for (k, v), (fk, fv) in zip(kvcache.row_kv(prop.cache, b, L), fresh_ctx):
            torch.testing.assert_close(k, fk[0], rtol=0, atol=1e-10)
            torch.testing.assert_close(v, fv[0], rtol=0, atol=1e-10)
        # and no slot beyond the longest row survives
        assert kvcache.physical_len(eng.cache) == int(eng.lens.max())


def _target_joint_law(t, prompt, temp_params):
    """Exact law of the first two generated tokens under the target alone."""
    from specdec.sampling import probs_from_logits

    V = t.vocab_size
    ids = torch.tensor([prompt])
    h = t(ids, torch.arange(len(prompt))[None]).hidden
    p1 = probs_from_logits(t.logits(h[:, -1:]), [temp_params])[0, 0]
    seqs = torch.cat([ids.expand(V, -1), torch.arange(V)[:, None]], 1)
    h2 = t(seqs, torch.arange(len(prompt) + 1)[None].expand(V, -1)).hidden
    p2 = probs_from_logits(t.logits(h2[:, -1:]), [temp_params] * V)[:, 0]
    return p1[:, None] * p2  # [x1, x2]


def joint_law_pvalue(t, prompt, params, results) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(chi-square p-value, counts, law) of the emitted (x1, x2) pairs against the target's
    exact joint law (rare cells pooled into one bucket); asserts no pair the law excludes
    came out."""
    N = len(results)
    counts = torch.zeros(t.vocab_size, t.vocab_size)
    for r in results:
        counts[r.tokens[0], r.tokens[1]] += 1
    law = _target_joint_law(t, prompt, params).double()
    assert counts[law == 0].sum() == 0, "emitted a token the target law excludes (top-k/top-p)"
    keep = law * N >= 5
    small = (~keep) & (law > 0)
    obs, exp = counts[keep].double(), law[keep] * N
    if small.any():  # pool the rare cells into one bucket
        obs = torch.cat([obs, counts[small].sum()[None].double()])
        exp = torch.cat([exp, (law[small].sum() * N)[None]])
    return chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue, counts, law


@pytest.mark.parametrize("params,draft_vocab", [
    (SamplingParams(temperature=1.0), None), (SamplingParams(temperature=0.7, top_k=6), None),
    (SamplingParams(temperature=1.3, top_p=0.8), None),
    # a reduced draft vocabulary: q = 0 outside it, and the target's law must still come out
    (SamplingParams(temperature=1.0), [0, 2, 3, 5, 7, 8, 11]), (SamplingParams(temperature=0.8, top_k=3), [0, 4, 6, 9]),
])
def test_sampling_follows_target_law_through_engine(tiny, params, draft_vocab):
    """Seeded chi-square of emitted (x1, x2) pairs against the target's exact joint law.
    x1 comes from prefill, x2 from the first speculative cycle (draft + accept/residual)."""
    t = tiny("llama", vocab_size=12)
    prompt = [1, 5, 7, 2, 9]
    drafter = random_drafter(t, block_size=4)
    drafter.set_draft_vocab(draft_vocab)
    N = 6000
    eng = Engine(t, DFlashProposer(drafter, t), width=4, seed=1234)
    # 3 tokens so that the cycle producing x2 drafts (block = min(4, tokens still needed))
    res = eng.generate([Request(prompt, 3, params=params, stop_ids=NO_STOP) for _ in range(N)])
    pvalue, counts, law = joint_law_pvalue(t, prompt, params, res)
    assert pvalue > 1e-3, pvalue
    # x2 went through draft + accept/residual in most rows
    assert sum(a for r in res for a in r.stats.accepted) > 0, "some drafts should be accepted"
    if draft_vocab is not None:  # tokens outside V_d still come out, through the residual law
        outside = [x for x in range(t.vocab_size) if x not in draft_vocab and law[:, x].sum() * N > 50]
        assert outside and all(counts[:, x].sum() > 0 for x in outside)


def test_chi_square_detects_a_wrong_law(tiny):
    """Guard for the test above: a biased sampler (always accept) is rejected."""
    t = tiny("llama", vocab_size=12)
    params = SamplingParams(temperature=1.0)
    law = _target_joint_law(t, [1, 5, 7, 2, 9], params).float()
    wrong = law.clone()
    wrong[:, 0] *= 1.5
    wrong /= wrong.sum()
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(wrong.flatten(), 6000, replacement=True, generator=gen)
    counts = torch.bincount(draws, minlength=law.numel()).float()
    keep = law.flatten() * 6000 >= 5
    obs, exp = counts[keep], law.flatten()[keep] * 6000
    exp = exp * obs.sum() / exp.sum()
    assert chisquare(obs.numpy(), exp.numpy()).pvalue < 1e-3


def test_stop_tokens_and_limits(tiny):
    t = tiny("llama")
    ref = ar_reference(t, PROMPTS[:1], 20)[0]
    stop = ref[5]
    first = ref.index(stop)
    eng = Engine(t, DFlashProposer(random_drafter(t), t), width=8)
    r = eng.generate([Request(PROMPTS[0], 20, stop_ids=frozenset({stop}))])[0]
    assert r.tokens == ref[: first + 1] and r.finish_reason == "stop"
    r = eng.generate([Request(PROMPTS[0], 7, stop_ids=NO_STOP)])[0]
    assert r.tokens == ref[:7] and r.finish_reason == "length"
    # context limit: the tiny target has 512 positions
    long_prompt = [1] + list(range(4, 100)) * 5
    r = eng.generate([Request(long_prompt[:505], 50, stop_ids=NO_STOP)])[0]
    assert len(long_prompt[:505]) + len(r.tokens) == 512 and r.finish_reason == "length"
    with pytest.raises(ValueError, match="context length"):
        eng.generate([Request([1] * 600, 5)])


def test_continuous_batching_joins_and_cancels(tiny):
    t = tiny("qwen3")
    ref = ar_reference(t, PROMPTS, 30)
    eng = Engine(t, DFlashProposer(random_drafter(t), t), width=4)
    reqs = [Request(p, 30, stop_ids=NO_STOP) for p in PROMPTS]
    done = eng.add(reqs[:2])
    for _ in range(3):
        done += eng.step()
    done += eng.add(reqs[2:])
    cancelled = eng.cancel(reqs[1])
    assert cancelled.finish_reason == "cancelled" and len(eng.rows) == 3
    while eng.rows:
        done += eng.step()
    by_req = {id(r.request): r.tokens for r in done}
    for i in (0, 2, 3):
        assert by_req[id(reqs[i])] == ref[i]


def test_drafter_context_stays_complete_across_ar_and_speculative_steps(tiny):
    """Steps with speculation off (k = 1) still feed the drafter's context cache (batched
    every max_pending positions): after any mix of block sizes, and a row joining
    mid-stream, the cache equals the context computed from scratch."""
    t = tiny("llama")
    drafter = random_drafter(t, block_size=8)
    prop = DFlashProposer(drafter, t, max_pending=3)
    engine = Engine(t, prop, width=8, seed=0)
    engine.add([Request(p, 200, stop_ids=NO_STOP) for p in PROMPTS[:2]])
    for k in (1, 1, 4, 1, 1, 1, 1, 1, 8, 1, 2, 1, 1):
        engine.step(k)
        assert engine.last_cycle.k == k and engine.last_cycle.verify_s > 0
    assert int(prop.pending_n.max()) < 3  # AR steps' features wait at most max_pending steps
    engine.add([Request(PROMPTS[2], 200, stop_ids=NO_STOP)])  # joins while live rows hold pending features
    for k in (1, 3, 1, 1, 1):
        engine.step(k)
    prop.flush()
    assert len(engine.rows) == 3 and prop.lens.tolist() == engine.lens.tolist()
    for b, row in enumerate(engine.rows):
        ids = torch.tensor([row.request.prompt + row.tokens[:-1]])  # all but the anchor is committed
        assert ids.shape[1] == int(engine.lens[b])
        out = t(ids, torch.arange(ids.shape[1])[None], None, None, prop.layer_ids)
        want = drafter.context_kv(out.features, torch.arange(ids.shape[1])[None])
        got = kvcache.row_kv(prop.cache, b, int(prop.lens[b]))
        for (wk, wv), (gk, gv) in zip(want, got):
            torch.testing.assert_close(gk, wk[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(gv, wv[0], atol=1e-4, rtol=1e-4)


def test_cycle_times_add_up_per_row(tiny):
    """Each row's stats are the sum of the cycles it ran (one clock, no per-row drift)."""
    t = tiny("llama")
    eng = Engine(t, DFlashProposer(random_drafter(t), t), width=4)
    eng.add([Request(p, 9, stop_ids=NO_STOP) for p in PROMPTS[:2]])
    draft = verify = 0.0
    while eng.rows:
        eng.step()
        draft, verify = draft + eng.last_cycle.draft_s, verify + eng.last_cycle.verify_s
        last = eng.rows[0].stats if eng.rows else None
        if last is not None:
            assert last.draft_s == pytest.approx(draft) and last.verify_s == pytest.approx(verify)
            assert last.cycles == len(last.accepted)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_feature_recorder_equals_a_teacher_forced_pass(tiny, family):
    """Features kept while decoding a ragged batch (rows finishing at different steps) are
    the teacher-forced features of prompt + completion; only the last token has none."""
    from pipelines.features.target_pass import FeatureRecorder

    t = tiny(family)
    layers = [0, t.num_layers // 2, t.num_layers - 1]
    rec = FeatureRecorder(layers)
    reqs = [Request(p, n, stop_ids=NO_STOP) for p, n in zip(PROMPTS, [7, 1, 12, 4])]
    results = Engine(t, rec, width=1).generate(reqs)
    assert [r.tokens for r in results] == [ar_reference(t, [r.request.prompt], len(r.tokens))[0] for r in results]
    for r in results:
        seq = r.request.prompt + r.tokens
        got = rec.features(r)
        assert got.shape == (len(seq), len(layers) * t.hidden_size)
        ids = torch.tensor([seq])
        want = t(ids, torch.arange(len(seq))[None], None, None, layers).features[0]
        torch.testing.assert_close(got[:-1], want[:-1], rtol=1e-9, atol=1e-9)
        assert not got[-1].any()
    assert not rec.done and not rec.live  # every row handed out once
    with pytest.raises(RuntimeError, match="block_size=1"):
        Engine(t, FeatureRecorder(layers), width=4).generate([Request(PROMPTS[0], 3, stop_ids=NO_STOP)])
