"""The DFlash training objective: many blocks per sequence in ONE drafter forward.

For each sequence, anchors are sampled at response positions; block j is
``[x_a, MASK x (B-1)]`` at positions a..a+B-1 and predicts x_{a+1}..x_{a+B-1}. Block j
sees the target features of positions strictly before its anchor (what inference has
committed when x_a is the pending anchor) and its own block, bidirectionally; never
another block. Loss = sum_k exp(-(k-1)/lambda) * CE at offset k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

#: the paper's decay per block size; other sizes interpolate as B/2.2 (close to these)
PAPER_LAMBDA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_lambda(block_size: int) -> float:
    return PAPER_LAMBDA.get(block_size, max(1.0, block_size / 2.2))


def loss_weights(block_size: int, lam: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/lambda) for offsets k = 1..B-1."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / lam)


@dataclass
class Blocks:
    anchors: torch.Tensor  # (Bsz, N) anchor positions; padded entries point at 0
    valid: torch.Tensor  # (Bsz, N) bool: a real block
    labels: torch.Tensor  # (Bsz, N, B-1) target token at offsets 1..B-1 (0 where none)
    label_mask: torch.Tensor  # (Bsz, N, B-1) bool: offset has a label (response; any real token for a context block)


def _draw(eligible: torch.Tensor, n: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``n`` distinct positions per row among ``eligible`` (Bsz, T), uniformly without
    replacement: (positions, valid), each (Bsz, min(n, T))."""
    Bsz, T = eligible.shape
    # random scores, ineligible last; top-n per row = a uniform sample without replacement
    scores = torch.rand(Bsz, T, generator=generator, device=eligible.device).masked_fill(~eligible, -1.0)
    top, idx = scores.topk(min(n, T), dim=1)
    return idx, top >= 0


def sample_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, block_size: int,
                  num_anchors: int, generator: torch.Generator | None = None, context_anchors: int = 0) -> Blocks:
    """Sample up to ``num_anchors`` distinct anchors per sequence among positions a >= 1
    whose next token is a response token (loss_mask[a+1] = 1), plus up to ``context_anchors``
    among the positions whose next token is a prompt token. A response block is labelled on
    response tokens only; a context block on every real token (the prompt's own text: at long
    context, a document read with the target's features of everything before it)."""
    Bsz, T = input_ids.shape
    dev = input_ids.device
    pos = torch.arange(T, device=dev)
    nxt = torch.zeros_like(loss_mask, dtype=torch.bool)
    nxt[:, :-1] = loss_mask[:, 1:].bool()
    real = (pos[None] >= 1) & (pos[None] < (lengths[:, None] - 1))
    anchors, valid = _draw(nxt & real, num_anchors, generator)
    if context_anchors > 0:
        ctx, ctx_valid = _draw(~nxt & real, context_anchors, generator)
        anchors, valid = torch.cat([anchors, ctx], 1), torch.cat([valid, ctx_valid], 1)
    anchors, order = torch.where(valid, anchors, torch.full_like(anchors, T)).sort(dim=1)
    valid = valid.gather(1, order)
    anchors = anchors.masked_fill(~valid, 0)
    from_ctx = ~nxt.gather(1, anchors)  # a context block: its anchor's next token is a prompt token
    offs = torch.arange(1, block_size, device=dev)
    lab_pos = anchors[..., None] + offs  # (Bsz, N, B-1)
    inside = (lab_pos < lengths[:, None, None]) & valid[..., None]
    lab_pos = lab_pos.clamp(max=T - 1)
    labels = input_ids.gather(1, lab_pos.flatten(1)).view_as(lab_pos)
    in_resp = loss_mask.gather(1, lab_pos.flatten(1)).view_as(lab_pos).bool()
    return Blocks(anchors, valid, labels.masked_fill(~inside, 0), inside & (in_resp | from_ctx[..., None]))


def block_mask_dense(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int,
                     window: int | None = None) -> torch.Tensor:
    """(Bsz, 1, N*B, ctx_len + N*B) boolean: query of block j sees context slots < anchor_j
    and the slots of block j; padded blocks see only themselves (their loss is masked).
    With a sliding ``window`` W the query at position a_j + i sees only context slots
    s > a_j + i - W (the engine's rule, kvcache.attention_mask)."""
    Bsz, N = anchors.shape
    dev = anchors.device
    q_block = torch.arange(N * block_size, device=dev) // block_size  # (Q,)
    a = anchors.gather(1, q_block[None].expand(Bsz, -1))  # (Bsz, Q)
    slots = torch.arange(ctx_len, device=dev)[None, None, :]
    ctx = slots < a[:, :, None]
    if window is not None:
        q_pos = a + (torch.arange(N * block_size, device=dev) % block_size)[None]
        ctx = ctx & (slots > (q_pos - window)[:, :, None])
    ctx = ctx & valid.gather(1, q_block[None].expand(Bsz, -1))[:, :, None]
    own = (q_block[:, None] == q_block[None, :])[None].expand(Bsz, -1, -1)
    return torch.cat([ctx, own], dim=-1)[:, None]


def block_mask_flex(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int,
                    window: int | None = None):
    """The same mask as ``block_mask_dense`` as a flex-attention BlockMask (GPU path:
    memory grows with the visible blocks, not with (N*B) x (T + N*B))."""
    from torch.nn.attention.flex_attention import create_block_mask

    Bsz, N = anchors.shape
    Q = N * block_size

    def mask_mod(b, h, q_idx, kv_idx):
        j = q_idx // block_size
        in_ctx = (kv_idx < ctx_len) & (kv_idx < anchors[b, j]) & valid[b, j]
        if window is not None:
            in_ctx = in_ctx & (kv_idx > anchors[b, j] + q_idx % block_size - window)
        same_block = (kv_idx >= ctx_len) & ((kv_idx - ctx_len) // block_size == j)
        return in_ctx | same_block

    # compiled on GPU: built block by block (uncompiled it first materialises the dense (Q, T+Q)
    # boolean mask); inductor on CPU miscompiles this mask_mod (torch 2.13), and CPU trains dense
    return create_block_mask(mask_mod, Bsz, None, Q, ctx_len + Q, device=anchors.device,
                             _compile=anchors.device.type == "cuda")


def teacher_law(ids: torch.Tensor, logprobs: torch.Tensor,
                vocab_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft-head column (M, K) long, probability (M, K)) of a top-K teacher law,
    renormalised over the ids the drafter can propose (``vocab_index`` maps target ids
    to draft columns, -1 outside); a row with no such id is all zero."""
    cols = vocab_index[ids] if vocab_index is not None else ids
    p = logprobs.float().exp() * (cols >= 0)
    return cols.clamp(min=0), p / p.sum(-1, keepdim=True).clamp(min=1e-12)


def _teacher_at(src: torch.Tensor, sel: torch.Tensor,
                teacher: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-K (ids, log-probs), each (M, K), at the source positions ``src``
    (Bsz, N, B-1) of the labelled positions ``sel``."""
    t_ids, t_logp = teacher
    Bsz, N, D = src.shape
    K = t_ids.shape[-1]
    idx = src.reshape(Bsz, N * D, 1).expand(-1, -1, K)
    return t_ids.gather(1, idx).view(Bsz, N, D, K)[sel], t_logp.gather(1, idx).view(Bsz, N, D, K)[sel]


#: rows of draft-head logits alive at once in training: past this many labelled positions
#: the head runs in chunks recomputed in backward, so its memory is HEAD_CHUNK_ROWS x V
#: instead of (batch x anchors x (B-1)) x V (43 GB at the Qwen3-8B recipe's shapes)
HEAD_CHUNK_ROWS = 2048


def head_loss(logits_fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
              soft: tuple[torch.Tensor, torch.Tensor] | None, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row CE (M,) of the draft head on ``hidden`` (M, H) against ``labels`` (M,) (-1:
    none), mixed with the CE against the teacher law ``soft`` = (columns, probs) (M, K) by
    ``alpha``; and the head's argmax (M,). Exact whatever the chunking: rows are independent."""
    def rows(h, y, cols, p):
        logits = logits_fn(h)
        logq = torch.log_softmax(logits.float(), -1)  # once, for the label's CE and the teacher's
        ce = -logq.gather(1, y.clamp(min=0)[:, None])[:, 0] * (y >= 0)
        if cols is not None:
            t_ce = -(p * logq.gather(1, cols)).sum(-1)
            ce = torch.where(p.sum(-1) > 0, (1 - alpha) * ce + alpha * t_ce, ce)
        return ce, logits.detach().argmax(-1)

    cols, p = soft if soft is not None else (None, None)
    if hidden.shape[0] <= HEAD_CHUNK_ROWS:
        return rows(hidden, labels, cols, p)
    from torch.utils.checkpoint import checkpoint

    run = (lambda *a: checkpoint(rows, *a, use_reentrant=False)) if torch.is_grad_enabled() else rows
    out = [run(*(None if t is None else t[i:i + HEAD_CHUNK_ROWS] for t in (hidden, labels, cols, p)))
           for i in range(0, hidden.shape[0], HEAD_CHUNK_ROWS)]
    return torch.cat([c for c, _ in out]), torch.cat([a for _, a in out])


def selector_head_loss(drafter: nn.Module, logits_fn: Callable[[torch.Tensor], torch.Tensor],
                       hidden: torch.Tensor, labels: torch.Tensor, prev: torch.Tensor,
                       soft: tuple[torch.Tensor, torch.Tensor] | None, distill: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss (M,) = the DFlash head CE (objective.head_loss) + ``selector_alpha`` x the
    selector's CE, and the selector's pick (M,), for draft hidden states (M, H) with gold
    ``labels`` (M,) after gold tokens ``prev`` (M,) (teacher-forced: while a draft run is
    alive, the token drafted before is the gold one, so the pick's leading matches are the
    walk's). The selector's CE is over the head's top-K candidates with the gold one added
    when it is missing (SpecForge's DFlash2 objective); the pick is over the top-K alone,
    as served, so a gold outside them is a miss. With a reduced draft vocabulary labels and
    the pick are draft columns (-1: a label outside it, which the selector cannot score).
    ``drafter``: a DFlash2 drafter (specdec/dflash2.py), its ``candidate_selector``,
    ``selector_alpha`` and ``unary``."""
    sel, alpha = drafter.candidate_selector, drafter.selector_alpha
    to_target = getattr(logits_fn, "to_target", lambda x: x)  # draft columns -> target ids (codebook rows)

    def rows(h, y, a, cols, p):
        logits = logits_fn(h)
        ce, _ = head_loss(lambda x: x, logits, y, None if cols is None else (cols, p), distill)
        cand = logits.detach().topk(sel.top_k, dim=-1).indices
        ext = torch.cat([cand, y.clamp(min=0)[:, None]], 1)  # K candidates + the gold
        hit = cand == y[:, None]
        scores = sel.edge_scores(a[:, None], to_target(ext), drafter.unary(logits.gather(1, ext)), h)[:, 0]
        scores = scores.float().masked_fill(F.pad(hit.any(-1, keepdim=True), (sel.top_k, 0)), float("-inf"))
        gold = torch.where(hit.any(-1), hit.float().argmax(-1), sel.top_k)
        sce = F.cross_entropy(scores, gold, reduction="none") * (y >= 0)
        pick = cand.gather(1, scores.detach()[:, :sel.top_k].argmax(-1, keepdim=True))[:, 0]
        return ce + alpha * sce, pick

    cols, p = soft if soft is not None else (None, None)
    if hidden.shape[0] <= HEAD_CHUNK_ROWS:
        return rows(hidden, labels, prev, cols, p)
    from torch.utils.checkpoint import checkpoint

    run = (lambda *a: checkpoint(rows, *a, use_reentrant=False)) if torch.is_grad_enabled() else rows
    out = [run(*(None if t is None else t[i:i + HEAD_CHUNK_ROWS] for t in (hidden, labels, prev, cols, p)))
           for i in range(0, hidden.shape[0], HEAD_CHUNK_ROWS)]
    return torch.cat([c for c, _ in out]), torch.cat([k for _, k in out])


def block_hidden(drafter, embed: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor,
                 features: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                 use_flex: bool = False) -> torch.Tensor:
    """The drafter's last hidden states (Bsz, N, B-1, H) at offsets 1..B-1 of the blocks
    anchored at ``anchors`` (Bsz, N): what the engine computes when ``x_a`` is the pending
    anchor and positions < a are committed, for all blocks of a sequence in one pass."""
    cfg = drafter.config
    Bk = cfg.block_size
    Bsz, T = input_ids.shape
    N = anchors.shape[1]
    dev = input_ids.device
    block_ids = torch.full((Bsz, N, Bk), cfg.mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    block_pos = anchors[..., None] + torch.arange(Bk, device=dev)
    ctx_kv = drafter.context_kv(features, torch.arange(T, device=dev)[None].expand(Bsz, -1))
    build = block_mask_flex if use_flex else block_mask_dense
    mask = drafter.layer_masks(lambda w: build(anchors, valid, T, Bk, w))
    with torch.no_grad():
        x = embed(block_ids.flatten(1))
    return drafter(x, block_pos.flatten(1), ctx_kv, mask).view(Bsz, N, Bk, -1)[:, :, 1:]


@dataclass
class StepOutput:
    loss: torch.Tensor
    acc: torch.Tensor  # (B-1,) accuracy at each offset (argmax == label)
    tau: torch.Tensor  # scalar: simulated greedy accepted length 1 + E[leading matches]
    n_blocks: int
    n_tokens: int
    acc_count: torch.Tensor | None = None  # (B-1,) labelled positions at each offset (acc's denominator)


def dflash_loss(drafter, embed: Callable[[torch.Tensor], torch.Tensor], logits_fn: Callable[[torch.Tensor], torch.Tensor],
                input_ids: torch.Tensor, loss_mask: torch.Tensor, features: torch.Tensor, lengths: torch.Tensor,
                num_anchors: int, lam: float | None = None, generator: torch.Generator | None = None,
                use_flex: bool = False, vocab_index: torch.Tensor | None = None,
                teacher: tuple[torch.Tensor, torch.Tensor] | None = None, distill: float = 0.0,
                context_anchors: int = 0) -> StepOutput:
    """Weighted block-denoising loss for a padded batch.

    input_ids/loss_mask (Bsz, T), features (Bsz, T, n*H) from the target's chosen layers,
    lengths (Bsz,). ``embed``/``logits_fn`` are the target's frozen embedding and LM head.
    With a reduced draft vocabulary ``logits_fn`` scores only its V_d tokens and
    ``vocab_index`` (V,) maps target ids to draft indices (-1 outside): such labels cost
    nothing (the drafter can never propose them) and count as misses in acc and tau.

    ``teacher`` = (ids, log-probs), each (Bsz, T, K): the target's top-K next tokens after
    each position. With ``distill`` alpha > 0 the CE at each offset becomes
    ``(1 - alpha) * CE(label) + alpha * CE(teacher law)``, the teacher law being its top-K
    renormalised over what the drafter can propose (positions where none of it can be
    proposed keep the plain CE). The label of position p is scored against the target's
    law after p - 1, the law verification compares with.

    ``context_anchors`` adds that many blocks per sequence over the prompt (``sample_blocks``).
    """
    Bk = drafter.config.block_size
    lam = lam or default_lambda(Bk)
    Bsz, T = input_ids.shape
    dev = input_ids.device
    blocks = sample_blocks(input_ids, loss_mask, lengths, Bk, num_anchors, generator, context_anchors)
    N = blocks.anchors.shape[1]
    hidden = block_hidden(drafter, embed, input_ids, features, blocks.anchors, blocks.valid, use_flex)

    sel = blocks.label_mask  # only positions with a real label cost anything
    labels = blocks.labels[sel]
    if vocab_index is not None:
        labels = vocab_index[labels]
    w = loss_weights(Bk, lam, dev)[None, None].expand(Bsz, N, -1)[sel]
    soft = None
    if distill > 0 and teacher is not None:
        src = (blocks.anchors[..., None] + torch.arange(Bk - 1, device=dev)).clamp(max=T - 1)  # p - 1
        soft = teacher_law(*_teacher_at(src, sel, teacher), vocab_index)
    if getattr(drafter, "candidate_selector", None) is not None:  # DFlash2: + the selector's CE; top = its pick
        prev = input_ids.gather(1, (blocks.anchors[..., None] + torch.arange(Bk - 1, device=dev)).flatten(1)
                                .clamp(max=T - 1)).view_as(blocks.labels)[sel]  # the gold token before each
        ce, top = selector_head_loss(drafter, logits_fn, hidden[sel], labels, prev, soft, distill)
    else:
        ce, top = head_loss(logits_fn, hidden[sel], labels, soft, distill)
    loss = (w * ce).sum() / w.sum().clamp(min=1e-6)

    with torch.no_grad():
        hit = torch.zeros_like(blocks.label_mask)
        hit[sel] = top == labels
        count = sel.sum((0, 1))
        acc = (hit & sel).sum((0, 1)).float() / count.clamp(min=1).float()
        # leading matches per block; a missing label ends the run (it cannot be verified)
        lead = (hit & sel).long().cumprod(-1).sum(-1)
        n_blocks = int(blocks.valid.sum())
        tau = 1 + lead[blocks.valid].float().mean() if n_blocks else torch.tensor(math.nan)
    return StepOutput(loss, acc, tau, n_blocks, int(sel.sum()), count)
