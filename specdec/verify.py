"""Acceptance math for one verify pass, isolated so it can be tested exhaustively.

A row proposes K draft tokens y_1..y_K; the target scored the block and gives K+1 laws
p_0..p_K (p_j is the law of the token after block position j). Every row emits its
accepted drafts followed by exactly one target token (correction or bonus), so a row
emits num_accepted + 1 tokens.
"""

from __future__ import annotations

import torch


def greedy_accept(draft: torch.Tensor, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft (B, K), target_argmax (B, K+1) -> (num_accepted (B,), tokens (B, K+1)).

    Accept the longest prefix equal to the target's argmax; tokens[:, A] is the target's
    token at the first mismatch (or the bonus token when all K survive).
    """
    match = (draft == target_argmax[:, :-1]).long()
    num_accepted = match.cumprod(dim=1).sum(dim=1)
    return num_accepted, target_argmax


def acceptance_prob(p_y: torch.Tensor, q_y: torch.Tensor) -> torch.Tensor:
    """Probability of accepting a draft y: min(1, p(y) / q(y)) (q(y) > 0 since y ~ q)."""
    return torch.clamp(p_y / q_y, max=1.0)


def residual_law(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Law to sample from after a rejection: normalise(max(p - q, 0)) over the last dim.

    When p == q there is no residual mass, but then rejection has probability 0; p is
    returned so the result is always a valid law."""
    r = (p - q).clamp(min=0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 1e-12, r / mass.clamp(min=1e-300), p)


def speculative_accept(
    draft: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling.

    draft (B, K) proposed tokens; q (B, K, V) the proposal laws they were drawn from
    (None = deterministic proposals, i.e. one-hot q); p (B, K+1, V) target laws.
    Accept y_k with probability min(1, p(y_k)/q(y_k)); at the first rejection sample from
    normalise(max(p - q, 0)); if all survive, sample the bonus from p_K.
    Returns (num_accepted (B,), tokens (B, K+1)) with tokens[:, :A] = drafts and
    tokens[:, A] = the target-side token.
    """
    B, K = draft.shape
    rows = torch.arange(B, device=p.device)
    if K == 0:
        return torch.zeros(B, dtype=torch.long, device=p.device), torch.multinomial(p[:, 0], 1, generator=generator)
    if q is None:
        q = torch.zeros_like(p[:, :K]).scatter_(-1, draft[..., None], 1.0)
    q = q.to(p.dtype)
    p_y = p[:, :K].gather(-1, draft[..., None]).squeeze(-1)
    q_y = q.gather(-1, draft[..., None]).squeeze(-1)
    u = torch.rand(B, K, generator=generator, dtype=p.dtype, device=p.device)
    # u < min(1, p/q) has probability min(1, p/q) for u ~ U[0, 1); p(y) = 0 never passes
    accepted = (u < acceptance_prob(p_y, q_y)).long()
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)

    at = num_accepted.clamp(max=K - 1)
    law = torch.where((num_accepted == K)[:, None], p[:, K], residual_law(p[rows, at], q[rows, at]))
    final = torch.multinomial(law, 1, generator=generator).squeeze(-1)

    tokens = torch.cat([draft, torch.zeros_like(draft[:, :1])], dim=1)
    tokens[rows, num_accepted] = final
    return num_accepted, tokens
