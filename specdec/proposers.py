"""The proposers an ``Engine`` drafts with (the ``Proposer`` protocol of engine.py).

* ``DFlashProposer``: a DFlash drafter, its context K/V cached per committed position.
* ``LookupProposer``: prompt lookup (n-gram speculation, lookup.py) alone, no model pass.
* ``HybridProposer``: row by row and cycle by cycle, the lookup continuation where the
  context repeats itself and the drafter's block where it does not.
* ``OracleProposer``: each request's precomputed target continuation (the ceiling).

Exactness of the hybrid is unchanged: which source drafts depends only on the committed
context, a lookup draft is deterministic (its law q is one-hot, and accept/residual sampling
with a one-hot q yields the target's law), and the drafter's tokens are drawn independently
per position from the q it reports, so a block that mixes both still gives each token the q
it was drawn from.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specdec import kvcache
from specdec.dflash2 import is_dflash2, walk
from specdec.draft_vocab import head_for
from specdec.engine import Engine
from specdec.lookup import NgramIndex
from specdec.sampling import probs_from_logits, sample
from specdec.target import Target


class DFlashProposer:
    """Drafts with a DFlash drafter: context K/V cached per committed position; the block
    ``[anchor, MASK x K]`` is denoised in one pass and its K/V are never stored.

    Committed target features wait in ``pending`` and enter the context cache in one
    drafter pass at the next drafting step, or once ``max_pending`` positions wait (steps
    with speculation off, k = 1, draft nothing): while serving runs plain AR steps the
    drafter costs almost nothing per step, and its context is complete when drafting resumes.

    Sliding-window drafters (every layer windowed, window W) keep only the last W - 1
    context positions (all a block can see): ``base[b]`` is the position of a row's first
    cached slot, so draft KV memory and draft cost stay bounded however long the context."""

    needs_features = True

    def __init__(self, drafter, target: Target, max_pending: int = 8):
        from specdec.cpu_kernels import pack_linears

        self.drafter = drafter
        self.target = target
        self.head = head_for(drafter, target)  # the target's LM head, maybe over V_d only
        pack_linears(drafter)  # inference only; a no-op off CPU, for float64 and once packed
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.mask_id = drafter.config.mask_token_id
        self.max_pending = max_pending
        windows = set(drafter.config.layer_windows)
        bounded = len(windows) == 1 and None not in windows
        self.keep = windows.pop() - 1 if bounded else None  # slots a block can see, when all layers slide
        self.slack = max(16, (self.keep or 0) // 4)  # trim in batches: a gather per ~W/4 positions
        self.cache = DynamicCache()
        self.lens = torch.zeros(0, dtype=torch.long, device=target.device)  # cached slots per row
        self.base = torch.zeros(0, dtype=torch.long, device=target.device)  # position of slot 0 per row
        self.peak_kv_bytes = 0  # the most draft K/V memory held at once (benchmarks)
        self.pending: torch.Tensor | None = None  # (B, n, F) features not yet in the cache
        self.pending_n = torch.zeros(0, dtype=torch.long, device=target.device)  # valid per row

    def admit(self, engine, rows, features, lens):
        # The prompts go straight into the new rows' own cache. Left pending, they would be
        # ingested together with the live rows' few pending features, padded to the longest
        # prompt: a drafter pass over (all rows x prompt length) for every admission.
        cache = DynamicCache()
        base = torch.zeros_like(lens)
        if self.keep is not None and features.shape[1] > self.keep:  # a window sees only the prompt's end
            base = (lens - self.keep).clamp(min=0)
            idx = (base[:, None] + torch.arange(self.keep, device=lens.device)).clamp(max=features.shape[1] - 1)
            features = features.gather(1, idx[..., None].expand(-1, -1, features.shape[2]))
            lens = lens - base
        pos = base[:, None] + torch.arange(features.shape[1], device=lens.device)[None]
        kvcache.append(cache, self.drafter.context_kv(features, pos))  # padded past lens, masked by lens
        self.cache, self.lens = kvcache.concat([self.cache, cache], [self.lens, lens])
        self.base = torch.cat([self.base, base])
        self.pending = _cat_padded(self.pending, features[:, :0])
        self.pending_n = torch.cat([self.pending_n, torch.zeros_like(lens)])
        self._bound()

    @torch.no_grad()
    def propose(self, engine: Engine, k: int):
        self.flush()
        B = len(engine.rows)
        dev = engine.anchors.device
        # Draft the whole block the drafter was trained on, even when fewer tokens are
        # verified: attention inside a block is bidirectional, so a shorter block (fewer
        # masks) would give other, untrained drafts at the first offsets.
        width = max(k + 1, self.drafter.config.block_size)
        block = torch.full((B, width), self.mask_id, dtype=torch.long, device=dev)
        block[:, 0] = engine.anchors
        pos = (self.base + self.lens)[:, None] + torch.arange(width, device=dev)
        past = kvcache.physical_len(self.cache)
        mask = self.drafter.layer_masks(lambda w: kvcache.attention_mask(self.lens, past, width, False, w))
        ctx = [(layer.keys, layer.values) for layer in self.cache.layers]
        params = [r.request.params for r in engine.rows]
        if is_dflash2(self.drafter):  # the selector's walk over the head's top-K candidates
            hidden = self.drafter(self.target.embed(block), pos, ctx, mask, block_len=width)[:, 1: k + 1]
            cand, scores = self.drafter.lattice(self.head(hidden.to(self.target.dtype)), hidden, engine.anchors,
                                                self.head.to_target)
            return walk(cand, scores, params, self.target.vocab_size, engine.generator)
        hidden = self.drafter(self.target.embed(block), pos, ctx, mask)
        logits = self.head(hidden[:, 1: k + 1].to(self.target.dtype))
        if all(p.greedy for p in params):
            return self.head.to_target(logits.argmax(-1)), None
        # q is the drafter's true proposal law: the same transform, zero outside V_d
        q = probs_from_logits(self.head.full_logits(logits), params)
        return sample(q, engine.generator), q

    def commit(self, features, keep):
        """Queue each row's ``keep`` accepted features after the ones already waiting."""
        m = int(keep.max())
        if self.pending is None or self.pending.shape[1] == 0:
            self.pending, self.pending_n = features[:, :m], keep
            return
        rows, n = self.pending.shape[:2]
        out = self.pending.new_zeros(rows, n + m, self.pending.shape[2])
        out[:, :n] = self.pending
        offs = torch.arange(m, device=keep.device)
        valid = offs[None, :] < keep[:, None]
        r = torch.arange(rows, device=keep.device)[:, None].expand(-1, m)[valid]
        out[r, (self.pending_n[:, None] + offs[None, :])[valid]] = features[:, :m][valid]
        self.pending, self.pending_n = out, self.pending_n + keep
        if int(self.pending_n.max()) >= self.max_pending:
            self.flush()

    def select(self, idx):
        self.lens = kvcache.select_rows(self.cache, idx, self.lens)
        self.base = self.base[idx]
        self.pending = self.pending[idx] if self.pending is not None else None
        self.pending_n = self.pending_n[idx]

    @torch.no_grad()
    def flush(self) -> None:
        """Move pending target features into the context cache (compacted per row)."""
        if self.pending is None or self.pending.shape[1] == 0:
            return
        n = self.pending.shape[1]
        pos = (self.base + self.lens)[:, None] + torch.arange(n, device=self.lens.device)
        past = kvcache.physical_len(self.cache)
        kvcache.append(self.cache, self.drafter.context_kv(self.pending, pos))
        self.lens = kvcache.commit(self.cache, self.lens, past, self.pending_n)
        self.pending = self.pending[:, :0]
        self.pending_n = torch.zeros_like(self.pending_n)
        self._bound()

    def _bound(self) -> None:
        """Sliding-window drafters: drop context slots no block can see any more."""
        if self.keep is not None and kvcache.physical_len(self.cache) > self.keep + self.slack:
            drop = kvcache.drop_front(self.cache, self.lens, self.keep)
            self.lens, self.base = self.lens - drop, self.base + drop
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes)

    @property
    def kv_bytes(self) -> int:
        """Draft context K/V memory now held (benchmarks report it by context length)."""
        return kvcache.nbytes(self.cache)


class OracleProposer:
    """Proposes each request's precomputed target continuation (``Request.oracle``): the
    engine's ceiling, since under greedy decoding every draft is accepted."""

    needs_features = False
    layer_ids = None

    def admit(self, engine, rows, features, lens):
        pass

    def propose(self, engine: Engine, k: int):
        out = torch.zeros(len(engine.rows), k, dtype=torch.long, device=engine.anchors.device)
        for i, row in enumerate(engine.rows):
            cont = row.request.oracle or []
            nxt = cont[len(row.tokens): len(row.tokens) + k]
            if nxt:
                out[i, : len(nxt)] = torch.tensor(nxt)
        return out, None

    def commit(self, features, keep):
        pass

    def select(self, idx):
        pass


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
    ``lookup_len`` (default: unbounded) the lookup's, both within the engine's width; a
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


def drafter_proposer(drafter, target: Target, block_size: int,
                     lookup_block: int = 0) -> DFlashProposer | HybridProposer:
    """A drafter drafting blocks of its trained ``block_size`` B: alone, or with prompt lookup
    beside it when ``lookup_block`` > 1. Run it in an engine of
    ``engine_width(block_size, lookup_block)``."""
    proposer = DFlashProposer(drafter, target)
    return HybridProposer(proposer, block_size) if lookup_block > 1 else proposer


def engine_width(block_size: int, lookup_block: int = 0) -> int:
    """The engine's width (tokens verified per cycle, anchor included) for
    ``drafter_proposer``: ``max(B, lookup_block)``, since the lookup may draft past the
    drafter's block; the drafter keeps its own ``block_size`` B."""
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


def _cat_padded(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    """Concatenate (B, T, F) tensors on the batch dim, right-padding T."""
    if a is None or a.shape[0] == 0:
        return b
    T = max(a.shape[1], b.shape[1])
    pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, T - x.shape[1]))  # noqa: E731
    return torch.cat([pad(a), pad(b)])
