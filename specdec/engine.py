"""The speculative engine: prefill -> draft -> verify -> accept -> commit.

One ``step`` runs one cycle for every live row at once: the proposer drafts K tokens per
row, the target verifies all rows' blocks in ONE forward pass (rows may hold different
numbers of committed tokens: see kvcache.py), each row keeps its own accepted prefix
and the caches drop every rejected position. ``generate`` is the static-batch loop;
``add`` + ``step`` give continuous batching to a server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache

from specdec import kvcache
from specdec.draft_vocab import head_for
from specdec.sampling import GREEDY, SamplingParams, probs_from_logits, sample
from specdec.target import Target
from specdec.verify import greedy_accept, speculative_accept


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int = 128
    params: SamplingParams = GREEDY
    stop_ids: frozenset[int] | None = None  # None: the target's stop tokens
    id: object = None
    oracle: list[int] | None = None  # the target's own continuation, for OracleProposer


@dataclass
class Stats:
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0
    cycles: int = 0
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per cycle (A)

    @property
    def tau(self) -> float | None:
        """Mean tokens committed per cycle, E[A + 1]."""
        return (sum(self.accepted) / len(self.accepted) + 1) if self.accepted else None

    def as_dict(self) -> dict:
        return {"cycles": self.cycles, "tau": self.tau, "accepted": list(self.accepted),
                "prefill_s": self.prefill_s, "draft_s": self.draft_s, "verify_s": self.verify_s,
                "overhead_s": self.overhead_s}


@dataclass
class Result:
    request: Request
    tokens: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    stats: Stats = field(default_factory=Stats)


class Proposer(Protocol):
    """Drafts K tokens per live row. State is per row and follows the engine's row order."""

    needs_features: bool

    def admit(self, engine: "Engine", rows: list[Result], features: torch.Tensor | None, lens: torch.Tensor) -> None: ...
    def propose(self, engine: "Engine", k: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    def commit(self, features: torch.Tensor | None, keep: torch.Tensor) -> None: ...
    def select(self, idx: torch.Tensor) -> None: ...


class Engine:
    def __init__(self, target: Target, proposer: Proposer | None = None, block_size: int = 16,
                 seed: int | None = None):
        self.target = target
        self.proposer = proposer
        self.block_size = block_size
        self.generator = torch.Generator(device=target.device)
        self.generator.manual_seed(seed if seed is not None else torch.seed())
        self.default_stop = frozenset(target.stop_token_ids())
        self.layer_ids = getattr(proposer, "layer_ids", None) if proposer and proposer.needs_features else None
        self.rows: list[Result] = []
        self.cache = DynamicCache()
        self.lens = torch.zeros(0, dtype=torch.long, device=target.device)
        self.anchors = torch.zeros(0, dtype=torch.long, device=target.device)

    # ------------------------------------------------------------------ public
    def generate(self, requests: list[Request], block_size: int | None = None) -> list[Result]:
        """Run ``requests`` as one batch to completion; results in request order."""
        done = self.add(requests)
        while self.rows:
            done += self.step(block_size)
        order = {id(r): i for i, r in enumerate(requests)}
        return sorted(done, key=lambda res: order[id(res.request)])

    def add(self, requests: list[Request]) -> list[Result]:
        """Prefill new requests and join them to the live batch; returns any already done."""
        if not requests:
            return []
        t0 = time.perf_counter()
        dev = self.target.device
        for r in requests:
            if not r.prompt:
                raise ValueError("empty prompt")
            if len(r.prompt) >= self.target.max_positions:
                raise ValueError(f"prompt of {len(r.prompt)} tokens exceeds the context length {self.target.max_positions}")
        lens = torch.tensor([len(r.prompt) for r in requests], device=dev)
        P = int(lens.max())
        ids = torch.zeros(len(requests), P, dtype=torch.long, device=dev)
        for i, r in enumerate(requests):
            ids[i, : len(r.prompt)] = torch.tensor(r.prompt, device=dev)
        cache = DynamicCache()
        pos = torch.arange(P, device=dev)[None].expand(len(requests), -1)
        # causal alone suffices: a real query never sees the right padding after it
        mask = kvcache.attention_mask(lens, 0, P, causal=True)
        out = self.target(ids, pos, cache, mask, self.layer_ids)
        last = out.hidden[torch.arange(len(requests)), lens - 1][:, None]
        first = self._pick(self.target.logits(last), [r.params for r in requests])[:, 0]
        rows = [Result(r, []) for r in requests]
        if self.proposer is not None:
            self.proposer.admit(self, rows, out.features, lens)
        self.cache, self.lens = kvcache.concat([self.cache, cache], [self.lens, lens])
        self.anchors = torch.cat([self.anchors, first])
        self.rows += rows
        dt = time.perf_counter() - t0
        for row, tok in zip(rows, first.tolist()):
            row.stats.prefill_s = dt
            self._emit(row, [tok])
        return self._drop_finished()

    def step(self, block_size: int | None = None) -> list[Result]:
        """One draft/verify cycle for every live row; returns rows that finished."""
        if not self.rows:
            return []
        t0 = time.perf_counter()
        k = self._block_len(block_size or self.block_size) if self.proposer is not None else 1
        draft, q = torch.zeros(len(self.rows), 0, dtype=torch.long, device=self.anchors.device), None
        if k > 1:
            draft, q = self.proposer.propose(self, k - 1)
        t1 = time.perf_counter()

        block = torch.cat([self.anchors[:, None], draft], dim=1)
        past = kvcache.physical_len(self.cache)
        pos = self.lens[:, None] + torch.arange(k, device=block.device)
        mask = kvcache.attention_mask(self.lens, past, k, causal=True)
        out = self.target(block, pos, self.cache, mask, self.layer_ids)
        logits = self.target.logits(out.hidden)
        params = [r.request.params for r in self.rows]
        if all(p.greedy for p in params):
            num_acc, toks = greedy_accept(draft, logits.argmax(-1))
        else:
            num_acc, toks = speculative_accept(draft, q, probs_from_logits(logits, params), self.generator)
        t2 = time.perf_counter()

        keep = num_acc + 1  # the anchor and the accepted drafts enter the cache
        self.lens = kvcache.commit(self.cache, self.lens, past, keep)
        if self.proposer is not None:
            self.proposer.commit(out.features, keep)
        rows_idx = torch.arange(len(self.rows), device=toks.device)
        self.anchors = toks[rows_idx, num_acc]
        for row, a, emitted in zip(self.rows, num_acc.tolist(), toks.tolist()):
            row.stats.accepted.append(a)
            self._emit(row, emitted[: a + 1])
        t3 = time.perf_counter()
        for row in self.rows:
            s = row.stats
            s.cycles += 1
            s.draft_s += t1 - t0
            s.verify_s += t2 - t1
            s.overhead_s += t3 - t2
        return self._drop_finished()

    def cancel(self, request: Request) -> Result | None:
        """Drop a live request (e.g. its client went away) and free its slot."""
        for i, row in enumerate(self.rows):
            if row.request is request:
                row.finish_reason = "cancelled"
                return self._drop_finished()[0]
        return None

    # ------------------------------------------------------------------ internals
    def _pick(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        if all(p.greedy for p in params):
            return logits.argmax(-1)
        return sample(probs_from_logits(logits, params), self.generator)

    def _block_len(self, k: int) -> int:
        """Shrink the block at the context limit and when no row needs that many tokens."""
        room = int((self.target.max_positions - self.lens).min())
        need = max(r.request.max_new_tokens - len(r.tokens) for r in self.rows)
        return max(1, min(k, room, need))

    def _emit(self, row: Result, tokens: list[int]) -> None:
        stop = row.request.stop_ids if row.request.stop_ids is not None else self.default_stop
        for t in tokens:
            row.tokens.append(t)
            if t in stop:
                row.finish_reason = "stop"
                return
            if len(row.tokens) >= row.request.max_new_tokens:
                row.finish_reason = "length"
                return
        if len(row.request.prompt) + len(row.tokens) >= self.target.max_positions:
            row.finish_reason = "length"

    def _drop_finished(self) -> list[Result]:
        done = [r for r in self.rows if r.finish_reason is not None]
        if done:
            keep = torch.tensor([i for i, r in enumerate(self.rows) if r.finish_reason is None],
                                dtype=torch.long, device=self.anchors.device)
            self.rows = [r for r in self.rows if r.finish_reason is None]
            self.lens = kvcache.select_rows(self.cache, keep, self.lens)
            self.anchors = self.anchors[keep]
            if self.proposer is not None:
                self.proposer.select(keep)
        return done


# ---------------------------------------------------------------------- proposers
class DFlashProposer:
    """Drafts with a DFlash drafter: context K/V cached per committed position; the block
    ``[anchor, MASK x K]`` is denoised in one pass and its K/V are never stored."""

    needs_features = True

    def __init__(self, drafter, target: Target):
        from specdec.cpu_kernels import pack_linears

        self.drafter = drafter
        self.target = target
        self.head = head_for(drafter, target)  # the target's LM head, maybe over V_d only
        pack_linears(drafter)  # inference only; a no-op off CPU, for float64 and once packed
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.mask_id = drafter.config.mask_token_id
        self.cache = DynamicCache()
        self.lens = torch.zeros(0, dtype=torch.long, device=target.device)
        self.pending: torch.Tensor | None = None  # (B, n, F) features not yet in the cache
        self.pending_n = torch.zeros(0, dtype=torch.long, device=target.device)

    def admit(self, engine, rows, features, lens):
        # The prompts go straight into the new rows' own cache. Left pending, they would be
        # ingested together with the live rows' few pending features, padded to the longest
        # prompt: a drafter pass over (all rows x prompt length) for every admission.
        cache = DynamicCache()
        pos = torch.arange(features.shape[1], device=lens.device)[None].expand(len(rows), -1)
        kvcache.append(cache, self.drafter.context_kv(features, pos))  # padded past lens, masked by lens
        self.cache, self.lens = kvcache.concat([self.cache, cache], [self.lens, lens])
        self.pending = _cat_padded(self.pending, features[:, :0])
        self.pending_n = torch.cat([self.pending_n, torch.zeros_like(lens)])

    @torch.no_grad()
    def propose(self, engine: Engine, k: int):
        self._ingest()
        B = len(engine.rows)
        dev = engine.anchors.device
        block = torch.full((B, k + 1), self.mask_id, dtype=torch.long, device=dev)
        block[:, 0] = engine.anchors
        pos = self.lens[:, None] + torch.arange(k + 1, device=dev)
        past = kvcache.physical_len(self.cache)
        mask = kvcache.attention_mask(self.lens, past, k + 1, causal=False)
        ctx = [(layer.keys, layer.values) for layer in self.cache.layers]
        hidden = self.drafter(self.target.embed(block), pos, ctx, mask)
        logits = self.head(hidden[:, 1:].to(self.target.dtype))
        params = [r.request.params for r in engine.rows]
        if all(p.greedy for p in params):
            return self.head.to_target(logits.argmax(-1)), None
        # q is the drafter's true proposal law: the same transform, zero outside V_d
        q = probs_from_logits(self.head.full_logits(logits), params)
        return sample(q, engine.generator), q

    def commit(self, features, keep):
        self.pending = features[:, : int(keep.max())]
        self.pending_n = keep

    def select(self, idx):
        self.lens = kvcache.select_rows(self.cache, idx, self.lens)
        self.pending = self.pending[idx] if self.pending is not None else None
        self.pending_n = self.pending_n[idx]

    def _ingest(self):
        """Move pending target features into the context cache (compacted per row)."""
        if self.pending is None or self.pending.shape[1] == 0:
            return
        n = self.pending.shape[1]
        pos = self.lens[:, None] + torch.arange(n, device=self.lens.device)
        past = kvcache.physical_len(self.cache)
        kvcache.append(self.cache, self.drafter.context_kv(self.pending, pos))
        self.lens = kvcache.commit(self.cache, self.lens, past, self.pending_n)
        self.pending = self.pending[:, :0]
        self.pending_n = torch.zeros_like(self.pending_n)


class OracleProposer:
    """Proposes each request's precomputed target continuation (``Request.oracle``): the
    engine's ceiling, since under greedy decoding every draft is accepted."""

    needs_features = False

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


class FeatureRecorder:
    """Never drafts (run the engine at ``block_size=1``); keeps the target features that
    plain decoding computes anyway, so training data needs no second, teacher-forced pass.

    Every position a sequence's tokens occupy gets its features except the last generated
    token, which is never fed back: ``features(result)`` returns
    ``(len(prompt) + len(tokens), F)`` with that final row zero. Training never reads it
    (a block sees context strictly before its anchor)."""

    needs_features = True

    def __init__(self, layer_ids: list[int], dtype: torch.dtype | None = None):
        self.layer_ids = list(layer_ids)
        self.dtype = dtype  # e.g. float16: halve what a long generation holds
        self.live: list[tuple[Result, list[torch.Tensor]]] = []
        self.done: dict[int, torch.Tensor] = {}

    def admit(self, engine, rows, features, lens):
        for i, row in enumerate(rows):
            self.live.append((row, [self._keep(features[i, : int(lens[i])])]))

    def propose(self, engine: Engine, k: int):
        raise RuntimeError("FeatureRecorder never drafts: run the engine with block_size=1")

    def commit(self, features, keep):
        for i, (_, parts) in enumerate(self.live):
            parts.append(self._keep(features[i, : int(keep[i])]))

    def select(self, idx):
        kept = set(idx.tolist())
        for i, (row, parts) in enumerate(self.live):
            if i not in kept:
                feats = torch.cat(parts)
                self.done[id(row.request)] = torch.cat([feats, feats.new_zeros(1, feats.shape[1])])
        self.live = [self.live[i] for i in idx.tolist()]

    def features(self, result: Result) -> torch.Tensor:
        """The finished ``result``'s features (popped: each is handed out once)."""
        return self.done.pop(id(result.request))

    def _keep(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype) if self.dtype is not None else x.clone()


def _cat_padded(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    """Concatenate (B, T, F) tensors on the batch dim, right-padding T."""
    if a is None or a.shape[0] == 0:
        return b
    T = max(a.shape[1], b.shape[1])
    pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, T - x.shape[1]))  # noqa: E731
    return torch.cat([pad(a), pad(b)])
