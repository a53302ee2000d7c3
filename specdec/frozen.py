"""The parts of a target a drafter borrows (input embedding and LM head) without loading
the rest of its weights.

Training from stored features never runs the target's decoder, so a worker needs only
these two matrices: for an 8B target that is ~2.5 GB instead of 16 GB. The model's
parameters are created on the meta device, the two modules' weights are read from the
safetensors files (buffers such as an embedding scale are built as usual), and the
result is an ordinary :class:`~specdec.target.Target` whose ``embed`` / ``logits`` behave
exactly as on the full model (embedding scale, logit soft-capping, tied weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specdec.target import Target, load_target, resolve_target_path


def load_embed_and_head(name_or_path: str | None = None, dtype: torch.dtype | str = torch.float32,
                        device: str | torch.device = "cpu", trust_remote_code: bool = False,
                        identity: str | None = None) -> Target:
    """A :class:`Target` whose embedding and LM head hold the real weights and whose
    decoder parameters stay on the meta device (calling the decoder raises). ``identity``
    (the full target's fingerprint, when the caller knows it) is kept for lineage checks.

    Falls back to loading the whole model when the checkpoint is not a local safetensors
    directory whose tensor names match the model's."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    path = Path(resolve_target_path(name_or_path))
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    # parameters on the meta device, buffers (embedding scales, rotary tables) real
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code,
                                                 attn_implementation="sdpa")
    names = {id(m): n for n, m in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    want = {f"{names[id(embed)]}.weight": embed}
    tied = head is None or head.weight is embed.weight or bool(getattr(config, "tie_word_embeddings", False))
    if head is not None and not tied:
        want[f"{names[id(head)]}.weight"] = head
    tensors = _read_tensors(path, list(want))
    if tensors is None:
        full = load_target(name_or_path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        full._identity = identity or full._identity
        return full
    for key, module in want.items():
        module.weight = nn.Parameter(tensors[key].to(device=device, dtype=dtype), requires_grad=False)
    if head is not None and tied:
        head.weight = embed.weight
    target = Target(model, None, model_id=str(name_or_path or "smollm2-135m"), identity=identity)
    return target


def _read_tensors(path: Path, keys: list[str]) -> dict[str, torch.Tensor] | None:
    """The named tensors from a (possibly sharded) safetensors directory, or None if any
    is missing."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {k: path / weight_map[k] for k in keys if k in weight_map}
    elif (path / "model.safetensors").is_file():
        files = dict.fromkeys(keys, path / "model.safetensors")
    else:
        return None
    if set(files) != set(keys):
        return None
    out = {}
    for key, file in files.items():
        with safe_open(str(file), "pt", device="cpu") as f:
            if key not in f.keys():
                return None
            out[key] = f.get_tensor(key)
    return out
