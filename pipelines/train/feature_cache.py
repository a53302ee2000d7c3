"""A node-local cache of the target's online features (``train.feature_cache``).

Online training runs the frozen target over every sequence each time it is seen: 80-90% of a
step at 4K-8K context on CPU, repeated every epoch and every evaluation. Small long-context
sets (LongAlign fine-tuning: a few hundred sequences, several epochs) are cheaper to keep:
the first pass writes each row's features (fp16 safetensors, one file per row, written
atomically), later passes read them. The features are rounded to fp16 on the first pass too,
so a step computes the same loss whether it hit the cache or not.

A row's file is named by its id and the hash of its (cut) token ids, under a folder named by
what the features are of (target, layers, teacher top-K): another target or layer choice
never reads them. Cost on disk: tokens x layers x hidden x 2 bytes (3.6K tokens of SmolLM2
at 5 layers: ~19 MB a row).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch


class FeatureCache:
    """Per-row target features (and the teacher's top-K when distilling) on local disk."""

    def __init__(self, root: str | Path, key: dict):
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.dir = Path(root) / digest
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "key.json").write_text(json.dumps(key, sort_keys=True, indent=1, default=str))
        self.hits = self.misses = 0

    def _path(self, row_id: str, tokens: torch.Tensor) -> Path:
        h = hashlib.sha256(row_id.encode() + b"\0" + tokens.cpu().numpy().tobytes()).hexdigest()[:32]
        return self.dir / f"{h}.safetensors"

    def _paths(self, batch) -> list[Path]:
        return [self._path(i, batch.input_ids[b, : int(n)]) for b, (i, n) in enumerate(zip(batch.ids, batch.lengths))]

    def load(self, batch, dtype: torch.dtype, teacher: bool):
        """(features, teacher or None) padded like ``batch``; None unless every row is cached."""
        from safetensors.torch import load_file

        paths = self._paths(batch)
        if not all(p.exists() for p in paths):
            self.misses += len(paths)
            return None
        self.hits += len(paths)
        rows = [load_file(str(p)) for p in paths]
        B, T = batch.input_ids.shape
        dev = batch.input_ids.device
        feats = torch.zeros(B, T, rows[0]["features"].shape[-1], dtype=dtype, device=dev)
        t_ids = t_logp = None
        if teacher:
            K = rows[0]["teacher_ids"].shape[-1]
            t_ids = torch.zeros(B, T, K, dtype=torch.long, device=dev)
            t_logp = torch.full((B, T, K), -1e4, device=dev)
        for b, row in enumerate(rows):
            n = row["features"].shape[0]
            feats[b, :n] = row["features"].to(dev, dtype)
            if teacher:
                t_ids[b, :n] = row["teacher_ids"].to(dev, torch.long)
                t_logp[b, :n] = row["teacher_logprobs"].to(dev)
        return feats, (None if t_ids is None else (t_ids, t_logp))

    def store(self, batch, features: torch.Tensor, teacher: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Write each row's real (unpadded) positions; an existing file is kept."""
        from safetensors.torch import save_file

        for b, (path, n) in enumerate(zip(self._paths(batch), batch.lengths.tolist())):
            if path.exists():
                continue
            row = {"features": features[b, :n].to(torch.float16).cpu().contiguous()}
            if teacher is not None:
                row["teacher_ids"] = teacher[0][b, :n].to(torch.int32).cpu().contiguous()
                row["teacher_logprobs"] = teacher[1][b, :n].float().cpu().contiguous()
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            save_file(row, str(tmp))
            os.replace(tmp, path)  # atomic: a reader never sees half a file
