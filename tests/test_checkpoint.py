"""Drafter checkpoints in the published DFlash layout, and refusal of mismatches."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.checkpoint import DrafterMismatchError, load_drafter, save_drafter
from specdec.drafter import DFlashDrafter
from specdec.engine import Engine, Request
from specdec.proposers import DFlashProposer
from specdec.checkpoint_format import default_target_layer_ids
from specdec.tiny import random_drafter

pytestmark = pytest.mark.unit

PUBLISHED_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{name}"
    for i in range(2)
    for name in ["input_layernorm.weight", "post_attention_layernorm.weight",
                 *[f"self_attn.{p}_proj.weight" for p in "qkvo"], "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight", *[f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]]
}


@pytest.mark.parametrize("layers, n, expected", [(36, 5, [1, 9, 17, 25, 33]), (30, 5, [1, 8, 14, 20, 27]),
                                                 (28, 5, [1, 7, 13, 19, 25]), (32, 1, [16])])
def test_default_layer_ids_follow_paper_spacing(layers, n, expected):
    assert default_target_layer_ids(layers, n) == expected


def test_round_trip_published_layout(tmp_path, tiny):
    t = tiny("llama")
    d = random_drafter(t, block_size=8, layers=2)
    d.config.extra["target_identity"] = t.identity
    save_drafter(d, tmp_path / "d")
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert set(tensors) == PUBLISHED_KEYS
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": d.config.target_layer_ids, "block_size": 8}
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_hidden_layers", "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings",
                "num_target_layers", "block_size"):
        assert key in cfg, key
    assert cfg["num_hidden_layers"] == 2 and cfg["dflash_ray"]["target_identity"] == t.identity
    assert cfg["layer_types"] == ["full_attention", "full_attention"]  # explicit: vLLM reads it
    back = load_drafter(tmp_path / "d", target=t)
    for k, v in d.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    assert back.config.as_dict() == d.config.as_dict()
    prompt = [1, 4, 5, 6]
    a = Engine(t, DFlashProposer(d, t), width=8).generate([Request(prompt, 16, stop_ids=frozenset())])[0]
    b = Engine(t, DFlashProposer(back, t), width=8).generate([Request(prompt, 16, stop_ids=frozenset())])[0]
    assert a.tokens == b.tokens and a.stats.accepted == b.stats.accepted


def test_loads_a_published_style_checkpoint(tmp_path, tiny):
    """Published drafters may carry no lineage, an explicit target_layer_ids and a
    `model.` prefix on tensor names; they load and run."""
    t = tiny("qwen3")
    d = random_drafter(t, block_size=16, layers=1)
    out = tmp_path / "pub"
    out.mkdir()
    save_file({f"model.{k}": v.float() for k, v in d.state_dict().items()}, str(out / "model.safetensors"))
    cfg = d.config.to_hf_dict()
    cfg.pop("dflash_ray")
    cfg.pop("target_hidden_size")
    (out / "config.json").write_text(json.dumps(cfg))
    back = load_drafter(out, target=t, dtype=torch.float64)
    assert back.config.target_layer_ids == d.config.target_layer_ids and back.config.block_size == 16
    r = Engine(t, DFlashProposer(back, t), width=16).generate([Request([1, 2, 3], 8, stop_ids=frozenset())])
    assert len(r[0].tokens) == 8


@pytest.mark.parametrize("field, change", [
    ("hidden_size", lambda c: c.update(hidden_size=32, head_dim=8)),
    ("vocab_size", lambda c: c.update(vocab_size=256)),
    ("target_layer_ids", lambda c: c["dflash_config"].update(target_layer_ids=[1, 3, 9])),
    # the last layer (L-1 = 5) is refused: vLLM feeds layer i+1's input for id i
    ("target_layer_ids", lambda c: c["dflash_config"].update(target_layer_ids=[1, 5])),
    ("mask_token_id", lambda c: c["dflash_config"].update(mask_token_id=4096)),
    ("target_identity", lambda c: c["dflash_ray"].update(target_identity="0" * 64)),
])
def test_mismatched_drafter_is_refused_naming_the_field(tmp_path, tiny, field, change):
    t = tiny("llama")
    d = random_drafter(t)
    save_drafter(d, tmp_path / "d")
    cfg_path = tmp_path / "d" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    change(cfg)
    if field in ("hidden_size", "vocab_size", "target_layer_ids"):
        # rebuild tensors of the right shapes for the edited config, so only the check fails
        from specdec.checkpoint_format import DrafterConfig
        save_drafter(DFlashDrafter(DrafterConfig.from_hf_dict(cfg)), tmp_path / "d")
        cfg_path.write_text(json.dumps(cfg))
    else:
        cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(DrafterMismatchError, match=field):
        load_drafter(tmp_path / "d", target=t)


@pytest.mark.parametrize("field, change", [
    ("layer_types\\[1\\]='chunked_attention'", lambda c: c.update(layer_types=["full_attention", "chunked_attention"])),
    # vLLM runs sliding layers causally unless the config says otherwise
    ("no dflash_config.causal", lambda c: c.update(layer_types=["full_attention", "sliding_attention"],
                                                   sliding_window=64)),
    ("sliding_window: expected an int >= block_size", lambda c: (c.update(layer_types=["sliding_attention"] * 2,
                                                                          sliding_window=4),
                                                                 c["dflash_config"].update(causal=False))),
    ("sliding_window: 1000000 is larger than the context", lambda c: (c.update(sliding_window=1000000),
                                                                      c["dflash_config"].update(use_swa=True))),
    ("neither dflash_config.swa_window_size nor sliding_window", lambda c: c["dflash_config"].update(use_swa=True)),
    ("add_swa_attention_sink_bias", lambda c: c.update(add_swa_attention_sink_bias=True)),
    ("dflash_config.causal=True", lambda c: c["dflash_config"].update(causal=True)),
    ("is_causal=True", lambda c: c.update(is_causal=True)),
    ("rope_parameters.rope_type='yarn'", lambda c: c["rope_parameters"].update(rope_type="yarn", factor=4.0)),
    ("rope_scaling.rope_type='linear'", lambda c: c.update(rope_scaling={"type": "linear", "factor": 2.0})),
])
def test_published_attention_we_do_not_compute_is_refused(tmp_path, tiny, field, change):
    """A drafter asking for causal draft layers, attention sinks, a bad window or scaled
    RoPE must not silently run as bidirectional attention with plain RoPE."""
    t = tiny("llama")
    save_drafter(random_drafter(t), tmp_path / "d")
    cfg_path = tmp_path / "d" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    change(cfg)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(DrafterMismatchError, match=field):
        load_drafter(tmp_path / "d", target=t)


def test_published_attention_we_compute_is_accepted(tmp_path, tiny):
    t = tiny("llama")
    save_drafter(random_drafter(t), tmp_path / "d")
    cfg_path = tmp_path / "d" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dflash_config"].update(use_swa=False, causal=False)
    cfg.update(is_causal=False, rope_scaling=None, sliding_window=None, use_sliding_window=False)
    cfg_path.write_text(json.dumps(cfg))
    assert load_drafter(tmp_path / "d", target=t).config.num_hidden_layers == 2
    del cfg["layer_types"]  # older checkpoints carry none: full attention
    cfg_path.write_text(json.dumps(cfg))
    assert load_drafter(tmp_path / "d", target=t).config.num_hidden_layers == 2


def test_missing_or_incomplete_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json and model.safetensors"):
        load_drafter(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="mask_token_id"):
        load_drafter(tmp_path)
