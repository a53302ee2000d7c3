"""A reduced draft vocabulary: the drafter scores only the V_d tokens its training
responses use most, through the matching rows of the target's LM head.

Why: the full-vocabulary head is most of a small drafter's cost. For SmolLM2 (49,152 x
576) it is most of a CPU training step (7 offsets x 32 anchors x 4 sequences positions,
forward and backward) and a large part of each draft pass.

Exactness is untouched. Greedy: verification compares the draft with the target's own
argmax over the FULL vocabulary, so a smaller draft vocabulary can only lower acceptance.
Sampling: the proposal law q is the SAME temperature/top-k/top-p transform applied to the
draft logits over V_d, with q = 0 outside it (``full_logits`` puts -inf there); accepting
y ~ q with min(1, p/q) and resampling from max(p - q, 0) keeps the target's law for any q.

On disk the ids live beside the published layout in ``draft_vocab.json``
(``{"token_ids": [...]}``, sorted target ids). Not a ``.safetensors`` file on purpose:
vLLM loads every ``*.safetensors`` in a drafter directory as weights and refuses the
unknown tensor, so a sidecar there made our drafters unloadable in vLLM. Engines that do
not know the file (vLLM, SGLang) draft over the full vocabulary with the target's head;
our vLLM paths hand vLLM its own form of the draft vocabulary (specdec/vllm_drafter.py).
Drafters saved before carry ``draft_vocab.safetensors`` (tensor ``token_ids``), still read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

VOCAB_FILE = "draft_vocab.json"
LEGACY_VOCAB_FILE = "draft_vocab.safetensors"  # read only


def count_tokens(sequences: Iterable[tuple[list[int], list[int]]], vocab_size: int) -> torch.Tensor:
    """Response-token frequencies (V,) over ``(input_ids, loss_mask)`` pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in sequences:
        ids_t = torch.as_tensor(ids, dtype=torch.long)
        keep = torch.as_tensor(mask, dtype=torch.bool)
        counts += torch.bincount(ids_t[keep], minlength=vocab_size)[:vocab_size]
    return counts


def build_vocab(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent token ids (ties by lower id), plus ``always`` (stop
    tokens: a drafter must be able to propose the end of a turn), sorted ascending."""
    V = counts.numel()
    if not 0 < size <= V:
        raise ValueError(f"draft_vocab_size must be in [1, {V}], got {size}")
    always = sorted({int(t) for t in always if 0 <= int(t) < V})
    # stable sort on -count keeps lower ids first among equal counts: deterministic
    order = torch.sort(-counts.to(torch.long), stable=True).indices
    chosen = set(order[:size].tolist()) | set(always)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Share of counted tokens that fall inside ``ids``."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 1.0


def save_vocab(ids: torch.Tensor, directory: str | Path) -> Path:
    """Write ``draft_vocab.json`` (and drop a legacy ``draft_vocab.safetensors``)."""
    directory = Path(directory)
    path = directory / VOCAB_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"token_ids": [int(i) for i in ids.tolist()]}))
    tmp.replace(path)
    (directory / LEGACY_VOCAB_FILE).unlink(missing_ok=True)
    return path


def remove_vocab(directory: str | Path) -> None:
    """Drop the sidecar (overwriting a reduced-vocabulary drafter with a full one)."""
    for name in (VOCAB_FILE, LEGACY_VOCAB_FILE):
        (Path(directory) / name).unlink(missing_ok=True)


def load_vocab(directory: str | Path) -> torch.Tensor | None:
    """The ids saved beside a drafter, or None (a full-vocabulary drafter)."""
    directory = Path(directory)
    path = directory / VOCAB_FILE
    if path.exists():
        try:
            raw = json.loads(path.read_text()).get("token_ids")
            ids = torch.tensor(raw, dtype=torch.long)
        except (ValueError, TypeError, AttributeError, RuntimeError) as e:
            raise ValueError(f"{path}: expected {{\"token_ids\": [int, ...]}} ({e})") from None
    elif (directory / LEGACY_VOCAB_FILE).exists():
        from safetensors.torch import load_file

        path = directory / LEGACY_VOCAB_FILE
        try:
            ids = load_file(str(path))["token_ids"].to(torch.long)
        except Exception as e:  # safetensors raises its own error types for a corrupt file
            raise ValueError(f"{path}: not a token_ids safetensors file ({e})") from None
    else:
        return None
    if ids.dim() != 1 or ids.numel() == 0 or bool((ids[1:] <= ids[:-1]).any()):
        raise ValueError(f"{path}: token_ids must be a non-empty, strictly increasing 1-D list")
    return ids


def index_map(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) long: position of each target id in ``ids``, -1 outside the draft vocabulary."""
    out = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
    out[ids] = torch.arange(ids.numel(), device=ids.device)
    return out


class DraftHead(nn.Module):
    """The target's LM head over a draft vocabulary (``ids`` None: the full head).

    ``forward`` gives logits over V_d (with the target's soft-capping); ``to_target`` maps
    draft indices back to target ids; ``full_logits`` spreads V_d logits over the target
    vocabulary with -inf elsewhere (the proposal law under sampling)."""

    def __init__(self, target, ids: torch.Tensor | None = None):
        super().__init__()
        self._target = (target,)  # not a submodule: the target is neither trained nor saved
        self.vocab_size = target.vocab_size
        self.ids = None if ids is None else ids.to(target.device)
        if self.ids is not None:
            if int(self.ids.max()) >= self.vocab_size or int(self.ids.min()) < 0:
                raise ValueError(f"draft vocabulary has ids outside the target vocabulary ({self.vocab_size})")
            head = target.lm_head
            self.proj = nn.Linear(head.in_features, self.ids.numel(), bias=head.bias is not None)
            self.proj.weight = nn.Parameter(head.weight.detach()[self.ids].clone(), requires_grad=False)
            if head.bias is not None:
                self.proj.bias = nn.Parameter(head.bias.detach()[self.ids].clone(), requires_grad=False)
            self.index = index_map(self.ids, self.vocab_size)

    @property
    def size(self) -> int:
        return self.vocab_size if self.ids is None else self.ids.numel()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        target = self._target[0]
        if self.ids is None:
            return target.logits(hidden)
        return target.softcap(self.proj(hidden))

    def to_target(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.ids is None else self.ids[idx]

    def to_draft(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Draft indices of target ids (-1 for ids outside the draft vocabulary)."""
        return token_ids if self.ids is None else self.index[token_ids]

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.ids is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.ids, logits)


def head_for(drafter, target) -> DraftHead:
    """The drafter's head against ``target``, built (and packed for CPU) once per drafter,
    target weights and vocabulary: engines build a proposer per batch, and slicing and
    packing the head rows each time cost 30-60 ms."""
    from specdec.cpu_kernels import pack_linears

    key = (id(target), target.lm_head.weight.data_ptr(), drafter.draft_vocab)
    cached = getattr(drafter, "_draft_head", None)
    if cached is not None and cached[0][:2] == key[:2] and cached[0][2] is key[2]:
        return cached[1]
    head = DraftHead(target, drafter.draft_vocab)
    pack_linears(head)
    drafter._draft_head = (key, head)  # a plain attribute: never saved, never trained
    return head
