"""A reduced draft vocabulary: which tokens it keeps, that the drafter proposes the best of
them (mapped back to target ids), that greedy output stays exact, that the loss ignores
labels it cannot propose, and that the checkpoint keeps the published layout."""

import json

import pytest
import torch
from safetensors.torch import load_file

from specdec.checkpoint import DrafterMismatchError, load_drafter, save_drafter
from specdec.draft_vocab import LEGACY_VOCAB_FILE, VOCAB_FILE, DraftHead, build_vocab, count_tokens, coverage
from specdec.engine import Engine, Request
from specdec.objective import dflash_loss
from specdec.proposers import DFlashProposer
from specdec.tiny import random_drafter

pytestmark = pytest.mark.unit

NO_STOP = frozenset()
PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 10, 11], [1, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]


def test_build_vocab_keeps_the_most_frequent_and_the_stop_tokens():
    counts = count_tokens([([3, 3, 3, 4, 4, 9, 1], [0, 1, 1, 1, 1, 1, 0]), ([4, 7], [1, 1])], vocab_size=12)
    assert counts.tolist() == [0, 0, 0, 2, 3, 0, 0, 1, 0, 1, 0, 0]  # prompt tokens (mask 0) never count
    assert build_vocab(counts, 2).tolist() == [3, 4]
    assert build_vocab(counts, 3).tolist() == [3, 4, 7]  # tie 7 vs 9: the lower id, deterministically
    assert build_vocab(counts, 2, always=[11]).tolist() == [3, 4, 11]
    assert coverage(counts, build_vocab(counts, 2)) == pytest.approx(5 / 7)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab(counts, 13)


def test_proposals_are_the_best_in_vocabulary_tokens(tiny):
    """The reduced head proposes argmax over V_d of the full head's logits, as target ids."""
    t = tiny("llama")
    ids = torch.tensor([2, 5, 9, 17, 33, 64, 100, 127])
    reduced = random_drafter(t, block_size=6)
    reduced.set_draft_vocab(ids)
    head = DraftHead(t, ids)
    h = torch.randn(3, 5, t.hidden_size, dtype=t.dtype)
    masked = t.logits(h).masked_fill(~torch.isin(torch.arange(t.vocab_size), ids), float("-inf"))
    assert torch.equal(head.to_target(head(h).argmax(-1)), masked.argmax(-1))
    torch.testing.assert_close(head.full_logits(head(h)), masked, rtol=1e-12, atol=1e-12)
    # through the engine's proposer: drafts only ever use V_d
    eng = Engine(t, DFlashProposer(reduced, t), width=6)
    eng.add([Request(p, 8, stop_ids=NO_STOP) for p in PROMPTS])
    draft, q = eng.proposer.propose(eng, 5)
    assert q is None and bool(torch.isin(draft, ids).all())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_exact_with_a_reduced_vocabulary(tiny, family):
    t = tiny(family)
    ref = [Engine(t).generate([Request(p, 24, stop_ids=NO_STOP)])[0].tokens for p in PROMPTS]
    # the vocabulary of the reference output itself: drafts that are often right
    d = random_drafter(t, block_size=8)
    d.set_draft_vocab(sorted({x for r in ref for x in r})[:10])
    got = [r.tokens for r in Engine(t, DFlashProposer(d, t), width=8).generate(
        [Request(p, 24, stop_ids=NO_STOP) for p in PROMPTS])]
    assert got == ref


def test_loss_ignores_labels_outside_the_vocabulary(tiny):
    t = tiny("llama")
    T = 30
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 40, (2, T), generator=g)
    lm = torch.zeros(2, T, dtype=torch.long)
    lm[:, 6:] = 1
    lengths = torch.tensor([T, T])
    feats = torch.randn(2, T, 5 * t.hidden_size, dtype=t.dtype, generator=g)
    d = random_drafter(t, block_size=4).requires_grad_(True)
    vocab = torch.arange(4, 22)  # about half of the labels fall outside
    head = DraftHead(t, vocab)

    def run(vocab_index, logits_fn):
        return dflash_loss(d, t.embed, logits_fn, ids, lm, feats, lengths, 8, generator=torch.Generator().manual_seed(3),
                           vocab_index=vocab_index)

    out = run(head.index, head)
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(p.grad is not None for p in d.layers[0].parameters())
    # the same loss by hand: a full-vocabulary run on a batch whose out-of-vocabulary labels
    # are left out is not comparable (anchors differ), so check the accounting instead:
    # accuracy can never credit a label outside V_d
    full = run(None, lambda h: head.full_logits(head(h)).clamp(min=-1e9))
    assert (out.acc <= full.acc + 1e-12).all() and out.n_tokens == full.n_tokens


def test_checkpoint_keeps_the_published_layout(tiny, tmp_path):
    t = tiny("llama")
    d = random_drafter(t, block_size=4)
    d.set_draft_vocab([9, 3, 5, 3])  # deduplicated and sorted
    save_drafter(d, tmp_path / "d")
    # the only .safetensors file is the weights: vLLM loads every *.safetensors as weights
    assert sorted(p.name for p in (tmp_path / "d").glob("*.safetensors")) == ["model.safetensors"]
    assert set(load_file(str(tmp_path / "d" / "model.safetensors"))) == set(random_drafter(t).state_dict())
    assert json.loads((tmp_path / "d" / VOCAB_FILE).read_text())["token_ids"] == [3, 5, 9]
    assert json.loads((tmp_path / "d" / "config.json").read_text())["dflash_ray"]["draft_vocab_size"] == 3
    back = load_drafter(tmp_path / "d", target=t)
    assert back.draft_vocab.tolist() == [3, 5, 9]
    # saving a full-vocabulary drafter over it removes the stale vocabulary file
    back.set_draft_vocab(None)
    save_drafter(back, tmp_path / "d")
    assert not (tmp_path / "d" / VOCAB_FILE).exists() and load_drafter(tmp_path / "d").draft_vocab is None
    (tmp_path / "d" / VOCAB_FILE).write_text("not json")
    with pytest.raises(DrafterMismatchError, match="token_ids"):
        load_drafter(tmp_path / "d")


def test_legacy_safetensors_vocabulary_still_loads(tiny, tmp_path):
    from safetensors.torch import save_file

    t = tiny("llama")
    save_drafter(random_drafter(t, block_size=4), tmp_path / "d")
    save_file({"token_ids": torch.tensor([2, 4, 7])}, str(tmp_path / "d" / LEGACY_VOCAB_FILE))
    assert load_drafter(tmp_path / "d", target=t).draft_vocab.tolist() == [2, 4, 7]
    d = load_drafter(tmp_path / "d", target=t)
    save_drafter(d, tmp_path / "d")  # re-saving migrates to the JSON sidecar
    assert not (tmp_path / "d" / LEGACY_VOCAB_FILE).exists()
    assert load_drafter(tmp_path / "d").draft_vocab.tolist() == [2, 4, 7]


def test_vllm_copy_drafts_over_the_same_vocabulary(tmp_path):
    """vLLM's form of a reduced-vocabulary drafter (specdec/vllm_drafter.py): the same
    weights plus ``draft_vocab_size``, ``d2t`` mapping draft ids back to the sidecar's target
    ids and ``lm_head.weight`` = those rows of the target's head; derived once, left alone for
    a full-vocabulary drafter; the head found in a sharded target too."""
    from safetensors.torch import save_file

    from specdec.target import load_target
    from specdec.tiny import save_tiny_target
    from specdec.vllm_drafter import target_head, vllm_drafter_dir

    target_dir = save_tiny_target(tmp_path / "target", num_layers=4, hidden_size=32)
    t = load_target(str(target_dir))
    d = random_drafter(t, block_size=4)
    d.set_draft_vocab([9, 3, 5, 40000])
    src = save_drafter(d, tmp_path / "d", dtype=torch.float16)
    out = vllm_drafter_dir(src, target_dir, cache=tmp_path / "cache")
    config, source_config = (json.loads((p / "config.json").read_text()) for p in (out, src))
    assert config.pop("draft_vocab_size") == 4 and config == source_config
    weights, source = load_file(str(out / "model.safetensors")), load_file(str(src / "model.safetensors"))
    ids = torch.tensor([3, 5, 9, 40000])
    assert (weights.pop("d2t") + torch.arange(4)).tolist() == ids.tolist()
    assert torch.equal(weights.pop("lm_head.weight"), t.lm_head.weight.detach()[ids].to(torch.float16))
    assert weights.keys() == source.keys() and all(torch.equal(weights[k], source[k]) for k in source)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # no sidecar
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert vllm_drafter_dir(src, target_dir, cache=tmp_path / "cache") == out  # derived once
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    d.set_draft_vocab(None)
    full = save_drafter(d, tmp_path / "full")
    assert vllm_drafter_dir(full, target_dir, cache=tmp_path / "cache") == full.resolve()
    # a target whose head cannot be read here (not a local directory, nothing cached): as it is
    d.set_draft_vocab([3, 5])
    other = save_drafter(d, tmp_path / "other")
    assert vllm_drafter_dir(other, tmp_path / "no-such-target", cache=tmp_path / "cache") == other.resolve()
    # a sharded target: the head found through its index
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"lm_head.weight": torch.ones(6, 2)}, str(sharded / "model-00002-of-00002.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    assert torch.equal(target_head(sharded), torch.ones(6, 2))
    with pytest.raises(FileNotFoundError, match="no LM head"):
        target_head(tmp_path / "d")
