"""Engine backends, chosen by ``backend`` in the config.

* ``hf`` (default, CPU or GPU): our speculative engine (specdec) in every replica; the
  replica deployment in ``replica.py`` pairs the target with its drafter.
* ``vllm`` (GPU): Ray Serve LLM runs vLLM with DFlash speculative decoding
  (``speculative_config = {"method": "dflash", "model": <drafter dir>,
  "num_speculative_tokens": B - 1}``). ``vllm_llm_config`` builds the ``LLMConfig``
  fields as a plain dict, so the config is produced and tested on machines without vLLM;
  only ``build_vllm_app`` imports ``ray.serve.llm`` (which needs vLLM).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

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


# ---------------------------------------------------------------------- vllm
def drafter_block_size(drafter_dir: str | Path) -> int:
    """B from a drafter checkpoint's config (read as ``specdec.checkpoint`` reads it)."""
    from specdec.drafter import DrafterConfig

    return DrafterConfig.from_hf_dict(json.loads((Path(drafter_dir) / "config.json").read_text())).block_size


def vllm_llm_config(cfg: ServeConfig, target_path: str, drafter_dir: str | None) -> dict:
    """Keyword arguments of ``ray.serve.llm.LLMConfig`` for this app on vLLM.

    The drafter directory is the exported checkpoint itself (published DFlash layout).
    A fixed ``block_size`` overrides the drafter's B; "auto" uses B (vLLM fixes the
    number of speculative tokens at engine start); "off" or no drafter: no speculation.
    """
    from serve_app.autoscaling import autoscaling_config_dict

    engine_kwargs: dict = {"dtype": "auto" if cfg.dtype == "float32" else cfg.dtype,
                           "tensor_parallel_size": cfg.tensor_parallel_size}
    if drafter_dir is not None and cfg.block_size != "off":
        block = cfg.block_size if isinstance(cfg.block_size, int) else drafter_block_size(drafter_dir)
        engine_kwargs["speculative_config"] = {"method": "dflash", "model": str(drafter_dir),
                                               "num_speculative_tokens": int(block) - 1}
    engine_kwargs.update(cfg.vllm_engine_kwargs)
    out = {
        "model_loading_config": {"model_id": cfg.served_model_name, "model_source": str(target_path)},
        "engine_kwargs": engine_kwargs,
        "deployment_config": {
            "autoscaling_config": autoscaling_config_dict(cfg),
            "max_ongoing_requests": cfg.replica_max_ongoing_requests,
        },
        "log_engine_metrics": True,
    }
    if cfg.accelerator_type:
        out["accelerator_type"] = cfg.accelerator_type
    return out


def build_vllm_app(cfg: ServeConfig):
    """The Ray Serve LLM OpenAI app (GPU machines with vLLM installed)."""
    from ray.serve.llm import LLMConfig, build_openai_app  # needs vLLM

    from serve_app.registry import DrafterNotFound, DrafterSource
    from specdec.target import resolve_target_path

    drafter_dir = None
    if cfg.speculation_requested:
        try:
            drafter_dir = DrafterSource(cfg.drafter_source, cfg.tracking_uri).fetch().path
        except DrafterNotFound:
            if cfg.drafter != "auto":
                raise
            drafter_dir = cfg.reference_drafter
            if drafter_dir is None:
                log.warning("no drafter registered as %s; serving without speculation", cfg.drafter_source)
    llm_config = LLMConfig(**vllm_llm_config(cfg, resolve_target_path(cfg.target), drafter_dir))
    return build_openai_app({"llm_configs": [llm_config]})
