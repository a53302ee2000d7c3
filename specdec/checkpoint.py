"""Drafter checkpoints in the published DFlash layout: ``config.json`` (its format is
checkpoint_format.py) + ``model.safetensors`` with the tensor names vLLM and SGLang load.
Never executes code from the checkpoint; tensors load through safetensors only."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdec.checkpoint_format import CONFIG_FILE, WEIGHTS_FILE, DrafterConfig, is_drafter_dir  # noqa: F401
from specdec.dflash2 import build_drafter
from specdec.draft_vocab import load_vocab, remove_vocab, save_vocab
from specdec.drafter import DFlashDrafter

class DrafterMismatchError(ValueError):
    """A drafter that cannot run against the given target; the message names the field."""


def save_drafter(drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (no embedding, no LM head), and
    ``draft_vocab.json`` for a drafter with a reduced draft vocabulary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in drafter.state_dict().items()}
    bad = [k for k in tensors if "embed_tokens" in k or "lm_head" in k]
    if bad:
        raise ValueError(f"drafter must not carry embedding/LM head tensors: {bad}")
    cfg = drafter.config.to_hf_dict()
    cfg["dtype"] = str(next(iter(tensors.values())).dtype).replace("torch.", "")
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True))
    if drafter.draft_vocab is not None:
        save_vocab(drafter.draft_vocab, out)
    else:
        remove_vocab(out)
    return out


def read_config(path: str | Path) -> DrafterConfig:
    """A drafter directory's ``config.json`` as a ``DrafterConfig``; an unreadable or
    unsupported config raises ``DrafterMismatchError`` naming the file and field."""
    cfg_file = Path(path) / CONFIG_FILE
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} is not a drafter directory (no config.json)")
    try:
        return DrafterConfig.from_hf_dict(json.loads(cfg_file.read_text()))
    except (ValueError, TypeError, KeyError) as e:  # JSONDecodeError is a ValueError
        raise DrafterMismatchError(f"{cfg_file}: {e}") from None


def load_drafter(path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                 target=None) -> DFlashDrafter:
    """Load a drafter directory (ours or a published one). With ``target``, check that it
    fits; ``dtype`` None computes at the target's dtype (else at the stored one)."""
    path = Path(path)
    if not is_drafter_dir(path):
        raise FileNotFoundError(f"{path} is not a drafter directory (need {CONFIG_FILE} and {WEIGHTS_FILE})")
    cfg = read_config(path)
    state = load_file(str(path / WEIGHTS_FILE), device="cpu")
    state = {k.removeprefix("model."): v for k, v in state.items()
             if not (k.endswith("embed_tokens.weight") or k.startswith("lm_head"))}
    stored = next(iter(state.values())).dtype
    drafter = build_drafter(cfg).to(stored)  # DFlash or DFlash2 by the architecture; stored precision, cast after
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise DrafterMismatchError(f"{path}: tensors missing={sorted(missing)} unexpected={sorted(unexpected)}")
    try:
        drafter.set_draft_vocab(load_vocab(path))
    except ValueError as e:
        raise DrafterMismatchError(f"{path}: {e}") from None
    dtype = dtype or (target.dtype if target is not None else stored)
    drafter = drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if target is not None:
        check_compatible(cfg, target)
    return drafter


def check_compatible(cfg: DrafterConfig, target) -> None:
    """Raise ``DrafterMismatchError`` naming the first field where drafter and target disagree."""
    t = target.config
    checks = [
        ("hidden_size", cfg.hidden_size, t.hidden_size),
        ("target_hidden_size", cfg.target_hidden_size, t.hidden_size),
        ("vocab_size", cfg.vocab_size, t.vocab_size),
    ]
    for name, mine, theirs in checks:
        if mine != theirs:
            raise DrafterMismatchError(f"drafter {name}={mine} but target has {theirs}")
    # <= L-2: vLLM reads layer i's output as the input of layer i+1 (its "aux" layers)
    bad = [i for i in cfg.target_layer_ids if not 0 <= i <= target.num_layers - 2]
    if bad:
        raise DrafterMismatchError(
            f"drafter target_layer_ids {cfg.target_layer_ids} out of range for a {target.num_layers}-layer target "
            f"(0..{target.num_layers - 2}): {bad}")
    if not 0 <= cfg.mask_token_id < t.vocab_size:
        raise DrafterMismatchError(f"drafter mask_token_id={cfg.mask_token_id} outside target vocab {t.vocab_size}")
    want = cfg.extra.get("target_identity")
    if want and getattr(target, "identity", None) and want != target.identity:
        raise DrafterMismatchError(
            f"drafter was trained for target identity {want[:12]}.. but the target is {target.identity[:12]}.. "
            f"(target_identity differs)")
