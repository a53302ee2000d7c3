"""Model loading for the ``hf`` backend (our speculative engine in every replica; the
replica deployment in ``replica.py`` pairs the target with its drafter). The ``vllm``
backend lives in ``vllm_app.py``."""

from __future__ import annotations

import logging

from serve_app.config import ServeConfig

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- hf
def load_target(cfg: ServeConfig):
    from specdec.target import load_target as _load

    return _load(cfg.target, dtype=cfg.dtype, device=cfg.device)


def load_paired_drafter(path: str, target, dtype: str | None = None, device: str = "cpu"):
    """Load a drafter and check that it belongs to ``target``. Raises
    ``specdec.checkpoint.DrafterMismatchError`` (naming the field) when it does not."""
    import torch

    from specdec.checkpoint import load_drafter

    return load_drafter(path, dtype=getattr(torch, dtype) if dtype else None, device=device, target=target)
