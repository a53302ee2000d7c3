"""The DFlash drafter: a few Qwen3-style layers that denoise a block
``[anchor, MASK x (B-1)]`` in one pass, conditioned on fused target features.

Target features of n layers are concatenated, projected by ``fc`` (no bias) and
normalised by ``hidden_norm``; the result enters EVERY layer as extra keys/values (same
k/v projections as the block tokens). Queries come from block tokens only; attention is
bidirectional inside the block and sees all committed context. The drafter borrows the
target's frozen input embedding and LM head (it owns neither).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from specdec.checkpoint_format import DrafterConfig, choose_mask_token_id, default_target_layer_ids


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
        gqa = self.n_kv != self.n_heads  # grouped heads read their shared K/V: no materialised repeat
        if isinstance(mask, torch.Tensor) or mask is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:  # a flex-attention BlockMask (training on GPU)
            # under autocast the normed q/k come out fp32 beside a bf16 v; flex needs one dtype
            out = compiled_flex_attention()(q.to(v.dtype), k.to(v.dtype), v, block_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


@functools.cache
def compiled_flex_attention():
    """``flex_attention`` compiled once per process: uncompiled, it materialises the full
    fp32 score matrix (B x heads x Q x (T+Q), ~47 GB per layer at the Qwen3-8B recipe's
    shapes); compiled, it runs as a fused kernel over the block mask's visible blocks."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


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
    out = type(drafter)(cfg).to(drafter.dtype)  # DFlash or DFlash2
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


def init_layer_picks(num_draft_layers: int, num_target_layers: int) -> list[int]:
    """The target layers draft layers start from: evenly spaced, never the first."""
    n, L = num_draft_layers, num_target_layers
    return [min(int(round((i + 1) * L / (n + 1))), L - 1) for i in range(n)]


def init_from_target(drafter: DFlashDrafter, target) -> None:
    """Initialise draft layers from evenly spaced target layers and the final norm from the
    target's (docs/engine.md lever: shapes match, training starts from useful weights)."""
    t_layers = target.layers
    with torch.no_grad():
        for d_layer, idx in zip(drafter.layers, init_layer_picks(len(drafter.layers), len(t_layers))):
            src = dict(t_layers[idx].named_parameters())
            for name, p in d_layer.named_parameters():
                if name in src and src[name].shape == p.shape:
                    p.copy_(src[name].to(p.dtype))
        base_norm = getattr(target.base, "norm", None)
        if base_norm is not None and base_norm.weight.shape == drafter.norm.weight.shape:
            drafter.norm.weight.copy_(base_norm.weight.to(drafter.norm.weight.dtype))
