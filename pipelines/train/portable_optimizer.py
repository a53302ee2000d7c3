"""DeepSpeed ZeRO-2 optimizer state in a form that does not depend on the world size.

ZeRO-2 shards the fp32 master weights and the AdamW moments over the workers, so its own
checkpoint only loads at the world size that wrote it. An elastic run (``train.num_workers:
[min, max]``) that restarts with more or fewer workers would lose its moments. Beside the
engine's checkpoint, each save therefore gathers every trainable parameter's fp32 master
weight and moments (DeepSpeed's ``safe_get_full_*``, a collective every rank joins) and
rank 0 writes them one safetensors file per parameter (memory bounded by the largest
parameter); a load at another world size re-shards them into the new engine
(``safe_set_full_*``). The same idea as DeepSpeed's universal checkpoint, without its
offline conversion step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

PORTABLE_DIR = "optimizer_full"
MOMENTS = ("exp_avg", "exp_avg_sq")  # torch AdamW's state, besides its step count


def _trainable(drafter: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]


def save_portable(engine, drafter: torch.nn.Module, directory: Path, rank: int) -> None:
    """Gather the full fp32 weights and moments of ``drafter`` (every rank must call) and
    write them under ``directory/optimizer_full`` from rank 0."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    out = Path(directory) / PORTABLE_DIR
    opt = engine.optimizer
    step = opt.optimizer.state[opt.single_partition_of_fp32_groups[0]].get("step", torch.tensor(0.0))
    # DeepSpeed 0.19 links parameters to their moments after the FIRST param group's first
    # step, when the later groups (our norms: no weight decay) have no state yet: link again
    _relink(opt)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    names = []
    for i, (name, p) in enumerate(_trainable(drafter)):
        tensors = {"fp32": safe_get_full_fp32_param(p), **{k: safe_get_full_optimizer_state(p, k) for k in MOMENTS}}
        if rank == 0:
            save_file({k: v.detach().float().cpu().contiguous() for k, v in tensors.items()},
                      str(out / f"{i:05d}.safetensors"))
        names.append(name)
    if rank == 0:  # written last: a directory without it is an interrupted save
        (out / "meta.json").write_text(json.dumps({"step": float(step), "names": names}))


def _relink(opt) -> None:
    """Point every parameter's optimizer fragments at the current AdamW state (ZeRO-1/2)."""
    opt._hp_optimizer_states_linked = False
    opt._lazy_init_hp_params_optimizer_state()


def has_portable(directory: Path) -> bool:
    return (Path(directory) / PORTABLE_DIR / "meta.json").is_file()


def load_portable(engine, drafter: torch.nn.Module, directory: Path) -> int:
    """Re-shard the gathered state in ``directory`` into ``engine`` (any world size; the
    drafter's weights are already loaded). Returns the optimizer step it continues from."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    from safetensors.torch import load_file

    src = Path(directory) / PORTABLE_DIR
    meta = json.loads((src / "meta.json").read_text())
    params = _trainable(drafter)
    if meta["names"] != [n for n, _ in params]:
        raise RuntimeError(f"{src}: the saved optimizer state is for other parameters ({len(meta['names'])} vs "
                           f"{len(params)})")
    opt = engine.optimizer
    # a fresh engine has no AdamW state until its first step: create it (zeros), then let
    # DeepSpeed link each parameter's fragment of it (its own first-step hook; 0.19 API)
    for flat in opt.single_partition_of_fp32_groups:
        opt.optimizer.state[flat] = {"step": torch.tensor(meta["step"], dtype=torch.float32),
                                     **{k: torch.zeros_like(flat) for k in MOMENTS}}
    _relink(opt)
    for i, (_, p) in enumerate(params):
        saved = load_file(str(src / f"{i:05d}.safetensors"))
        safe_set_full_fp32_param(p, saved["fp32"].to(p.device))
        for k in MOMENTS:
            safe_set_full_optimizer_state(p, saved[k].to(p.device), k)
    return int(meta["step"])
