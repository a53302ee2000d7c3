"""The target's teacher-forced pass over a shard's sequences: loading the target inside a stage
actor, resolving the layers to capture, and their hidden states (plus the target's top-k
log-probs when the run stores them); :class:`FeatureRecorder` keeps the features decoding
computes anyway (``extract.from_generation``).
"""

from __future__ import annotations

import torch

from pipelines.config import ConfigError


def load_stage_target(target: dict, num_gpus: float, num_cpus: float | None = None):
    """The target for a worker: on the GPU when the stage asked Ray for one. On a CPU the
    stage's ``num_cpus`` sets torch's thread count: Ray exports no OMP_NUM_THREADS for
    fractional CPUs, and every actor then spawning one thread per core oversubscribes."""
    from specdec.target import load_target

    device = "cuda" if num_gpus > 0 and torch.cuda.is_available() else "cpu"
    if device == "cpu" and num_cpus is not None:
        torch.set_num_threads(max(1, round(num_cpus)))
    return load_target(target["model"], dtype=target["dtype"], device=device,
                       trust_remote_code=target["trust_remote_code"])


def resolve_layer_ids(layer_ids: list[int] | None, num_features: int, num_target_layers: int) -> list[int]:
    """The configured layers, or the drafter's default spacing; checked against the target."""
    from specdec.checkpoint_format import default_target_layer_ids

    if layer_ids is None:
        layer_ids = default_target_layer_ids(num_target_layers, num_features)
        if len(set(layer_ids)) != len(layer_ids):
            raise ConfigError(f"features.num_layers: {num_features} layers spaced over a {num_target_layers}-layer "
                              f"target repeat layers ({layer_ids}); set features.layer_ids")
    # <= L-2: the exported drafter must load in vLLM, which reads layer i+1's input for layer i
    bad = [i for i in layer_ids if i > num_target_layers - 2]
    if bad:
        raise ConfigError(f"features.layer_ids: layers {bad} out of range; a {num_target_layers}-layer target "
                          f"allows 0..{num_target_layers - 2} (the last layer's output is not a drafter feature)")
    return list(layer_ids)


@torch.no_grad()
def target_features(target, layer_ids: list[int], sequences: list[list[int]], teacher_topk: int = 0
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(B, T_max, n_layers * hidden) features of right-padded sequences (causal, so
    padding after a sequence never reaches it), and with ``teacher_topk`` K the target's
    top-K next-token (ids, log-probs), each (B, T_max, K), from the same pass. Stored
    shards and streamed training rows (``pipelines/train/streamed.py``) both come from here."""
    dev = target.device
    lens = [len(s) for s in sequences]
    ids = torch.zeros(len(sequences), max(lens), dtype=torch.long, device=dev)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long, device=dev)
    pos = torch.arange(ids.shape[1], device=dev)[None].expand_as(ids)
    out = target(ids, pos, None, None, layer_ids)
    return out.features, (target.topk_logprobs(out.hidden, teacher_topk) if teacher_topk else None)


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
        self.live: list[tuple[object, list[torch.Tensor]]] = []  # (engine Result, feature parts)
        self.done: dict[int, torch.Tensor] = {}

    def admit(self, engine, rows, features, lens):
        for i, row in enumerate(rows):
            self.live.append((row, [self._keep(features[i, : int(lens[i])])]))

    def propose(self, engine, k: int):
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

    def features(self, result) -> torch.Tensor:
        """The finished ``result``'s features (popped: each is handed out once)."""
        return self.done.pop(id(result.request))

    def _keep(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype) if self.dtype is not None else x.clone()


def pad_stack(rows: list[torch.Tensor]) -> torch.Tensor:
    """(B, T_max, F) from (T_i, F) tensors, right-padded with zeros."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
