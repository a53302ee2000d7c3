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

import numpy as np
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
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    path, model = _meta_model(name_or_path, dtype, trust_remote_code)
    config = model.config
    names = {id(m): n for n, m in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    want = {f"{names[id(embed)]}.weight": embed}
    tied = head is None or head.weight is embed.weight or bool(getattr(config, "tie_word_embeddings", False))
    if head is not None and not tied:
        want[f"{names[id(head)]}.weight"] = head
    tensors = read_tensors(path, list(want))
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


def _meta_model(name_or_path: str | None, dtype: torch.dtype, trust_remote_code: bool) -> tuple[Path, nn.Module]:
    """(the target's directory, its model built from the config with parameters on the meta
    device and buffers such as embedding scales and rotary tables real)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(resolve_target_path(name_or_path))
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code,
                                                 attn_implementation="sdpa")
    return path, model


def read_tensors(path: Path, keys: list[str]) -> dict[str, torch.Tensor] | None:
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


# ---------------------------------------------------------------- the driver's target
_NUMPY = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}


def load_target_shell(name_or_path: str | None = None, dtype: torch.dtype | str = torch.float32,
                      trust_remote_code: bool = False) -> Target:
    """The target as a driver plans with it: config, tokenizer, generation config and
    weights identity, every parameter on the meta device. The identity is hashed from
    strided samples read straight from the safetensors files (the values
    ``weights_fingerprint`` samples), so the weights never load; ``materialize`` reads the
    few modules a drafter is initialised from. Falls back to ``load_target`` for a target
    that is not a local safetensors directory."""
    from transformers import AutoTokenizer, GenerationConfig

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    path, model = _meta_model(name_or_path, dtype, trust_remote_code)
    model.tie_weights()  # from_pretrained ties after loading; on the meta device nobody has yet
    identity = _file_fingerprint(path, model) if path.is_dir() else None
    if identity is None:
        return load_target(name_or_path, dtype=dtype, trust_remote_code=trust_remote_code, fast_kernels=False)
    if (path / "generation_config.json").is_file():  # stop tokens come from it, as from_pretrained reads them
        model.generation_config = GenerationConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    target = Target(model, tok, model_id=str(name_or_path or "smollm2-135m"), identity=identity)
    target.source_path = path
    return target


def materialize(target: Target, modules: list[nn.Module]) -> None:
    """Read the real weights of ``modules`` (parts of a ``load_target_shell`` target) from
    its safetensors files, in the target's dtype; other parameters stay on the meta device."""
    names = {id(m): n for n, m in target.model.named_modules()}
    want = {f"{names[id(m)]}.{n}": (m, n) for m in modules for n, p in m.named_parameters(recurse=True)
            if p.is_meta}
    tensors = read_tensors(target.source_path, list(want)) if want else {}
    if tensors is None:
        raise FileNotFoundError(f"{target.source_path}: missing tensors {sorted(want)[:3]}...")
    for key, (module, name) in want.items():
        owner, leaf = module.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        setattr(owner, leaf, nn.Parameter(tensors[key].to(target.dtype), requires_grad=False))


def _file_fingerprint(path: Path, model: nn.Module) -> str | None:
    """``weights_fingerprint`` of the weights in ``path`` without loading them: each tensor's
    strided sample is read through a memory map (at most 4096 values a tensor), tied weights
    from the tensor they share. None when a state-dict entry is in no file."""
    from specdec.target import fingerprint_of_samples

    headers = _safetensors_headers(path)
    if headers is None:
        return None
    state = model.state_dict(keep_vars=True)
    by_param = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(t), []).append(name)
    samples = {}
    for name, t in state.items():
        source = next((n for n in by_param.get(id(t), [name]) if n in headers), name if name in headers else None)
        if source is None:
            return None
        samples[name] = (tuple(t.shape), _strided_sample(*headers[source], t.numel()))
    return fingerprint_of_samples(samples, model.config.to_dict())


def _safetensors_headers(path: Path) -> dict[str, tuple[Path, int, dict]] | None:
    """tensor name -> (file, data start, header entry) over a (sharded) safetensors dir."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    out = {}
    for file in files:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        out.update({k: (file, 8 + n, v) for k, v in header.items() if k != "__metadata__"})
    return out


def _strided_sample(file: Path, start: int, entry: dict, numel: int) -> torch.Tensor:
    """Every ``numel // 4096``-th value (the first 4096) of a stored tensor, as float32."""
    if entry["dtype"] not in _NUMPY:
        raise ValueError(f"{file}: tensor dtype {entry['dtype']} is not one a target is stored in")
    step = max(1, numel // 4096)
    mm = np.memmap(file, dtype=_NUMPY[entry["dtype"]], mode="r", offset=start + entry["data_offsets"][0],
                   shape=(numel,))
    raw = np.array(mm[::step][:4096])
    del mm
    if entry["dtype"] == "BF16":
        raw = (raw.astype(np.uint32) << 16).view(np.float32)
    return torch.from_numpy(raw.astype(np.float32))
