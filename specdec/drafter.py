"""The DFlash drafter: a few Qwen3-style layers that denoise a block
``[anchor, MASK x (B-1)]`` in one pass, conditioned on fused target features.

Target features of n layers are concatenated, projected by ``fc`` (no bias) and
normalised by ``hidden_norm``; the result enters EVERY layer as extra keys/values (same
k/v projections as the block tokens). Queries come from block tokens only; attention is
bidirectional inside the block and sees all committed context. The drafter borrows the
target's frozen input embedding and LM head (it owns neither).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


MIN_BLOCK_SIZE = 2  # the anchor and at least one drafted token
FULL, SLIDING = "full_attention", "sliding_attention"  # the published per-layer kinds


def check_block_size(value, name: str = "block_size") -> int:
    """The one rule for a block size B (every entry point calls it): an integer >= 2."""
    if isinstance(value, bool) or not isinstance(value, int) or value < MIN_BLOCK_SIZE:
        raise ValueError(f"{name} must be an integer >= {MIN_BLOCK_SIZE}, got {value!r}")
    return value


@dataclass
class DrafterConfig:
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
            },
            # Qwen3Config keeps sliding_window only with use_sliding_window (the official code reads it)
            **({"sliding_window": self.sliding_window, "use_sliding_window": True} if self.sliding_window else {}),
            "dflash_ray": self.extra,
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
            from specdec.target import default_target_layer_ids
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
            extra=dict(d.get("dflash_ray") or {}),
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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin of shape (B, 1, T, head_dim) for integer positions (B, T) (neox layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim))
    freqs = positions.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values (B, n_kv, T, head_dim) for inputs x (B, T, H)."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self.kv(x, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if isinstance(mask, torch.Tensor) or mask is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:  # a flex-attention BlockMask (training on GPU)
            from torch.nn.attention.flex_attention import flex_attention
            out = flex_attention(q, k, v, block_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.dropout = 0.0  # residual dropout while training (DFlashDrafter.set_dropout); never saved

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        p = self.dropout if self.training else 0.0
        x = x + F.dropout(self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask), p)
        return x + F.dropout(self.mlp(self.post_attention_layernorm(x)), p)


class DFlashDrafter(nn.Module):
    """Parameters exactly as the published checkpoints name them (see checkpoint.py)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_features * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # optional reduced draft vocabulary (specdec/draft_vocab.py); saved in its own file,
        # never in model.safetensors, so the published layout stays as other engines read it
        self.register_buffer("draft_vocab", None, persistent=False)

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Restrict (or with None, un-restrict) the draft head to target ids ``ids``."""
        if ids is not None:
            ids = torch.as_tensor(ids, dtype=torch.long, device=self.fc.weight.device)
            if ids.dim() != 1 or int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
                raise ValueError(f"draft vocabulary ids must be a 1-D list inside [0, {self.config.vocab_size})")
            ids = ids.unique(sorted=True)
        self.draft_vocab = ids
        if ids is None:
            self.config.extra.pop("draft_vocab_size", None)
        else:
            self.config.extra["draft_vocab_size"] = int(ids.numel())

    def set_dropout(self, p: float) -> None:
        """Residual dropout ``p`` on every draft layer's attention and MLP outputs, in
        training mode only (a regulariser for small data; not part of the checkpoint)."""
        if not 0 <= p < 1:
            raise ValueError(f"dropout must be in [0, 1), got {p!r}")
        for layer in self.layers:
            layer.dropout = float(p)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context keys/values for target features (B, T, n*H_t) at positions (B, T).

        Context K/V depend only on the features, never on draft hidden states, so they are
        computed once per committed position and cached.
        """
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))
        cos, sin = self.rope(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None) -> torch.Tensor:
        """Denoise block tokens (B, Tq, H) at ``positions`` (B, Tq) against cached context.

        ``mask``: (B, 1, Tq, Tc + Tq) boolean, True where a block query may look (context
        slots first, then block slots), or one such mask per layer (sliding-window layers
        see less context than full ones). Returns final-normed hidden states (B, Tq, H).
        """
        x = block_embeds.to(self.dtype)
        cos, sin = self.rope(positions, x.dtype)
        masks = mask if isinstance(mask, (list, tuple)) else [mask] * len(self.layers)
        for layer, (k, v), m in zip(self.layers, ctx_kv, masks):
            x = layer(x, cos, sin, k, v, m)
        return self.norm(x)

    def layer_masks(self, build) -> list:
        """One mask per layer from ``build(window)`` (window None: full attention), built
        once per distinct window."""
        windows = self.config.layer_windows
        made = {w: build(w) for w in dict.fromkeys(windows)}
        return [made[w] for w in windows]


def with_window(drafter: DFlashDrafter, window: int | None,
                layer_types: list[str] | None = None) -> DFlashDrafter:
    """The same weights with sliding-window draft attention of ``window`` (None: full
    attention) in every layer, or in the layers ``layer_types`` marks sliding."""
    cfg = DrafterConfig(**{**drafter.config.as_dict(), "sliding_window": window, "layer_types": layer_types})
    out = DFlashDrafter(cfg).to(drafter.dtype)
    out.load_state_dict(drafter.state_dict())
    out.set_draft_vocab(drafter.draft_vocab)
    return out.eval().requires_grad_(False)


def drafter_config_for_target(target, num_hidden_layers: int = 1, block_size: int = 16,
                              target_layer_ids: list[int] | None = None, num_features: int = 5,
                              mask_token_id: int | None = None, intermediate_size: int | None = None,
                              sliding_window: int | None = None, layer_types: list[str] | None = None,
                              ) -> DrafterConfig:
    """A drafter whose widths match ``target`` (embedding and LM head are shared, so
    hidden size and vocab must match; attention shapes follow the target's)."""
    from specdec.target import choose_mask_token_id, default_target_layer_ids

    c = target.config
    n_heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_heads
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    return DrafterConfig(
        hidden_size=c.hidden_size, intermediate_size=intermediate_size or c.intermediate_size,
        num_attention_heads=n_heads, num_key_value_heads=getattr(c, "num_key_value_heads", n_heads) or n_heads,
        head_dim=head_dim, vocab_size=c.vocab_size,
        mask_token_id=mask_token_id if mask_token_id is not None else choose_mask_token_id(target.tokenizer),
        target_layer_ids=target_layer_ids or default_target_layer_ids(target.num_layers, num_features),
        num_target_layers=target.num_layers, num_hidden_layers=num_hidden_layers, block_size=block_size,
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        rope_theta=float(theta or getattr(c, "rope_theta", None) or 1e6),
        max_position_embeddings=getattr(c, "max_position_embeddings", 32768),
        target_hidden_size=c.hidden_size, sliding_window=sliding_window, layer_types=layer_types,
    )


def init_from_target(drafter: DFlashDrafter, target) -> None:
    """Initialise draft layers from evenly spaced target layers and the final norm from the
    target's (DESIGN.md lever: shapes match, training starts from useful weights)."""
    t_layers = target.layers
    n, L = len(drafter.layers), len(t_layers)
    picks = [int(round((i + 1) * L / (n + 1))) for i in range(n)]
    with torch.no_grad():
        for d_layer, idx in zip(drafter.layers, picks):
            src = dict(t_layers[min(idx, L - 1)].named_parameters())
            for name, p in d_layer.named_parameters():
                if name in src and src[name].shape == p.shape:
                    p.copy_(src[name].to(p.dtype))
        base_norm = getattr(target.base, "norm", None)
        if base_norm is not None and base_norm.weight.shape == drafter.norm.weight.shape:
            drafter.norm.weight.copy_(base_norm.weight.to(drafter.norm.weight.dtype))
