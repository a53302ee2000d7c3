"""Prompt lookup, and a proposer that drafts from it where it matches and from DFlash elsewhere.

Prompt lookup (n-gram speculation) proposes the tokens that followed the latest earlier
occurrence of the context's last n tokens, prompt and output alike: answers quote their
prompt, code repeats identifiers, small models repeat themselves. A match costs no model
pass and is often long, while a DFlash drafter is right on the first token or two of free
text. ``HybridProposer`` takes, row by row and cycle by cycle, the lookup continuation when
there is one and the drafter's block when there is not.

Exactness is unchanged: which source drafts depends only on the committed context, a lookup
draft is deterministic (its law q is one-hot, and accept/residual sampling with a one-hot q
yields the target's law), and the drafter's tokens are drawn independently per position from
the q it reports, so a block that mixes both still gives each token the q it was drawn from.
"""

from __future__ import annotations

import torch


class NgramIndex:
    """Where each n-gram (``min_n <= n <= max_n``) of a growing token sequence last ended.

    ``after[g]`` is the index just after the latest occurrence of n-gram ``g`` that ends
    before the sequence's last token, so the sequence's own suffix never matches itself."""

    def __init__(self, tokens: list[int], min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        seq = self.tokens
        for t in tokens:
            end = len(seq)  # n-grams ending at the current last token become visible now
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    self.after[tuple(seq[end - n:end])] = end
            seq.append(t)

    def lookup(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        suffix n-gram found ([] when no suffix of ``min_n`` tokens or more occurred before)."""
        seq = self.tokens
        for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
            start = self.after.get(tuple(seq[-n:]))
            if start is not None:
                return seq[start:start + k]
        return []


class LookupProposer:
    """Prompt lookup alone (no drafter): rows without a match draft nothing this cycle."""

    needs_features = False
    layer_ids = None

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self.index: list[NgramIndex] = []

    def admit(self, engine, rows, features, lens):
        self.index += [NgramIndex(list(r.request.prompt), self.min_n, self.max_n) for r in rows]

    def continuations(self, engine, k: int) -> list[list[int]]:
        """Each live row's lookup continuation (up to ``k`` tokens), its index brought up to
        date with the tokens emitted since the last cycle (the anchor is the last of them)."""
        out = []
        for idx, row in zip(self.index, engine.rows):
            seen = len(idx.tokens) - len(row.request.prompt)
            idx.extend(row.tokens[seen:])
            out.append(idx.lookup(k))
        return out

    def propose(self, engine, k: int):
        conts = self.continuations(engine, k)
        return _pad(conts, max(map(len, conts)), engine.anchors.device), None

    def commit(self, features, keep):
        pass

    def select(self, idx):
        self.index = [self.index[i] for i in idx.tolist()]


class HybridProposer:
    """Lookup where the context repeats itself, the DFlash drafter where it does not.

    ``draft_len`` (default: the drafter's B - 1) bounds the drafter's drafts and
    ``lookup_len`` (default: unbounded) the lookup's, both within the engine's block; a
    serving controller sets them per step (0 turns a source off). ``proposed`` holds, per
    row, (source, tokens drafted) of the block being verified, source "lookup", "dflash" or
    "none", and ``matched`` whether the row's context had a lookup match (used or not);
    ``commit`` moves both to ``last`` / ``last_matched`` (empty after a step that drafted
    nothing). ``tally`` keeps the accepted drafts per source (benchmarks report both)."""

    def __init__(self, dflash, block_size: int | None = None, min_n: int = 2, max_n: int = 4):
        self.dflash = dflash
        self.lookup = LookupProposer(min_n, max_n)
        self.draft_len = (block_size or int(dflash.drafter.config.block_size)) - 1
        self.lookup_len: int | None = None
        self.needs_features, self.layer_ids = dflash.needs_features, dflash.layer_ids
        self.proposed: list[tuple[str, int]] = []
        self.matched: list[bool] = []
        self.last: list[tuple[str, int]] = []
        self.last_matched: list[bool] = []
        self.tally: dict[str, list[int]] = {"lookup": [], "dflash": []}

    def admit(self, engine, rows, features, lens):
        self.dflash.admit(engine, rows, features, lens)
        self.lookup.admit(engine, rows, features, lens)

    def propose(self, engine, k: int):
        n_look = k if self.lookup_len is None else min(k, self.lookup_len)
        conts = self.lookup.continuations(engine, max(n_look, 1))
        self.matched = [bool(c) for c in conts]  # even with lookup off: a controller learns the match rate
        if n_look == 0:
            conts = [[] for _ in conts]
        n_draft = min(k, self.draft_len)
        dev = engine.anchors.device
        width = max([n_draft if not all(conts) else 0] + [len(c) for c in conts])
        self.proposed = [("lookup", len(c)) if c else ("dflash", width) if n_draft else ("none", 0) for c in conts]
        if all(conts) or n_draft == 0:  # no drafter pass; its context keeps filling through commit
            return _pad(conts, width, dev), None
        draft, q = self.dflash.propose(engine, width)
        for i, c in enumerate(conts):
            if c:
                draft[i, :len(c)] = torch.tensor(c, device=dev)
                if q is not None:  # one-hot: the lookup tokens are certain
                    q[i, :len(c)] = 0
                    q[i, torch.arange(len(c), device=dev), draft[i, :len(c)]] = 1
        return draft, q

    def commit(self, features, keep):
        self.dflash.commit(features, keep)
        # what drafted this step, per row ([] after a step that drafted nothing): serving reads it
        self.last, self.proposed = self.proposed, []
        self.last_matched, self.matched = self.matched, []
        for (src, _), a in zip(self.last, (keep - 1).tolist()):
            if src != "none":
                self.tally[src].append(a)

    def select(self, idx):
        self.dflash.select(idx)
        self.lookup.select(idx)

    @property
    def kv_bytes(self) -> int:
        return self.dflash.kv_bytes


def drafter_proposer(drafter, target, block_size: int, lookup_block: int = 0):
    """A drafter drafting blocks of ``block_size``: alone, or with prompt lookup beside it
    when ``lookup_block`` > 1. Run it in an engine of ``engine_block(block_size, lookup_block)``."""
    from specdec.engine import DFlashProposer

    proposer = DFlashProposer(drafter, target)
    return HybridProposer(proposer, block_size) if lookup_block > 1 else proposer


def engine_block(block_size: int, lookup_block: int = 0) -> int:
    """The engine's block for ``drafter_proposer``: it bounds the lookup drafts, the drafter
    keeps its own ``block_size``."""
    return max(block_size, lookup_block) if lookup_block > 1 else block_size


def _pad(conts: list[list[int]], width: int, device) -> torch.Tensor:
    """(rows, width) drafts; a row shorter than ``width`` repeats its last token (or 0): a
    deterministic proposal like any other, verified and most likely rejected."""
    out = torch.zeros(len(conts), width, dtype=torch.long, device=device)
    for i, c in enumerate(conts):
        if c:
            out[i, :len(c)] = torch.tensor(c, device=device)
            out[i, len(c):] = c[-1]
    return out
