"""Training objective: who may see what, the loss weights, and that training learns."""

import math

import pytest
import torch

from specdec.draft_vocab import head_for
from specdec.engine import Engine, Request
from specdec.proposers import DFlashProposer
from specdec.objective import (block_hidden, block_mask_dense, block_mask_flex, default_lambda, dflash_loss,
                               loss_weights, sample_blocks)
from specdec.tiny import random_drafter

pytestmark = pytest.mark.unit


def _batch(T=40, Bsz=2, prompt=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 100, (Bsz, T), generator=g)
    lengths = torch.tensor([T, T - 7])[:Bsz]
    lm = torch.zeros(Bsz, T, dtype=torch.long)
    for b in range(Bsz):
        lm[b, prompt: lengths[b]] = 1
    return ids, lm, lengths


def test_mask_brute_force():
    """No block sees a context position at or after its anchor, nor another block."""
    ids, lm, lengths = _batch()
    B, T = 4, ids.shape[1]
    blocks = sample_blocks(ids, lm, lengths, B, 6, torch.Generator().manual_seed(1))
    mask = block_mask_dense(blocks.anchors, blocks.valid, T, B)[:, 0]
    Bsz, N = blocks.anchors.shape
    for b in range(Bsz):
        for q in range(N * B):
            j = q // B
            a = int(blocks.anchors[b, j])
            for kv in range(T + N * B):
                if kv < T:
                    expected = bool(blocks.valid[b, j]) and kv < a
                else:
                    expected = (kv - T) // B == j
                assert bool(mask[b, q, kv]) == expected, (b, q, kv)


def test_anchors_are_distinct_response_positions():
    ids, lm, lengths = _batch()
    blocks = sample_blocks(ids, lm, lengths, 4, 100, torch.Generator().manual_seed(2))
    for b in range(2):
        a = blocks.anchors[b][blocks.valid[b]].tolist()
        assert len(a) == len(set(a)) and a == sorted(a)
        assert all(lm[b, x + 1] == 1 and 1 <= x < lengths[b] - 1 for x in a)
        # every eligible position is taken when more anchors are asked than exist
        assert len(a) == int(lm[b, 1: lengths[b]].sum())
        for j, x in enumerate(a):
            for k in range(3):
                inside = x + 1 + k < lengths[b]
                assert bool(blocks.label_mask[b, j, k]) == (inside and bool(lm[b, x + 1 + k]))
                if inside:
                    assert blocks.labels[b, j, k] == ids[b, x + 1 + k]


def test_context_anchors_add_prompt_blocks_labelled_on_the_prompt():
    ids, lm, lengths = _batch(prompt=20)
    gen = lambda: torch.Generator().manual_seed(4)  # noqa: E731
    resp_only = sample_blocks(ids, lm, lengths, 4, 6, gen())
    both = sample_blocks(ids, lm, lengths, 4, 6, gen(), context_anchors=5)
    for b in range(2):
        a = both.anchors[b][both.valid[b]].tolist()
        assert len(a) == len(set(a)) == 11 and a == sorted(a)
        # the response draw is the same with or without context blocks (same generator first)
        resp = [x for x in a if lm[b, x + 1] == 1]
        assert resp == resp_only.anchors[b][resp_only.valid[b]].tolist()
        ctx = [x for x in a if lm[b, x + 1] == 0]
        assert len(ctx) == 5 and all(1 <= x < 19 for x in ctx)
        for j, x in enumerate(a):
            for k in range(3):
                inside = x + 1 + k < lengths[b]
                # a context block learns every real token after it, prompt or response;
                # a response block the response only
                expected = inside and (x in ctx or bool(lm[b, x + 1 + k]))
                assert bool(both.label_mask[b, j, k]) == expected, (b, x, k)
    # every prompt position is taken when more are asked than exist
    many = sample_blocks(ids, lm, lengths, 4, 1, gen(), context_anchors=100)
    assert int(many.valid.sum()) == 2 * (1 + 18)


def test_context_anchors_train_only(tiny):
    """The drafter module scores prompt blocks while training, never when evaluated."""
    from pipelines.train.data import Batch
    from pipelines.train.runner import DrafterLoss

    target = tiny("llama")
    drafter = random_drafter(target, block_size=4, layers=1).to(target.dtype)
    ids, lm, lengths = _batch(prompt=20)
    feats = torch.randn(2, ids.shape[1], drafter.config.num_features * target.hidden_size, dtype=target.dtype)
    batch = Batch(ids % target.vocab_size, lm.bool(), lengths, feats, ["a", "b"])
    module = DrafterLoss(drafter, target, online=False, lam=None, context_anchors=8)
    n = lambda: module(batch, 3, torch.Generator().manual_seed(0)).n_blocks  # noqa: E731
    assert n() == 2 * (3 + 8)
    module.eval()
    assert n() == 2 * 3


def test_flex_mask_equals_dense_mask():
    from torch.nn.attention.flex_attention import create_mask

    ids, lm, lengths = _batch()
    blocks = sample_blocks(ids, lm, lengths, 4, 5, torch.Generator().manual_seed(3))
    T = ids.shape[1]
    dense = block_mask_dense(blocks.anchors, blocks.valid, T, 4)
    bm = block_mask_flex(blocks.anchors, blocks.valid, T, 4)
    flex_dense = create_mask(bm.mask_mod, 2, 1, 20, T + 20, device="cpu")
    assert torch.equal(flex_dense, dense)


def test_loss_weights():
    w = loss_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0
    torch.testing.assert_close(w[6], torch.tensor(math.exp(-6 / 7)))
    assert default_lambda(16) == 7 and default_lambda(10) == 5 and default_lambda(8) == 4


def test_blocks_do_not_leak_across_each_other(tiny):
    """Changing tokens after an anchor's context cut cannot change that block's logits."""
    t = tiny("llama")
    d = random_drafter(t, block_size=4, layers=1).float()
    ids, lm, lengths = _batch(T=30, Bsz=1)
    feats = torch.randn(1, 30, d.config.num_features * d.config.hidden_size)
    blocks = sample_blocks(ids, lm, lengths, 4, 3, torch.Generator().manual_seed(0))
    T = 30
    mask = block_mask_dense(blocks.anchors, blocks.valid, T, 4)
    x = torch.randn(1, 12, d.config.hidden_size)
    pos = (blocks.anchors[..., None] + torch.arange(4)).flatten(1)
    out = d(x, pos, d.context_kv(feats, torch.arange(T)[None]), mask)
    a0 = int(blocks.anchors[0, 0])
    feats2 = feats.clone()
    feats2[:, a0:] += 1.0  # context at/after the first anchor changes
    x2 = x.clone()
    x2[:, 4:] += 1.0  # other blocks change
    out2 = d(x2, pos, d.context_kv(feats2, torch.arange(T)[None]), mask)
    torch.testing.assert_close(out[:, :4], out2[:, :4])
    assert not torch.allclose(out[:, 4:], out2[:, 4:])


class RecordingProposer(DFlashProposer):
    """The engine's drafter, noting each cycle's anchor position and drafts per request."""

    def __init__(self, drafter, target):
        super().__init__(drafter, target)
        self.seen: dict[int, list[tuple[int, list[int]]]] = {}

    def propose(self, engine, k):
        drafts, q = super().propose(engine, k)
        for b, row in enumerate(engine.rows):
            anchor = len(row.request.prompt) + len(row.tokens) - 1
            self.seen.setdefault(id(row.request), []).append((anchor, drafts[b].tolist()))
        return drafts, q


@pytest.mark.parametrize("window", [None, 6])
def test_training_blocks_draft_what_the_engine_drafts(tiny, window):
    """The objective scores exactly the drafts inference makes: for every cycle the engine
    ran (a ragged batch of three prompts, sliding window or not), the training
    forward anchored at that cycle's position, over the teacher-forced features of the
    final sequence, proposes the same tokens."""
    t = tiny("llama")
    d = random_drafter(t, block_size=4, sliding_window=window)
    prop = RecordingProposer(d, t)
    reqs = [Request(p, 30, stop_ids=frozenset()) for p in ([1, 5, 6, 7, 8, 9], [1, 10, 11], [1, 40, 41, 42])]
    results = Engine(t, prop, width=4, seed=0).generate(reqs)
    head = head_for(d, t)
    checked = 0
    for r in results:
        seq = torch.tensor([r.request.prompt + r.tokens])
        T = seq.shape[1]
        feats = t(seq, torch.arange(T)[None], None, None, list(d.config.target_layer_ids)).features
        cycles = prop.seen[id(r.request)]
        anchors = torch.tensor([[a for a, _ in cycles]])
        hidden = block_hidden(d, t.embed, seq, feats, anchors, torch.ones_like(anchors, dtype=torch.bool))
        drafts = head.to_target(head(hidden).argmax(-1))[0]  # (N, B-1)
        for (a, want), got in zip(cycles, drafts):
            assert got[: len(want)].tolist() == want, f"anchor {a}"
            checked += 1
    assert checked > 30


def test_training_lowers_loss_and_raises_tau(tiny):
    """On a target whose continuation is learnable, a few hundred steps help a lot."""
    t = tiny("llama")
    d = random_drafter(t, block_size=4, layers=1).float().train().requires_grad_(True)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in d.parameters():
            p.mul_(0.1) if p.dim() == 2 else None
    # sequences generated by the (float32 copy of the) target itself, greedy
    from specdec.engine import Engine, Request
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(4, 120, (6,), generator=g).tolist() for _ in range(8)]
    res = Engine(t).generate([Request(p, 24, stop_ids=frozenset()) for p in prompts])
    ids = torch.tensor([p + r.tokens for p, r in zip(prompts, res)])
    lm = torch.zeros_like(ids)
    lm[:, 7:] = 1
    lengths = torch.full((8,), ids.shape[1])
    with torch.no_grad():
        feats = t(ids, torch.arange(ids.shape[1])[None].expand(8, -1), layer_ids=d.config.target_layer_ids).features
    embed = lambda x: t.embed(x).float()  # noqa: E731
    head = lambda h: t.logits(h.double()).float()  # noqa: E731
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    first = dflash_loss(d, embed, head, ids, lm, feats.float(), lengths, 16, generator=gen)
    for _ in range(150):
        out = dflash_loss(d, embed, head, ids, lm, feats.float(), lengths, 16, generator=gen)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    last = dflash_loss(d, embed, head, ids, lm, feats.float(), lengths, 16, generator=gen)
    assert last.loss < 0.5 * first.loss
    assert last.tau > first.tau + 0.5


def _distill_setup(seed=0):
    from specdec.tiny import tiny_target

    t = tiny_target("llama")
    d = random_drafter(t, block_size=4, layers=1).float()
    ids, lm, lengths = _batch(T=24, seed=seed)
    ids = ids % t.vocab_size
    feats = torch.randn(ids.shape[0], ids.shape[1], d.config.num_features * t.hidden_size,
                        generator=torch.Generator().manual_seed(seed))
    embed = lambda x: t.embed(x).float()  # noqa: E731
    head = lambda h: t.logits(h.double()).float()  # noqa: E731
    return t, d, ids, lm, lengths, feats, embed, head


def _loss(d, embed, head, ids, lm, feats, lengths, **kw):
    return dflash_loss(d, embed, head, ids, lm, feats, lengths, 6, generator=torch.Generator().manual_seed(7), **kw)


def test_distill_with_the_labels_as_teacher_is_the_plain_loss():
    """A teacher whose law is the label itself (top-1 = next token, mass 1) changes nothing;
    the teacher row of a label at p is row p - 1 (an off-by-one would score the wrong token)."""
    t, d, ids, lm, lengths, feats, embed, head = _distill_setup()
    K = 3
    t_ids = torch.zeros(*ids.shape, K, dtype=torch.long)
    t_ids[:, :-1, 0] = ids[:, 1:]  # row p-1 holds the token at p
    t_ids[..., 1:] = 5
    t_logp = torch.full((*ids.shape, K), -1e4)
    t_logp[..., 0] = 0.0
    plain = _loss(d, embed, head, ids, lm, feats, lengths)
    for alpha in (0.5, 1.0):
        got = _loss(d, embed, head, ids, lm, feats, lengths, teacher=(t_ids, t_logp), distill=alpha)
        assert torch.allclose(got.loss, plain.loss, atol=1e-5)
    shifted = (t_ids.roll(-1, dims=1), t_logp)  # row p holds the token at p + 1: the wrong rows
    assert not torch.allclose(_loss(d, embed, head, ids, lm, feats, lengths, teacher=shifted, distill=1.0).loss,
                              plain.loss, atol=1e-3)


def test_distill_follows_the_teacher_law_and_the_draft_vocabulary():
    """alpha = 1 is the CE against the renormalised top-K law, computed by hand; ids outside
    the draft vocabulary get no mass, and a position with none left keeps the hard CE."""
    from specdec.objective import teacher_law

    ids = torch.tensor([[3, 7, 9], [4, 8, 2]])
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.6, 0.3, 0.05]]))
    cols, p = teacher_law(ids, logp)
    assert torch.equal(cols, ids)
    assert torch.allclose(p[0], torch.tensor([0.5, 0.2, 0.1]) / 0.8)
    index = torch.full((12,), -1)
    index[torch.tensor([3, 9, 2])] = torch.tensor([0, 1, 2])
    cols, p = teacher_law(ids, logp, index)
    assert torch.allclose(p[0], torch.tensor([0.5, 0.0, 0.1]) / 0.6) and cols[0].tolist() == [0, 0, 1]
    assert torch.allclose(p[1], torch.tensor([0.0, 0.0, 1.0]))
    none = teacher_law(torch.tensor([[7, 8]]), torch.zeros(1, 2), index)[1]
    assert float(none.sum()) == 0.0

    t, d, tok, lm, lengths, feats, embed, head = _distill_setup(seed=1)
    K = 4
    g = torch.Generator().manual_seed(3)
    t_ids = torch.randint(0, t.vocab_size, (*tok.shape, K), generator=g)
    t_logp = torch.log_softmax(torch.randn(*tok.shape, K, generator=g), -1)
    got = _loss(d, embed, head, tok, lm, feats, lengths, teacher=(t_ids, t_logp), distill=1.0)
    # by hand: the same blocks, the soft CE at each labelled position against row p - 1
    blocks = sample_blocks(tok, lm, lengths, 4, 6, torch.Generator().manual_seed(7))
    plain = _loss(d, embed, head, tok, lm, feats, lengths)
    assert plain.n_tokens == got.n_tokens and not torch.allclose(plain.loss, got.loss)
    from specdec.objective import block_mask_dense as bmd
    N = blocks.anchors.shape[1]
    block_ids = torch.full((tok.shape[0], N, 4), d.config.mask_token_id)
    block_ids[:, :, 0] = tok.gather(1, blocks.anchors)
    pos = blocks.anchors[..., None] + torch.arange(4)
    ctx = d.context_kv(feats, torch.arange(tok.shape[1])[None].expand(tok.shape[0], -1))
    mask = bmd(blocks.anchors, blocks.valid, tok.shape[1], 4)
    hidden = d(embed(block_ids.flatten(1)), pos.flatten(1), ctx, mask).view(tok.shape[0], N, 4, -1)[:, :, 1:]
    logq = torch.log_softmax(head(hidden[blocks.label_mask]), -1)
    src = (blocks.anchors[..., None] + torch.arange(3))[blocks.label_mask]
    b_of = torch.arange(tok.shape[0])[:, None, None].expand(-1, N, 3)[blocks.label_mask]
    soft = -(t_logp[b_of, src].exp() / t_logp[b_of, src].exp().sum(-1, keepdim=True)
             * logq.gather(1, t_ids[b_of, src])).sum(-1)
    w = loss_weights(4, default_lambda(4))[None, None].expand(tok.shape[0], N, -1)[blocks.label_mask]
    assert torch.allclose(got.loss, (w * soft).sum() / w.sum(), atol=1e-5)


def test_dropout_only_while_training(tiny):
    """Residual dropout changes training forwards, never evaluation ones (nor the weights)."""
    t = tiny("llama")
    d = random_drafter(t, block_size=4).float()
    x, pos = torch.randn(1, 4, d.config.hidden_size), torch.arange(4)[None] + 6
    ctx = d.context_kv(torch.randn(1, 6, d.config.num_features * d.config.hidden_size), torch.arange(6)[None])
    mask = torch.ones(1, 1, 4, 10, dtype=torch.bool)
    d.eval()
    plain = d(x, pos, ctx, mask)
    d.set_dropout(0.3)
    torch.testing.assert_close(d(x, pos, ctx, mask), plain)  # eval mode: no dropout
    d.train()
    a, b = d(x, pos, ctx, mask), d(x, pos, ctx, mask)
    assert not torch.allclose(a, b) and not torch.allclose(a, plain)
    d.set_dropout(0.0)
    torch.testing.assert_close(d(x, pos, ctx, mask), plain)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        d.set_dropout(1.0)


def test_head_in_chunks_is_exact(monkeypatch):
    """Past HEAD_CHUNK_ROWS labelled rows the draft head runs in recomputed chunks: the loss,
    its gradients and the argmax are those of the one-shot head (with distillation too)."""
    import specdec.objective as objective

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).requires_grad_(False)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    head = head.double()
    labels = torch.randint(-1, 50, (37,))
    cols, p = torch.randint(0, 50, (37, 4)), torch.rand(37, 4, dtype=torch.float64)
    runs = []
    for chunk in (10**9, 8):
        monkeypatch.setattr(objective, "HEAD_CHUNK_ROWS", chunk)
        hidden.grad = None
        ce, top = objective.head_loss(head, hidden, labels, (cols, p / p.sum(-1, keepdim=True)), 0.3)
        ce.sum().backward()
        runs.append((ce.detach(), top, hidden.grad.clone()))
    (ce1, top1, g1), (ce2, top2, g2) = runs
    assert torch.equal(top1, top2) and torch.allclose(ce1, ce2, rtol=0, atol=1e-12)
    assert torch.allclose(g1, g2, rtol=0, atol=1e-12)


def test_compiled_flex_attention_matches_dense_with_grouped_heads():
    """The GPU training path (compiled flex_attention over a BlockMask, GQA read without
    repeating K/V) computes the dense path's loss; CPU flex has no backward, so forward only."""
    from specdec.checkpoint_format import DrafterConfig
    from specdec.drafter import DFlashDrafter

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=100, mask_token_id=99, target_layer_ids=[0, 1], num_target_layers=6,
                        num_hidden_layers=2, block_size=4)
    drafter = DFlashDrafter(cfg)
    embed = torch.nn.Embedding(100, 64).requires_grad_(False)
    head = torch.nn.Linear(64, 100, bias=False).requires_grad_(False)
    ids = torch.randint(0, 98, (2, 64))
    mask = torch.ones(2, 64, dtype=torch.long)
    mask[:, :5] = 0
    feats, lengths = torch.randn(2, 64, 128), torch.tensor([64, 50])
    with torch.no_grad():
        dense, flex = (dflash_loss(drafter, embed, head, ids, mask, feats, lengths, 8,
                                   generator=torch.Generator().manual_seed(1), use_flex=f) for f in (False, True))
    assert torch.allclose(dense.loss, flex.loss, atol=1e-5) and torch.equal(dense.acc, flex.acc)
