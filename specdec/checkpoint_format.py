"""The published DFlash checkpoint format: the drafter's ``config.json`` layout (the keys
vLLM and SGLang read; never rename them), the rules a config must meet (block size,
per-layer attention kinds, sliding window) and the refusal of published configs this
engine cannot run. Torch-free, so the model (drafter.py) and the loader (checkpoint.py)
both build on it without an import cycle."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
MIN_BLOCK_SIZE = 2  # the anchor and at least one drafted token
FULL, SLIDING = "full_attention", "sliding_attention"  # the published per-layer kinds


def is_drafter_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a drafter checkpoint: ``config.json`` and ``model.safetensors``
    (the one test; ``draft_vocab.json`` is optional)."""
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """Paper spacing: ``num_features`` layers uniformly from 1 to L-3 (rounded)."""
    if num_features < 1:
        raise ValueError("num_features must be >= 1")
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"target has only {num_target_layers} layers; need at least 4 for the default spacing")
    span = end - start
    return [int(round(start + i * span / (num_features - 1))) for i in range(num_features)]


def choose_mask_token_id(tokenizer) -> int:
    """A spare special token to use as DFlash's MASK: the tokenizer's own mask token if it
    has one, else the last added special token that is not BOS/EOS/PAD/UNK and does not
    appear in the chat template."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    candidates = [
        int(i)
        for i, tok in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())
        if int(i) not in reserved and str(tok) not in template
    ]
    if candidates:
        return candidates[-1]
    if tokenizer.unk_token_id is not None:
        return int(tokenizer.unk_token_id)
    raise ValueError("tokenizer has no spare special token for MASK; set mask_token_id in the drafter config")


def check_block_size(value, name: str = "block_size") -> int:
    """The one rule for a block size B (every entry point calls it): an integer >= 2."""
    if isinstance(value, bool) or not isinstance(value, int) or value < MIN_BLOCK_SIZE:
        raise ValueError(f"{name} must be an integer >= {MIN_BLOCK_SIZE}, got {value!r}")
    return value


@dataclass
class DrafterConfig:
    """A drafter's architecture and lineage; ``to_hf_dict`` / ``from_hf_dict`` are its
    published ``config.json``."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    num_hidden_layers: int = 1
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    target_hidden_size: int | None = None
    # sliding-window draft attention: a query at position i sees context positions j > i - W
    # (the last W positions, itself included), as vLLM and flash-attention windows compute;
    # layer_types null means every layer sliding when sliding_window is set, else all full
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    # DFlash2 settings (specdec/dflash2.py; ``dflash_config`` keys of a DFlash2DraftModel); None: DFlash
    dflash2: dict | None = None
    extra: dict = field(default_factory=dict)  # our lineage, stored under "dflash_ray"

    def __post_init__(self):
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        check_block_size(self.block_size)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.layer_types = check_layer_types(self.layer_types, self.sliding_window, self.num_hidden_layers,
                                             self.block_size, self.max_position_embeddings)
        if self.dflash2 is not None:
            self.dflash2 = check_dflash2(self.dflash2, self.hidden_size, self.vocab_size)

    @property
    def layer_windows(self) -> list[int | None]:
        """Each draft layer's window W (None: full attention)."""
        return [self.sliding_window if kind == SLIDING else None for kind in self.layer_types]

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    # The published DFlash layout (vLLM and SGLang read these keys; never rename them).
    def to_hf_dict(self) -> dict:
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            # explicit, so engines that default differently (vLLM: sliding/causal per layer
            # type) run what we trained
            "layer_types": list(self.layer_types),
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "target_hidden_size": self.target_hidden_size,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": self.target_layer_ids,
                "block_size": self.block_size,
                # vLLM makes sliding layers causal unless told; ours are bidirectional in the block
                **({"causal": False, "swa_window_size": self.sliding_window} if self.sliding_window else {}),
                **(self.dflash2 or {}),
            },
            # Qwen3Config keeps sliding_window only with use_sliding_window (the official code reads it)
            **({"sliding_window": self.sliding_window, "use_sliding_window": True} if self.sliding_window else {}),
            "dflash_ray": self.extra,
            **(dflash2_hf_keys(self.dflash2) if self.dflash2 is not None else {}),
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DrafterConfig":
        dfc = d.get("dflash_config") or {}
        refuse_unsupported_attention(d)
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                               "vocab_size") if k not in d]
        if "mask_token_id" not in dfc:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise ValueError(f"drafter config.json lacks required field(s): {', '.join(missing)}")
        layer_ids = dfc.get("target_layer_ids") or d.get("target_layer_ids")
        num_target_layers = d.get("num_target_layers")
        if layer_ids is None:
            layer_ids = default_target_layer_ids(num_target_layers, d["num_hidden_layers"])
        rope = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta") or 1e6
        n_heads = d["num_attention_heads"]
        window, layer_types = published_window(d)
        return cls(
            hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_attention_heads=n_heads, num_key_value_heads=d.get("num_key_value_heads", n_heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // n_heads, vocab_size=d["vocab_size"],
            mask_token_id=int(dfc["mask_token_id"]), target_layer_ids=list(layer_ids),
            num_target_layers=int(num_target_layers or max(layer_ids) + 4),
            num_hidden_layers=d["num_hidden_layers"],
            block_size=int(dfc.get("block_size") or d.get("block_size") or 16),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(rope),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            target_hidden_size=d.get("target_hidden_size"), sliding_window=window, layer_types=layer_types,
            dflash2=published_dflash2(d), extra=dict(d.get("dflash_ray") or {}),
        )

    def as_dict(self) -> dict:
        return asdict(self)


def check_layer_types(layer_types: list[str] | None, window: int | None, num_layers: int, block_size: int,
                      max_positions: int) -> list[str]:
    """The per-layer attention kinds, validated against the window (errors name the field)."""
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < block_size:
            raise ValueError(f"sliding_window: expected an int >= block_size ({block_size}; a block must see "
                             f"itself whole), got {window!r}")
        if window > max_positions:
            raise ValueError(f"sliding_window: {window} is larger than the context "
                             f"(max_position_embeddings {max_positions})")
    if layer_types is None:
        return [SLIDING if window else FULL] * num_layers
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types: expected {num_layers} entries (one per draft layer), got {len(layer_types)}")
    for i, kind in enumerate(layer_types):
        if kind not in (FULL, SLIDING):
            raise ValueError(f"layer_types[{i}]: expected {FULL!r} or {SLIDING!r}, got {kind!r}")
    if SLIDING in layer_types and window is None:
        raise ValueError("sliding_window: layer_types has 'sliding_attention' layers but no window is set")
    return layer_types


def published_window(d: dict) -> tuple[int | None, list[str] | None]:
    """(window, layer_types) of a published config, resolved as vLLM resolves them:
    ``dflash_config.use_swa`` makes every layer sliding; the window comes from
    ``dflash_config.swa_window_size`` or the top-level ``sliding_window``."""
    dfc = d.get("dflash_config") or {}
    layer_types = d.get("layer_types")
    n = d.get("num_hidden_layers")
    if dfc.get("use_swa") and (not layer_types or SLIDING not in layer_types):
        layer_types = [SLIDING] * int(n or len(layer_types or []) or 1)
    sliding = bool(layer_types) and SLIDING in layer_types
    window = (dfc.get("swa_window_size") or d.get("sliding_window")) if sliding else None
    if sliding and window is None:
        raise ValueError("drafter config.json: layer_types has 'sliding_attention' layers but neither "
                         "dflash_config.swa_window_size nor sliding_window gives the window")
    return window, layer_types


def refuse_unsupported_attention(d: dict) -> None:
    """Published drafters may ask for causal draft layers, attention sinks or scaled RoPE;
    this engine computes bidirectional in-block attention (full or sliding-window) with
    plain RoPE, so running such a checkpoint would silently draft something else. Refuse
    it, naming the field."""
    dfc = d.get("dflash_config") or {}
    for i, kind in enumerate(d.get("layer_types") or []):
        if kind not in (FULL, SLIDING):
            raise ValueError(f"drafter config.json: layer_types[{i}]={kind!r} is not supported "
                             f"(only {FULL!r} and {SLIDING!r} draft layers)")
    for name, value in (("dflash_config.causal", dfc.get("causal")), ("is_causal", d.get("is_causal"))):
        if value:
            raise ValueError(f"drafter config.json: {name}={value!r} is not supported "
                             "(this engine's draft layers attend bidirectionally within the block)")
    explicit = dfc.get("causal") is not None or d.get("is_causal") is not None
    if SLIDING in (d.get("layer_types") or []) and not explicit:
        # vLLM runs sliding layers causally unless the config says otherwise (gemma-4 DFlash)
        raise ValueError("drafter config.json: layer_types has 'sliding_attention' layers but no "
                         "dflash_config.causal: vLLM runs such layers causally within the block, this engine "
                         "bidirectionally; set dflash_config.causal: false if the drafter was trained that way")
    if dfc.get("add_swa_attention_sink_bias") or d.get("add_swa_attention_sink_bias"):
        raise ValueError("drafter config.json: add_swa_attention_sink_bias is not supported (no attention sinks)")
    for name in ("rope_parameters", "rope_scaling"):
        rope = d.get(name) or {}
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
        if kind not in (None, "default"):
            raise ValueError(f"drafter config.json: {name}.rope_type={kind!r} is not supported (only 'default' RoPE)")


DFLASH2_ARCH = "DFlash2DraftModel"
#: DFlash2's ``dflash_config`` keys and the values a new drafter gets (a two-tap convolution
#: per 16-channel group, the published shape; rank and K sized for small targets)
DFLASH2_DEFAULTS = {"conv_group_size": 16, "conv_kernel_size": 2, "selector_rank": 32, "selector_top_k": 8,
                    "output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0}


def check_dflash2(settings: dict, hidden_size: int, vocab_size: int) -> dict:
    """DFlash2 settings completed with the defaults and validated (errors name the key)."""
    unknown = sorted(set(settings) - set(DFLASH2_DEFAULTS))
    if unknown:
        raise ValueError(f"dflash2: unknown key(s) {unknown}; expected some of {sorted(DFLASH2_DEFAULTS)}")
    out = {**DFLASH2_DEFAULTS, **{k: v for k, v in settings.items() if v is not None or k == "final_logit_softcapping"}}
    for key in ("conv_group_size", "conv_kernel_size", "selector_rank", "selector_top_k"):
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"dflash2.{key}: expected an int >= 1, got {v!r}")
    if hidden_size % out["conv_group_size"]:
        raise ValueError(f"dflash2.conv_group_size: {out['conv_group_size']} must divide hidden_size {hidden_size}")
    if out["selector_top_k"] > vocab_size:
        raise ValueError(f"dflash2.selector_top_k: {out['selector_top_k']} exceeds vocab_size {vocab_size}")
    for key in ("output_multiplier", "input_embedding_scale"):
        if isinstance(out[key], bool) or not isinstance(out[key], (int, float)) or out[key] <= 0:
            raise ValueError(f"dflash2.{key}: expected a number > 0, got {out[key]!r}")
    cap = out["final_logit_softcapping"]
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 0):
        raise ValueError(f"dflash2.final_logit_softcapping: expected null or a number >= 0, got {cap!r}")
    out["final_logit_softcapping"] = float(cap) if cap else None  # 0 means off, as vLLM reads it
    return out


def dflash2_hf_keys(settings: dict) -> dict:
    """The published DFlash2 top-level keys: the architecture and ``is_causal: false`` (its
    settings go under ``dflash_config``)."""
    return {"architectures": [DFLASH2_ARCH], "is_causal": False}


def published_dflash2(d: dict) -> dict | None:
    """A published config's DFlash2 settings (None for a DFlash drafter)."""
    if DFLASH2_ARCH not in (d.get("architectures") or []):
        return None
    dfc = d.get("dflash_config") or {}
    missing = [f"dflash_config.{k}" for k in ("conv_group_size", "conv_kernel_size", "selector_rank",
                                               "selector_top_k") if k not in dfc]
    if missing:
        raise ValueError(f"a {DFLASH2_ARCH} config lacks {', '.join(missing)}")
    return {k: dfc[k] for k in DFLASH2_DEFAULTS if k in dfc}
