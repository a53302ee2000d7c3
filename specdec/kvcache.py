"""Ragged KV caches: every row keeps its committed tokens as a contiguous prefix of a
shared physical length, ``lens[b]`` slots valid, the rest padding that masks hide.

A verify pass appends a block to every row at the physical end; ``commit`` then moves
each row's accepted part down to sit right after its prefix and crops the tail, so
rejected positions leave nothing behind. Works on Hugging Face ``DynamicCache`` objects
(the target's and the drafter's) through their per-layer ``keys``/``values`` tensors.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def physical_len(cache: DynamicCache) -> int:
    layer = cache.layers[0] if cache.layers else None
    return 0 if layer is None or getattr(layer, "keys", None) is None or layer.keys.numel() == 0 else layer.keys.shape[-2]


def attention_mask(lens: torch.Tensor, past: int, q_len: int, causal: bool,
                   window: int | None = None) -> torch.Tensor:
    """(B, 1, q_len, past + q_len) boolean mask for queries appended after ``past`` slots.

    A query sees its row's valid prefix (slot < lens[b]) and, among the new block slots,
    either everything (bidirectional, the drafter) or itself and earlier ones (causal).
    With a sliding ``window`` W, query i (at slot lens[b] + i) sees only prefix slots
    s > lens[b] + i - W: the last W positions, itself included (slots are positions up to
    a per-row offset, which cancels)."""
    B = lens.shape[0]
    slots = torch.arange(past, device=lens.device)
    ctx = (slots[None, :] < lens[:, None])[:, None, None, :].expand(B, 1, q_len, past)
    if window is not None:
        first = lens[:, None] + torch.arange(q_len, device=lens.device)[None] - window  # (B, q_len)
        ctx = ctx & (slots[None, None, None, :] > first[:, None, :, None])
    if causal:
        blk = torch.ones(q_len, q_len, dtype=torch.bool, device=lens.device).tril()
    else:
        blk = torch.ones(q_len, q_len, dtype=torch.bool, device=lens.device)
    return torch.cat([ctx, blk[None, None].expand(B, 1, q_len, q_len)], dim=-1)


def commit(cache: DynamicCache, lens: torch.Tensor, past: int, keep: torch.Tensor) -> torch.Tensor:
    """Keep the first ``keep[b]`` of the slots appended after ``past``; drop the rest.

    Returns the new ``lens``. Slots are moved in place and the tail is cropped, so the
    cache afterwards equals a fresh prefill of the accepted tokens (up to padding)."""
    new_lens = lens + keep
    new_len = int(new_lens.max()) if lens.numel() else 0
    move = (lens < past) & (keep > 0)  # rows with a gap between prefix and the new block
    if bool(move.any()):
        rows = move.nonzero().squeeze(1)
        width = int(keep[rows].max())
        offs = torch.arange(width, device=lens.device)
        valid = offs[None, :] < keep[rows][:, None]
        r = rows[:, None].expand(-1, width)[valid]
        src = (past + offs)[None, :].expand(len(rows), -1)[valid]
        dst = (lens[rows][:, None] + offs[None, :])[valid]
        for layer in cache.layers:
            for t in (layer.keys, layer.values):
                t[r, :, dst] = t[r, :, src]
    for layer in cache.layers:
        layer.keys = layer.keys[..., :new_len, :]
        layer.values = layer.values[..., :new_len, :]
    return new_lens


def drop_front(cache: DynamicCache, lens: torch.Tensor, keep: int) -> torch.Tensor:
    """Keep only the last ``keep`` valid slots of every row (sliding-window caches): each
    row's prefix shifts down by ``drop[b] = max(0, lens[b] - keep)`` and the tail is cropped.
    Returns ``drop`` (the caller adds it to the row's position offset)."""
    drop = (lens - keep).clamp(min=0)
    if not bool(drop.any()):
        return drop
    new_len = int((lens - drop).max())
    idx = (torch.arange(new_len, device=lens.device)[None] + drop[:, None])
    idx = idx.clamp(max=physical_len(cache) - 1)
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)
            g = idx[:, None, :, None].expand(t.shape[0], t.shape[1], new_len, t.shape[3])
            setattr(layer, name, t.gather(2, g))
    return drop


def nbytes(cache: DynamicCache) -> int:
    """Bytes held by a cache's keys and values (draft KV memory in benchmarks)."""
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values) if t is not None)


def append(cache: DynamicCache, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Append per-layer (k, v) of shape (B, H, T, D) at the physical end."""
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)


def select_rows(cache: DynamicCache, idx: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Keep rows ``idx`` and trim padding nobody needs; returns their lens."""
    new_lens = lens[idx]
    new_len = int(new_lens.max()) if new_lens.numel() else 0
    for layer in cache.layers:
        layer.keys = layer.keys[idx, :, :new_len]
        layer.values = layer.values[idx, :, :new_len]
    return new_lens


def concat(caches: list[DynamicCache], lens: list[torch.Tensor]) -> tuple[DynamicCache, torch.Tensor]:
    """Stack row-batches into one cache, padding each to the longest physical length."""
    caches = [c for c, n in zip(caches, lens) if n.numel()]
    lens = [n for n in lens if n.numel()]
    out = DynamicCache()
    if not caches:
        return out, torch.zeros(0, dtype=torch.long)
    T = max(physical_len(c) for c in caches)
    for i in range(len(caches[0].layers)):
        ks, vs = [], []
        for c in caches:
            k, v = c.layers[i].keys, c.layers[i].values
            pad = T - k.shape[-2]
            if pad:
                k = torch.nn.functional.pad(k, (0, 0, 0, pad))
                v = torch.nn.functional.pad(v, (0, 0, 0, pad))
            ks.append(k)
            vs.append(v)
        out.update(torch.cat(ks), torch.cat(vs), i)
    return out, torch.cat(lens)


def row_kv(cache: DynamicCache, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The valid (k, v) of one row per layer, for comparisons in tests and debugging."""
    return [(layer.keys[row, :, :length], layer.values[row, :, :length]) for layer in cache.layers]
