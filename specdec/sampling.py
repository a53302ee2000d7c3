"""Logits -> the law a token is drawn from. Target and drafter logits go through the SAME
transform (temperature, then top-k, then top-p), which exact speculative sampling needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.temperature import check_temperature


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    def __post_init__(self):
        check_temperature(self.temperature)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def batch_params(params: list[SamplingParams], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature, top_k, top_p) tensors."""
    t = torch.tensor([p.temperature for p in params], dtype=torch.float64, device=device)
    k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
    p_ = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device)
    return t, k, p_


def probs_from_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Token law per position: logits (B, T, V) -> probs (B, T, V) in float64.

    Greedy rows get a one-hot at the argmax, so greedy and sampled rows share one exact
    acceptance rule (accepting y with p(y)/q(y) under one-hot laws is exact-match).
    """
    B, T, V = logits.shape
    logits = logits.to(torch.float64)
    temp, top_k, top_p = batch_params(params, logits.device)
    greedy = temp == 0
    out = torch.empty_like(logits)
    if greedy.any():
        g = logits[greedy]
        out[greedy] = torch.zeros_like(g).scatter_(-1, g.argmax(-1, keepdim=True), 1.0)
    if (~greedy).any():
        s = ~greedy
        x = logits[s] / temp[s][:, None, None]
        k, p = top_k[s], top_p[s]
        if bool((k > 0).any()) or bool((p < 1).any()):
            sorted_x, order = x.sort(dim=-1, descending=True)
            ranks = torch.arange(V, device=x.device)
            drop = (k[:, None, None] > 0) & (ranks >= k[:, None, None])
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            sp = sorted_x.softmax(-1)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = (sp.cumsum(-1) - sp) >= p[:, None, None]
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            x = torch.full_like(x, float("-inf")).scatter_(-1, order, sorted_x)
        out[s] = x.softmax(-1)
    return out


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row of probs (..., V)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
