"""Tiny random-initialised targets (Llama, Qwen2/3, Mistral, Gemma families) built from
configs, so the math can be tested in seconds and pipelines can run end to end."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.target import Target, save_model_files

FAMILIES = ("llama", "qwen3", "qwen2", "mistral", "gemma")


def tiny_config(family: str = "llama", vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 6,
                num_heads: int = 4, num_kv_heads: int = 2, max_positions: int = 512):
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
              num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
              max_position_embeddings=max_positions, head_dim=hidden_size // num_heads,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=family == "gemma",
              initializer_range=0.2)
    if family == "mistral":
        kw["sliding_window"] = None
    return AutoConfig.for_model(family, **kw)


def tiny_target(family: str = "llama", dtype: torch.dtype = torch.float64, seed: int = 0, **cfg) -> Target:
    """A random target with no tokenizer (ids only); float64 makes greedy ties impossible."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, **cfg)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return Target(model, None, model_id=f"tiny-{family}")


def save_tiny_target(out_dir: str | Path, family: str = "llama", seed: int = 0, num_layers: int = 6,
                     hidden_size: int = 64) -> Path:
    """Write a tiny HF model directory with the SmolLM2 tokenizer (vocab 49152), loadable
    by ``load_target`` like any user's model; for pipeline and serving tests."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.target import resolve_target_path

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    tok = AutoTokenizer.from_pretrained(resolve_target_path(None))
    torch.manual_seed(seed)
    config = tiny_config(family, vocab_size=len(tok), hidden_size=hidden_size, num_layers=num_layers,
                         max_positions=2048)
    config.eos_token_id = tok.eos_token_id
    config.bos_token_id = tok.bos_token_id
    config.pad_token_id = tok.pad_token_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    save_model_files(model, out)
    tok.save_pretrained(out)
    return out


def random_drafter(target: Target, block_size: int = 8, layers: int = 2, seed: int = 1,
                   mask_token_id: int = 3, **kw):
    """An untrained drafter for ``target`` with weights wide enough that its drafts are
    peaky (near-uniform drafts would hide sampling bugs)."""
    from specdec.drafter import DFlashDrafter, drafter_config_for_target

    cfg = drafter_config_for_target(target, num_hidden_layers=layers, block_size=block_size,
                                    mask_token_id=mask_token_id, **kw)
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg).to(target.dtype).eval().requires_grad_(False)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return d


def save_cyclic_target(out_dir: str | Path, period: int = 16, first_token: int = 1000, seed: int = 0,
                       num_layers: int = 4, hidden_size: int = 64) -> Path:
    """A tiny target (SmolLM2 tokenizer) whose greedy continuation cycles through ``period``
    ordinary tokens: its layers barely touch the residual stream (so the LM head sees the
    current token's embedding) and the head maps each cycle token to its successor with a
    wide margin. Drafters learn it in a few dozen steps, so training and promotion
    pipelines can be tested for "tau goes up" in seconds."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    if period > hidden_size:
        raise ValueError(f"period {period} needs hidden_size >= period, got {hidden_size}")
    tmp = out.with_name(out.name + ".tmp")
    save_tiny_target(tmp, seed=seed, num_layers=num_layers, hidden_size=hidden_size)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    cycle = list(range(first_token, first_token + period))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.01)
            layer.mlp.down_proj.weight.mul_(0.01)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for k, tok in enumerate(cycle):
            embed[tok].zero_()
            embed[tok, k] = 4.0  # the residual stream points along axis k ...
            head[cycle[(k + 1) % period], k] = 10.0  # ... and axis k scores the successor
    save_model_files(model, tmp)
    tmp.rename(out)
    return out


def copy_anchor_drafter(target: Target, block_size: int = 4, target_layer_ids=(1, 2), period: int = 16,
                        mask_token_id: int = 16, sharp: float = 3.0):
    """One layer whose MASK positions attend (almost only) to the anchor and copy its
    embedding: the target's head maps a cycle token's axis to its successor, so the first
    draft token is always the target's next token (tau ~2 with any block size) -- for
    :func:`save_cyclic_target`'s targets: promotion and serving tests get a drafter that wins."""
    from specdec.drafter import DFlashDrafter, drafter_config_for_target

    cfg = drafter_config_for_target(target, num_hidden_layers=1, block_size=block_size,
                                    target_layer_ids=list(target_layer_ids),
                                    mask_token_id=mask_token_id)
    d = DFlashDrafter(cfg).to(target.dtype)
    hd, H = cfg.head_dim, cfg.hidden_size
    with torch.no_grad():
        for p in d.parameters():  # fc = 0: context keys/values vanish
            p.zero_() if p.dim() == 2 else p.fill_(1.0)
        m = target.embed(torch.tensor([mask_token_id]))[0].to(d.dtype)
        m = m / m.pow(2).mean().sqrt()  # the MASK token after input_layernorm
        cyc = torch.zeros(H, dtype=d.dtype)
        cyc[:period] = 1.0
        mc = m * cyc
        a = d.layers[0].self_attn
        slow = hd // 2 - 1  # the rope pair with the lowest frequency: position-blind
        a.k_proj.weight[slow] = cyc - (cyc @ mc) / (mc @ mc) * mc  # cycle tokens' keys; blind to MASK
        a.k_proj.weight[0] = m * (1 - cyc)  # MASK keys point elsewhere
        a.q_proj.weight[slow] = m / (m @ m)  # queries (from MASK) look for the cycle token
        a.q_norm.weight.fill_(sharp)
        a.k_norm.weight.fill_(sharp)
        for k in range(period):
            a.v_proj.weight[k, k] = 1.0
            a.o_proj.weight[k, k] = 1.0
    return d.eval().requires_grad_(False)
