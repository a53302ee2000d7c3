"""The DFlash2 drafter: DFlash plus two parts, as the published checkpoints compute them
(vLLM's ``model_executor/models/qwen3_dflash2.py`` is the reference for the computation
and the tensor names; SGLang's loader computes the same).

* A grouped dynamic causal convolution along the block's positions around every
  attention and MLP sublayer (``attention_conv``, ``mlp_conv``): for input x at block
  position t, ``y_t = sum_{j < taps, j <= t} (base[j] + delta_t[j, group]) * x_{t-j}``,
  ``base`` a per-channel kernel and ``delta_t`` a per-group kernel projected from the
  sublayer's normed input at t. The same projection gives the kernels of both sides (side 0
  before the sublayer, side 1 after it). Context K/V never pass through it.
* A low-rank candidate selector (``candidate_selector``): the draft head's top-K
  candidates per position, unary scores ``u`` (logits times ``output_multiplier``, then
  soft-capped), and edge scores ``S_t(a, c) = u_t(c) + <A[a] * P h_t, B[c]>`` from the
  token ``a`` drafted before (the anchor for the first) to candidate ``c``. The draft walks
  the block left to right taking, at each position, the candidate its row of ``S`` picks:
  the argmax when greedy, else a draw from the request's transform of that row (q is that
  law, zero outside the K candidates), so verification stays exact.

New parts start neutral (identity convolutions, a selector equal to the head's argmax), so a
DFlash drafter of the same shape initialises one (``init_from``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from specdec.checkpoint_format import DrafterConfig
from specdec.drafter import DFlashDrafter, Layer
from specdec.sampling import SamplingParams, probs_from_logits, sample


class GroupedConv(nn.Module):
    """``attention_conv`` / ``mlp_conv``: ``base_kernel`` (2, taps, H) and
    ``kernel_projection`` (H -> 2 * taps * groups), vLLM's ``DFlashGroupedConv`` layout."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size, self.num_groups = taps, group_size, hidden_size // group_size
        base = torch.zeros(2, taps, hidden_size)
        base[:, 0] = 1.0  # identity until trained
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def kernels(self, x: torch.Tensor) -> torch.Tensor:
        """Per-position dynamic kernels (..., T, 2, taps, groups) from the normed input x."""
        return self.kernel_projection(x).unflatten(-1, (2, self.taps, self.num_groups))

    def convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int, block_len: int) -> torch.Tensor:
        """Side ``side``'s causal convolution of x (B, T, H) within blocks of ``block_len``
        consecutive positions (T = blocks x block_len), kernels ``delta`` (B, T, taps, G)."""
        B, T, H = x.shape
        xs = x.view(B, T, self.num_groups, self.group_size)
        coef = self.base_kernel[side].view(self.taps, self.num_groups, self.group_size) + delta[..., None]
        out = coef[:, :, 0] * xs
        for tap in range(1, self.taps):
            shifted = F.pad(xs[:, :-tap], (0, 0, 0, 0, tap, 0))  # x_{t-tap}; never across blocks (mask)
            out = out + coef[:, :, tap] * shifted * _in_block(T, block_len, tap, x.device, x.dtype)
        return out.reshape(B, T, H)


@functools.lru_cache(maxsize=64)
def _in_block(T: int, block_len: int, tap: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(1, T, 1, 1): 1 where row t - tap is in row t's block (built once per shape: the draft
    pass is a few hundred small ops, each one counts on CPU)."""
    return ((torch.arange(T, device=device) % block_len) >= tap).to(dtype).view(1, T, 1, 1)


class DFlash2Layer(Layer):
    """A DFlash draft layer with the convolutions around its attention and MLP."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        s = cfg.dflash2
        self.attention_conv = GroupedConv(cfg.hidden_size, s["conv_kernel_size"], s["conv_group_size"])
        self.mlp_conv = GroupedConv(cfg.hidden_size, s["conv_kernel_size"], s["conv_group_size"])
        self.block_len = cfg.block_size  # set by the drafter per call: the query rows of one block

    @staticmethod
    def _around(conv: GroupedConv, sublayer, h: torch.Tensor, block_len: int) -> torch.Tensor:
        k = conv.kernels(h)
        h = sublayer(conv.convolve(h, k[..., 0, :, :], 0, block_len))
        return conv.convolve(h, k[..., 1, :, :], 1, block_len)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        p = self.dropout if self.training else 0.0
        attn = lambda h: self.self_attn(h, cos, sin, ctx_k, ctx_v, mask)  # noqa: E731
        x = x + F.dropout(self._around(self.attention_conv, attn, self.input_layernorm(x), self.block_len), p)
        return x + F.dropout(self._around(self.mlp_conv, self.mlp, self.post_attention_layernorm(x),
                                          self.block_len), p)


class CandidateSelector(nn.Module):
    """``candidate_selector``: predecessor / successor codebooks (V, rank) and
    ``hidden_projection`` (H -> rank)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        # small random codebooks and a zero projection: the edge term starts at 0 (neutral)
        # but its gradient does not (a product of three zero factors would never move)
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.zeros_(self.hidden_projection.weight)

    def edge_scores(self, pred_ids: torch.Tensor, cand_ids: torch.Tensor, unary: torch.Tensor,
                    hidden: torch.Tensor) -> torch.Tensor:
        """S (..., P, K) from predecessors (..., P) to candidates (..., K) with unary scores
        (..., K), at draft hidden states (..., H)."""
        h = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))
        left = self.predecessor_codebook[pred_ids] * h[..., None, :]
        return unary[..., None, :] + torch.einsum("...pr,...cr->...pc", left, self.successor_codebook[cand_ids])


class DFlash2Drafter(DFlashDrafter):
    """DFlash2: parameters exactly as the published checkpoints name them."""

    def __init__(self, cfg: DrafterConfig):
        if cfg.dflash2 is None:
            raise ValueError("DFlash2Drafter needs a config with dflash2 settings")
        super().__init__(cfg)
        s = cfg.dflash2
        self.layers = nn.ModuleList(DFlash2Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, s["selector_rank"],
                                                    s["selector_top_k"])
        self.selector_alpha = 1.0  # weight of the selector's loss in training; never saved

    def forward(self, block_embeds, positions, ctx_kv, mask, block_len: int | None = None) -> torch.Tensor:
        """DFlashDrafter.forward; the queries are whole blocks of ``block_len`` rows
        (default: the block size), which the convolutions never cross."""
        for layer in self.layers:
            layer.block_len = block_len or self.config.block_size
        scale = self.config.dflash2["input_embedding_scale"]
        return super().forward(block_embeds * scale if scale != 1.0 else block_embeds, positions, ctx_kv, mask)

    def unary(self, logits: torch.Tensor) -> torch.Tensor:
        """Unary scores of candidate logits: times output_multiplier, then soft-capped."""
        s = self.config.dflash2
        x = logits.float() * s["output_multiplier"]
        cap = s["final_logit_softcapping"]
        return torch.tanh(x / cap) * cap if cap else x

    def lattice(self, logits: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor, to_target=None):
        """(candidate target ids (B, L, K), S (B, L, K, K)) for draft logits (B, L, V_d) at
        hidden (B, L, H) after anchor tokens (B,): S[b, l, p, c] scores candidate c after
        candidate p of l-1. ``to_target`` maps draft columns to target ids (a reduced draft
        vocabulary, our extension: vLLM's DFlash2 drafts over the full one)."""
        vals, cand = logits.topk(self.candidate_selector.top_k, dim=-1)
        cand = to_target(cand) if to_target is not None else cand
        K = cand.shape[-1]
        pred = torch.cat([anchors[:, None, None].expand(-1, 1, K), cand[:, :-1]], dim=1)
        return cand, self.candidate_selector.edge_scores(pred, cand, self.unary(vals), hidden)


def walk(cand: torch.Tensor, scores: torch.Tensor, params: list[SamplingParams], vocab_size: int,
         generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft one token per position along the lattice: (tokens (B, L), q (B, L, V) or None
    when every row is greedy). Row l's law is the request's transform of S[l, prev, :] over
    the K candidates (zero elsewhere); greedy rows take its argmax."""
    B, L, K = cand.shape
    rows = torch.arange(B, device=cand.device)
    prev = torch.zeros(B, dtype=torch.long, device=cand.device)  # step 0: every row is the anchor's
    greedy = all(p.greedy for p in params)
    tokens, laws = [], []
    for step in range(L):
        s = scores[rows, step, prev]  # (B, K)
        if greedy:
            prev = s.argmax(-1)
        else:
            full = s.new_full((B, 1, vocab_size), float("-inf")).scatter_(-1, cand[:, step, None], s[:, None])
            q = probs_from_logits(full, params)
            token = sample(q, generator)[:, 0]
            prev = (cand[:, step] == token[:, None]).long().argmax(-1)
            laws.append(q[:, 0])
        tokens.append(cand[rows, step, prev])
    return torch.stack(tokens, 1), (torch.stack(laws, 1) if laws else None)


def build_drafter(cfg: DrafterConfig) -> DFlashDrafter:
    """The drafter a config describes: DFlash2 when it carries DFlash2 settings, else DFlash."""
    return DFlash2Drafter(cfg) if cfg.dflash2 is not None else DFlashDrafter(cfg)


def is_dflash2(drafter) -> bool:
    return isinstance(drafter, DFlash2Drafter)
