"""Sliding-window draft attention: training masks, the engine's bounded cache and the
checkpoint agree on one rule (a query at position i sees context positions j > i - W),
and the engine stays exact with windowed drafters."""

import json
from types import SimpleNamespace

import pytest
import torch

from specdec import kvcache
from specdec.checkpoint import load_drafter, save_drafter
from specdec.checkpoint_format import FULL, SLIDING
from specdec.engine import Engine, Request
from specdec.objective import block_mask_dense, block_mask_flex, sample_blocks
from specdec.proposers import DFlashProposer
from specdec.sampling import GREEDY, SamplingParams
from specdec.tiny import random_drafter
from tests.test_engine import NO_STOP, PROMPTS, ar_reference, test_sampling_follows_target_law_through_engine

pytestmark = pytest.mark.unit


def _batch(T=60, Bsz=2, prompt=8):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (Bsz, T), generator=g)
    lengths = torch.tensor([T, T - 9])[:Bsz]
    lm = torch.zeros(Bsz, T, dtype=torch.long)
    for b in range(Bsz):
        lm[b, prompt: lengths[b]] = 1
    return ids, lm, lengths


@pytest.mark.parametrize("window", [4, 7, 20])
def test_windowed_training_mask_brute_force(window):
    ids, lm, lengths = _batch()
    B, T = 4, ids.shape[1]
    blocks = sample_blocks(ids, lm, lengths, B, 8, torch.Generator().manual_seed(1))
    mask = block_mask_dense(blocks.anchors, blocks.valid, T, B, window)[:, 0]
    Bsz, N = blocks.anchors.shape
    for b in range(Bsz):
        for q in range(N * B):
            j, i = divmod(q, B)
            a = int(blocks.anchors[b, j])
            for kv in range(T + N * B):
                if kv < T:  # context: before the anchor, and within the query's window
                    expected = bool(blocks.valid[b, j]) and kv < a and (a + i) - kv < window
                else:
                    expected = (kv - T) // B == j
                assert bool(mask[b, q, kv]) == expected, (b, q, kv)


def test_windowed_flex_mask_equals_dense_mask():
    from torch.nn.attention.flex_attention import create_mask

    ids, lm, lengths = _batch()
    blocks = sample_blocks(ids, lm, lengths, 4, 5, torch.Generator().manual_seed(3))
    T = ids.shape[1]
    dense = block_mask_dense(blocks.anchors, blocks.valid, T, 4, window=9)
    bm = block_mask_flex(blocks.anchors, blocks.valid, T, 4, window=9)
    assert torch.equal(create_mask(bm.mask_mod, 2, 1, 20, T + 20, device="cpu"), dense)


def test_engine_mask_follows_the_same_rule():
    lens = torch.tensor([5, 9])
    m = kvcache.attention_mask(lens, past=9, q_len=3, causal=False, window=4)[:, 0]
    for b, n in enumerate(lens.tolist()):
        for i in range(3):
            for s in range(9):
                assert bool(m[b, i, s]) == (s < n and (n + i) - s < 4), (b, i, s)
            assert bool(m[b, i, 9:].all())  # the block sees itself whole


def _windowed(t, window=6, block=4, kinds=None):
    return random_drafter(t, block_size=block, sliding_window=window, layer_types=kinds)


def _block_hidden_training(t, d, feats, ids, anchor, k):
    """The drafter's hidden states for the block at ``anchor``, in training's layout."""
    T = anchor  # context = everything before the anchor (what inference has committed)
    anchors, valid = torch.tensor([[anchor]]), torch.tensor([[True]])
    masks = d.layer_masks(lambda w: block_mask_dense(anchors, valid, T, k, w))
    block = torch.full((1, k), d.config.mask_token_id)
    block[0, 0] = ids[0, anchor]
    return block, d(t.embed(block), torch.arange(anchor, anchor + k)[None], d.context_kv(feats[:, :T], torch.arange(T)[None]),
                    masks)


@pytest.mark.parametrize("kinds", [None, [SLIDING, FULL]])
def test_engine_drafts_what_training_trains(tiny, kinds):
    """A block drafted by the engine after it trimmed its window cache has the same hidden
    states as the same block in training's layout over the full context."""
    t = tiny("llama")
    d = _windowed(t, window=6, block=4, kinds=kinds)
    ids = torch.randint(4, 100, (1, 40), generator=torch.Generator().manual_seed(5))
    feats = t(ids, torch.arange(40)[None], None, None, d.config.target_layer_ids).features
    anchor, k = 33, 4
    embed_block, want = _block_hidden_training(t, d, feats, ids, anchor, k)
    prop = DFlashProposer(d, t, max_pending=2)
    rows = [SimpleNamespace(request=SimpleNamespace(params=GREEDY))]
    prop.admit(None, rows, feats[:, :20], torch.tensor([20]))
    for start in range(20, anchor, 3):  # commit the rest a few positions at a time
        n = min(3, anchor - start)
        prop.commit(feats[:, start:start + n], torch.tensor([n]))
    prop.flush()
    if kinds is None:  # every layer slides: only the last W - 1 positions are kept
        assert int(prop.lens[0]) <= 5 + prop.slack and int(prop.base[0] + prop.lens[0]) == anchor
    else:
        assert int(prop.lens[0]) == anchor
    seen = {}
    hook = d.norm.register_forward_hook(lambda m, i, o: seen.setdefault("h", o))
    try:
        prop.propose(SimpleNamespace(rows=rows, anchors=embed_block[:, 0]), k - 1)
    finally:
        hook.remove()
    torch.testing.assert_close(seen["h"], want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kinds", [None, [FULL, SLIDING]])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_exact_with_windowed_drafter(tiny, kinds, batch):
    t = tiny("qwen3")
    ref = ar_reference(t, PROMPTS, 48)
    eng = Engine(t, DFlashProposer(_windowed(t, window=8, block=8, kinds=kinds), t), width=8)
    if batch == 1:
        got = [eng.generate([Request(p, 48, stop_ids=NO_STOP)])[0].tokens for p in PROMPTS]
    else:
        got = [r.tokens for r in eng.generate([Request(p, 48, stop_ids=NO_STOP) for p in PROMPTS])]
    assert got == ref


def test_windowed_cache_stays_bounded_and_equals_recomputed_context(tiny):
    t = tiny("llama")
    d = _windowed(t, window=8, block=4)
    prop = DFlashProposer(d, t, max_pending=3)
    eng = Engine(t, prop, width=4, seed=0)
    eng.add([Request(p, 120, stop_ids=NO_STOP) for p in PROMPTS[:2]])
    sizes = []
    for k in (1, 4, 2, 1, 4, 3) * 8:
        eng.step(k)
        sizes.append(kvcache.physical_len(prop.cache))
    prop.flush()
    assert max(sizes) <= 7 + prop.slack + 8  # W - 1 kept, trimmed once slack + a flush accumulate
    assert (prop.base + prop.lens).tolist() == eng.lens.tolist() and int(prop.base.min()) > 0
    for b, row in enumerate(eng.rows):
        ids = torch.tensor([row.request.prompt + row.tokens[:-1]])
        out = t(ids, torch.arange(ids.shape[1])[None], None, None, prop.layer_ids)
        want = d.context_kv(out.features, torch.arange(ids.shape[1])[None])
        lo, n = int(prop.base[b]), int(prop.lens[b])
        for (wk, wv), (gk, gv) in zip(want, kvcache.row_kv(prop.cache, b, n)):
            torch.testing.assert_close(gk, wk[0, :, lo:lo + n], atol=1e-8, rtol=1e-8)
            torch.testing.assert_close(gv, wv[0, :, lo:lo + n], atol=1e-8, rtol=1e-8)


def test_sampling_law_with_windowed_drafter(tiny, monkeypatch):
    """The chi-square test of the target's law, with a drafter whose window cuts the prompt."""
    import specdec.tiny

    real = specdec.tiny.random_drafter
    monkeypatch.setattr("tests.test_engine.random_drafter",
                        lambda target, block_size=8, **kw: real(target, block_size=block_size, sliding_window=4, **kw))
    test_sampling_follows_target_law_through_engine(tiny, SamplingParams(temperature=1.0), None)


def test_windowed_checkpoint_round_trip_in_published_layout(tmp_path, tiny):
    t = tiny("llama")
    d = _windowed(t, window=64, block=8, kinds=[SLIDING, FULL])
    save_drafter(d, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["layer_types"] == [SLIDING, FULL] and cfg["sliding_window"] == 64
    assert cfg["dflash_config"]["causal"] is False  # else vLLM would run the sliding layer causally
    back = load_drafter(tmp_path / "d", target=t)
    assert back.config.layer_windows == [64, None]
    # vLLM's other spelling: use_swa + swa_window_size, every layer sliding
    cfg.pop("sliding_window")
    cfg["layer_types"] = [FULL, FULL]
    cfg["dflash_config"].update(use_swa=True, swa_window_size=32)
    cfg["dflash_config"].pop("causal")
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    assert load_drafter(tmp_path / "d", target=t).config.layer_windows == [32, 32]


@pytest.mark.parametrize("kw, match", [
    ({"sliding_window": 3}, "sliding_window: expected an int >= block_size"),
    ({"sliding_window": 10**7}, "sliding_window: 10000000 is larger than the context"),
    ({"layer_types": [SLIDING, FULL]}, "sliding_window: layer_types has 'sliding_attention'"),
    ({"layer_types": [FULL], "sliding_window": 16}, "layer_types: expected 2 entries"),
])
def test_bad_windows_are_refused_naming_the_field(tiny, kw, match):
    with pytest.raises(ValueError, match=match):
        random_drafter(tiny("llama"), block_size=8, **kw)
