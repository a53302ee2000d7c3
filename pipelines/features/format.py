"""The feature-shard format: row schema, feature encodings, manifest checks.

A run directory (local path or ``s3://bucket/prefix``)::

    run.json              the settings the run was started with (restarts must match)
    shards/shard-00000-<attempt>[-<k>].parquet   a shard's files, each closed at storage.shard_bytes
    progress/shard-00000.json   commit record of one shard: its files, rows, sha256s, ...
    manifest.json         written LAST: the run is complete and these shards are its data;
                          per shard also ``row_groups`` ({offset, length, rows, sha256} of each
                          row group's byte range) and ``footer`` (the same for the Parquet
                          footer), so a reader checks one row group at a time; held-out shards
                          (``storage.holdout_fraction``) carry ``"split": "holdout"``

One Parquet row per sample (:func:`shard_schema`):

==============  ==================  ====================================================
``id``          string              prompt id from the source (unique in the run)
``input_ids``   list<int32>         prompt + regenerated response, as the target saw them
``loss_mask``   list<int8>          1 on response tokens (the target's own), 0 on the prompt
``num_tokens``  int32               len(input_ids)
``prompt_tokens`` int32             tokens before the response
``finish_reason`` string            "stop" (end of turn) or "length" (hit max_new_tokens)
``features``    large_binary        C-order array (num_tokens, n_layers * hidden_size):
                                    the outputs of ``layer_ids`` concatenated in that order,
                                    as float16, bfloat16 (raw bits) or int8
``scales``      large_binary, null  int8 only: float32 (num_tokens, n_layers), one absmax
                                    scale per token and layer; x = q * scale
``teacher_ids`` large_binary, null  with ``teacher_topk`` K > 0: int32 (num_tokens, K), the
                                    target's K most likely next tokens after each position
``teacher_logprobs`` large_binary, null  float16 (num_tokens, K): their log-probabilities
                                    under the target's full vocabulary (distillation targets)
==============  ==================  ====================================================

Features are raw bytes rather than nested lists so that a token costs exactly
``n_layers * hidden * bytes`` (plus 5 bytes of ids and mask) and decodes without copies.
int8 storage is symmetric absmax per (token, layer): every value is within
``max|x| / 254`` of the original, ``max`` over that token's slice of that layer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    import torch

# torch is imported where a tensor is made, not above: Ray Data's read tasks import this module
# for the manifest checks, and torch costs each of their processes a second of CPU.

FORMAT = "dflash-features"
SCHEMA_VERSION = 2  # 2: per-row-group digests and held-out shards in the manifest
READABLE_SCHEMA_VERSIONS = (1, 2)  # 1: whole-file sha256 only, every shard for training
STORED_DTYPES = ("float16", "bfloat16", "int8")
_ITEM_BYTES = {"float16": 2, "bfloat16": 2, "int8": 1}


def shard_schema(metadata: dict | None = None) -> pa.Schema:
    """The Parquet schema of a shard; ``metadata`` (the layout) is stored in the footer."""
    schema = pa.schema([
        ("id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("num_tokens", pa.int32()),
        ("prompt_tokens", pa.int32()),
        ("finish_reason", pa.string()),
        ("features", pa.large_binary()),  # 64-bit offsets: a row group may exceed 2 GiB
        ("scales", pa.large_binary()),
        ("teacher_ids", pa.large_binary()),
        ("teacher_logprobs", pa.large_binary()),
    ])
    if metadata:
        schema = schema.with_metadata({"dflash_features": json.dumps(metadata, sort_keys=True)})
    return schema


@dataclass(frozen=True)
class FeatureLayout:
    """How one sample's features are laid out in bytes."""

    dtype: str  # float16 | bfloat16 | int8
    layer_ids: tuple[int, ...]
    hidden_size: int
    teacher_topk: int = 0  # K > 0: each row also stores the target's top-K next-token log-probs

    def __post_init__(self):
        if self.dtype not in STORED_DTYPES:
            raise ValueError(f"feature dtype must be one of {STORED_DTYPES}, got {self.dtype!r}")
        object.__setattr__(self, "layer_ids", tuple(int(i) for i in self.layer_ids))
        object.__setattr__(self, "teacher_topk", int(self.teacher_topk or 0))

    @classmethod
    def from_manifest(cls, manifest: dict) -> "FeatureLayout":
        """The layout of a manifest (or of a shard's ``layout`` record); runs made before
        teacher log-probs existed have none."""
        return cls(manifest["dtype"], tuple(manifest["layer_ids"]), int(manifest["hidden_size"]),
                   int(manifest.get("teacher_topk") or 0))

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def feature_dim(self) -> int:
        return self.num_layers * self.hidden_size

    @property
    def nominal_bytes_per_token(self) -> int:
        """layers x hidden x bytes (+ 6 bytes per stored teacher log-prob): the planning
        figure (docs/training.md, feature shards)."""
        return self.feature_dim * _ITEM_BYTES[self.dtype] + 6 * self.teacher_topk

    def as_dict(self) -> dict:
        return {"dtype": self.dtype, "layer_ids": list(self.layer_ids), "hidden_size": self.hidden_size,
                "feature_dim": self.feature_dim, "scale_dtype": "float32" if self.dtype == "int8" else None,
                "teacher_topk": self.teacher_topk}

    # ------------------------------------------------------------------ encode / decode
    def encode(self, feats: torch.Tensor) -> tuple[bytes, bytes | None]:
        """(features, scales) bytes of one sample's (T, feature_dim) features."""
        return self.encode_batch(feats[None], [feats.shape[0]])[0]

    def encode_batch(self, feats: torch.Tensor, lengths: list[int]) -> list[tuple[bytes, bytes | None]]:
        """(features, scales) bytes per row of right-padded (B, T, feature_dim) features.
        The conversion runs where ``feats`` live (GPU or CPU); only the stored width crosses
        to host memory."""
        import torch

        if feats.dim() != 3 or feats.shape[-1] != self.feature_dim:
            raise ValueError(f"expected features of shape (B, T, {self.feature_dim}), got {tuple(feats.shape)}")
        B, T, _ = feats.shape
        feats = feats.detach()
        scales = None
        if self.dtype == "int8":
            q, s = quantize_int8(feats.reshape(B, T, self.num_layers, self.hidden_size))
            stored, scales = q.reshape(B, T, -1).cpu(), s.reshape(B, T, -1).cpu()
        else:
            stored = feats.to(getattr(torch, self.dtype))
            valid = torch.arange(T, device=feats.device)[None] < torch.tensor(lengths, device=feats.device)[:, None]
            if not bool((torch.isfinite(stored).all(-1) | ~valid).all()):
                raise ValueError(f"target features overflow {self.dtype}; store them as bfloat16 or int8 "
                                 "(features.storage.dtype)")
            if self.dtype == "bfloat16":
                stored = stored.view(torch.int16)  # numpy has no bfloat16: keep the raw bits
            stored = stored.cpu()
        return [(_to_bytes(stored[b, :n]), None if scales is None else _to_bytes(scales[b, :n]))
                for b, n in enumerate(lengths)]

    def decode(self, features: bytes, scales: bytes | None, num_tokens: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """The (num_tokens, feature_dim) features of one row, as ``dtype`` (float32 if None)."""
        import torch

        dtype = dtype or torch.float32
        shape = (int(num_tokens), self.feature_dim)
        if self.dtype == "int8":
            # the buffers are read-only; copies keep torch from aliasing them (int8 is small)
            q = torch.from_numpy(np.frombuffer(features, dtype=np.int8).reshape(num_tokens, self.num_layers, -1).copy())
            s = torch.from_numpy(np.frombuffer(scales, dtype=np.float32).reshape(num_tokens, self.num_layers, 1).copy())
            return dequantize_int8(q, s).reshape(shape).to(dtype)
        raw = np.frombuffer(features, dtype=np.int16 if self.dtype == "bfloat16" else np.float16).reshape(shape)
        t = torch.from_numpy(raw.copy())  # the buffer is read-only
        if self.dtype == "bfloat16":
            t = t.view(torch.bfloat16)
        return t.to(dtype)

    def encode_teacher(self, ids: torch.Tensor, logprobs: torch.Tensor,
                       lengths: list[int]) -> list[tuple[bytes, bytes]]:
        """(teacher_ids, teacher_logprobs) bytes per row of right-padded (B, T, K) top-K
        next-token ids and log-probs (see ``Target.topk_logprobs``)."""
        import torch

        if ids.shape != logprobs.shape or ids.dim() != 3 or ids.shape[-1] != self.teacher_topk:
            raise ValueError(f"expected teacher ids and log-probs of shape (B, T, {self.teacher_topk}), "
                             f"got {tuple(ids.shape)} and {tuple(logprobs.shape)}")
        ids = ids.to(torch.int32).cpu()
        # log-probs far in the tail (< -65504 would be -inf in float16) carry no mass: clamp them
        logprobs = logprobs.float().clamp(min=-1e4).to(torch.float16).cpu()
        return [(_to_bytes(ids[b, :n]), _to_bytes(logprobs[b, :n])) for b, n in enumerate(lengths)]

    def decode_teacher(self, ids: bytes, logprobs: bytes, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (num_tokens, K) teacher ids (long) and log-probs (float32) of one row."""
        import torch

        shape = (int(num_tokens), self.teacher_topk)
        i = torch.from_numpy(np.frombuffer(ids, dtype=np.int32).reshape(shape).astype(np.int64))
        lp = torch.from_numpy(np.frombuffer(logprobs, dtype=np.float16).reshape(shape).astype(np.float32))
        return i, lp

    def decode_row(self, row: dict, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """A stored row as tensors: ``input_ids`` (T,) long, ``loss_mask`` (T,) bool,
        ``features`` (T, n_layers * hidden) in ``dtype``; with teacher log-probs also
        ``teacher_ids`` (T, K) long and ``teacher_logprobs`` (T, K) float32."""
        import torch

        n = int(row["num_tokens"])
        out = {
            "input_ids": torch.as_tensor(np.asarray(row["input_ids"], dtype=np.int64)),
            "loss_mask": torch.as_tensor(np.asarray(row["loss_mask"], dtype=np.int8)).bool(),
            "features": self.decode(row["features"], row.get("scales"), n, dtype),
        }
        if self.teacher_topk:
            out["teacher_ids"], out["teacher_logprobs"] = self.decode_teacher(
                row["teacher_ids"], row["teacher_logprobs"], n)
        return out


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 over the last dim: (q int8, scale float32 with last dim 1).
    Since |x / scale| <= 127 nothing clips, so |x - q * scale| <= scale / 2 = absmax / 254."""
    import torch

    x = x.to(torch.float32)
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero slice: any scale works
    q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    import torch

    return q.to(torch.float32) * scale.to(torch.float32)


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


# ---------------------------------------------------------------------------- fingerprints
def tokenizer_fingerprint(tokenizer) -> dict:
    """Hashes of the vocabulary (with special tokens) and of the chat template: features
    are only valid for the token ids and prompt rendering they were made with."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id,
               "special": sorted(map(str, tokenizer.all_special_tokens))}
    tok_hash = hashlib.sha256(json.dumps([vocab, special], ensure_ascii=False).encode()).hexdigest()
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    return {"hash": tok_hash, "chat_template_hash": hashlib.sha256(template.encode()).hexdigest()}


# ---------------------------------------------------------------------------- manifest checks
class ManifestMismatchError(ValueError):
    """Stored features made for another target (or layers); ``field`` names what differs."""

    def __init__(self, uri: str, field: str, found, expected):
        self.field, self.found, self.expected = field, found, expected
        super().__init__(f"features at {uri} do not match the target they are read for: manifest field "
                         f"'{field}' is {found!r}, expected {expected!r}")


class CorruptShardError(IOError):
    """A shard whose bytes, size or row count differ from its manifest entry."""

    def __init__(self, shard: str, reason: str):
        self.shard, self.reason = shard, reason
        super().__init__(f"corrupt feature shard {shard}: {reason}")


def check_manifest(manifest: dict, uri: str, *, target_identity: str | None = None,
                   layer_ids: list[int] | None = None, hidden_size: int | None = None,
                   tokenizer_hash: str | None = None) -> None:
    """Raise :class:`ManifestMismatchError` naming the first field that differs from what
    the reader expects (None: not checked)."""
    if manifest.get("format") != FORMAT:
        raise ManifestMismatchError(uri, "format", manifest.get("format"), FORMAT)
    if manifest.get("schema_version") not in READABLE_SCHEMA_VERSIONS:
        raise ManifestMismatchError(uri, "schema_version", manifest.get("schema_version"),
                                    " or ".join(map(str, READABLE_SCHEMA_VERSIONS)))
    checks = [
        ("target.identity", manifest["target"]["identity"], target_identity),
        ("layer_ids", list(manifest["layer_ids"]), None if layer_ids is None else [int(i) for i in layer_ids]),
        ("hidden_size", manifest["hidden_size"], hidden_size),
        ("tokenizer.hash", manifest["tokenizer"]["hash"], tokenizer_hash),
    ]
    for field, found, expected in checks:
        if expected is not None and found != expected:
            raise ManifestMismatchError(uri, field, found, expected)


def expected_for(target, layer_ids: list[int]) -> dict:
    """Keyword arguments for :func:`check_manifest` / ``read_features`` from a loaded
    ``specdec.target.Target``: features must come from this exact target and layers."""
    return {"target_identity": target.identity, "layer_ids": list(layer_ids), "hidden_size": target.hidden_size,
            "tokenizer_hash": tokenizer_fingerprint(target.tokenizer)["hash"] if target.tokenizer else None}
