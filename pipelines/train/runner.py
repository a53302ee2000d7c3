"""What one training worker steps: the loss module, the two parallel strategies (DDP and
DeepSpeed ZeRO-2/3) behind one small interface, the progress state, and checkpoints.

A checkpoint directory (one per evaluation, reported to Ray Train)::

    state.json            TrainState: step, epoch, position in the epoch, history of evals
    drafter/              config.json + model.safetensors: the weights in the published layout
    optimizer.pt          DDP: the AdamW state
    deepspeed/            DeepSpeed: the engine's own checkpoint (every rank writes its shard)

Resuming restores weights, optimizer state and the position in the data; a checkpoint
written by the other strategy, or by DeepSpeed with another world size, restores the
weights and restarts the optimizer moments (with a warning).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pipelines import storage
from pipelines.train.feature_cache import FeatureCache
from specdec.checkpoint import save_drafter
from specdec.draft_vocab import DraftHead
from specdec.drafter import DFlashDrafter
from specdec.objective import StepOutput, dflash_loss

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
DRAFTER_DIR = "drafter"
CHECKPOINT_PREFIX = "checkpoint-step"  # + the step, 8 digits: one folder per kept checkpoint


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # epochs completed
    batch_in_epoch: int = 0  # batches of the current epoch done (per worker)
    samples: int = 0  # training sequences consumed, all workers together
    best_tau: float | None = None
    best_step: int | None = None
    evals_since_best: int = 0
    world_size: int = 1
    strategy: str = "ddp"
    train_seconds: float = 0.0  # time spent in training steps and evals, all attempts together
    resumed_from_step: int | None = None  # this attempt started from a checkpoint at this step
    history: list[dict] = field(default_factory=list)  # one record per evaluation

    def save(self, directory: str | Path) -> None:
        Path(directory, STATE_FILE).write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, directory: str | Path) -> "TrainState":
        d = json.loads(Path(directory, STATE_FILE).read_text())
        return cls(**{k: v for k, v in d.items() if k in {f.name for f in dataclasses.fields(cls)}})


#: teacher law kept per position when online features distil (stored runs carry their own K)
ONLINE_TEACHER_TOPK = 16


class DrafterLoss(nn.Module):
    """The drafter plus what it borrows from the target, with the DFlash loss as forward
    (so DDP and DeepSpeed see one ordinary module). Only the drafter is a registered
    submodule: the frozen target is neither synchronised, nor partitioned, nor saved."""

    def __init__(self, drafter: DFlashDrafter, target, online: bool, lam: float | None, use_flex: bool = False,
                 distill: float = 0.0, cache: FeatureCache | None = None, context_anchors: int = 0):
        super().__init__()
        self.drafter = drafter
        self._target = (target,)  # a tuple keeps nn.Module from registering it
        self.online = online
        self.lam = lam
        self.use_flex = use_flex
        self.distill = distill
        self.cache = cache  # online only: features kept on local disk after their first pass
        # extra blocks over the prompt while training; evaluation scores responses only, as inference does
        self.context_anchors = context_anchors
        self.layer_ids = list(drafter.config.target_layer_ids)
        # the frozen LM head over the drafter's vocabulary (all of it unless reduced)
        self._head = (DraftHead(target, drafter.draft_vocab),)

    @property
    def target(self):
        return self._target[0]

    @property
    def head(self) -> DraftHead:
        return self._head[0]

    def forward(self, batch, num_anchors: int, generator: torch.Generator | None = None) -> StepOutput:
        features = batch.features
        teacher = (batch.teacher_ids, batch.teacher_logprobs) if batch.teacher_ids is not None else None
        if self.online:
            features, teacher = self._online_features(batch)
        head = self.head
        return dflash_loss(self.drafter, self.target.embed, head, batch.input_ids, batch.loss_mask,
                           features, batch.lengths, num_anchors, self.lam, generator, self.use_flex,
                           vocab_index=head.index if head.ids is not None else None,
                           teacher=teacher, distill=self.distill,
                           context_anchors=self.context_anchors if self.training else 0)

    @torch.no_grad()
    def _online_features(self, batch):
        """The target's features (and teacher law) for ``batch``: from the cache when every
        row is in it, else from the target (causal, so right padding never reaches a real token)."""
        dtype = self.target.dtype
        if self.cache is not None and (hit := self.cache.load(batch, dtype, teacher=bool(self.distill))) is not None:
            return hit
        pos = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)[None].expand_as(batch.input_ids)
        out = self.target(batch.input_ids, pos, None, None, self.layer_ids)
        features, teacher = out.features, None
        if self.distill:
            ids, logp = self.target.topk_logprobs(out.hidden, ONLINE_TEACHER_TOPK)
            teacher = (ids.long(), logp)
        if self.cache is not None:  # fp16 on every pass, so a hit and a miss train alike
            features = features.to(torch.float16).to(features.dtype)
            self.cache.store(batch, features, teacher)
        return features, teacher


def enable_gradient_checkpointing(drafter: DFlashDrafter) -> DFlashDrafter:
    """Recompute every draft layer in backward instead of keeping its activations
    (``torch.utils.checkpoint``, non-reentrant): each layer's ``forward`` is wrapped on the
    instance, so the model code and the checkpoint format are untouched. Without grad
    (evaluation) the layer runs as it is. Returns ``drafter``; calling it twice is a no-op."""
    from torch.utils.checkpoint import checkpoint

    for layer in drafter.layers:
        if getattr(layer, "_dflash_checkpointed", False):
            continue
        inner = layer.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
        layer._dflash_checkpointed = True
    return drafter


def param_groups(drafter: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only; norms keep their scale."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


class Runner:
    """One training step, evaluation forward and checkpoint save/load for a strategy."""

    strategy = "base"

    def __init__(self, module: DrafterLoss, device: torch.device, bf16: bool, grad_clip: float):
        self.raw = module
        self.device = device
        self.bf16 = bf16
        self.grad_clip = grad_clip

    @property
    def drafter(self) -> DFlashDrafter:
        return self.raw.drafter

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16 and self.device.type == "cuda")

    @torch.no_grad()
    def eval_step(self, batch, num_anchors: int, generator) -> StepOutput:
        self.raw.eval()
        try:
            with self.autocast():
                return self.raw(batch, num_anchors, generator)
        finally:
            self.raw.train()

    def _save_drafter(self, directory: Path) -> None:
        save_drafter(self.drafter, directory / DRAFTER_DIR)

    def _load_drafter(self, directory: Path) -> None:
        from safetensors.torch import load_file

        state = load_file(str(directory / DRAFTER_DIR / "model.safetensors"))
        with torch.no_grad():
            for name, p in self.drafter.named_parameters():
                p.copy_(state[name].to(p.dtype))


class DDPRunner(Runner):
    strategy = "ddp"

    def __init__(self, module, device, bf16, grad_clip, lr, weight_decay):
        import ray.train.torch

        super().__init__(module, device, bf16, grad_clip)
        self.model = ray.train.torch.prepare_model(module)  # moves to the device; DDP when world > 1
        self.optimizer = torch.optim.AdamW(param_groups(module.drafter, weight_decay), lr=lr,
                                           fused=device.type == "cuda")

    def train_step(self, batch, num_anchors: int, lr: float, generator) -> StepOutput:
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        with self.autocast():
            out = self.model(batch, num_anchors, generator)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.grad_clip)
        self.optimizer.step()
        return out

    def save(self, directory: Path, state: TrainState, rank: int) -> bool:
        """Rank 0 writes everything (the replicas are identical). Returns whether this rank wrote."""
        if rank != 0:
            return False
        self._save_drafter(directory)
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        state.save(directory)
        return True

    def load(self, directory: Path, state: TrainState) -> None:
        self._load_drafter(directory)
        opt = directory / "optimizer.pt"
        if opt.exists():
            self.optimizer.load_state_dict(torch.load(opt, map_location=self.device, weights_only=True))
        else:
            log.warning("checkpoint %s has no DDP optimizer state (strategy %s); restarting AdamW moments",
                        directory, state.strategy)


class DeepSpeedRunner(Runner):
    strategy = "deepspeed"
    TAG = "deepspeed"

    def __init__(self, module, device, bf16, grad_clip, lr, weight_decay, zero_stage: int, micro_batch: int,
                 portable: bool = False):
        import deepspeed

        super().__init__(module, device, bf16, grad_clip)
        if device.type == "cpu":
            _skip_deepspeed_shm_build()
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        self.base_optimizer = torch.optim.AdamW(param_groups(module.drafter, weight_decay), lr=lr)
        config = {
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": grad_clip,
            "zero_optimization": {"stage": zero_stage, "overlap_comm": device.type == "cuda",
                                  "contiguous_gradients": True, "reduce_bucket_size": int(5e7),
                                  "allgather_bucket_size": int(5e7)},
            "bf16": {"enabled": bf16},
            "zero_allow_untested_optimizer": True,  # torch AdamW: fused on GPU, plain on CPU
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        module.to(device)
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=self.base_optimizer, config=config)
        self.zero_stage = zero_stage
        # elastic runs also save the optimizer state gathered per parameter, so that a restart at
        # another world size keeps it (pipelines/train/portable_optimizer.py; ZeRO-2)
        self.portable = portable and zero_stage == 2

    @property
    def drafter(self) -> DFlashDrafter:
        return self.engine.module.drafter

    def train_step(self, batch, num_anchors: int, lr: float, generator) -> StepOutput:
        for g in self.base_optimizer.param_groups:  # ZeRO steps this optimizer on its partitions
            g["lr"] = lr
        out = self.engine(batch, num_anchors, generator)
        self.engine.backward(out.loss)
        self.engine.step()
        return out

    @torch.no_grad()
    def eval_step(self, batch, num_anchors: int, generator) -> StepOutput:
        self.engine.eval()
        try:
            return self.engine(batch, num_anchors, generator)
        finally:
            self.engine.train()

    def save(self, directory: Path, state: TrainState, rank: int) -> bool:
        """Every rank writes its ZeRO shard; rank 0 also writes the gathered weights."""
        self.engine.save_checkpoint(str(directory), tag=self.TAG, save_latest=False)
        if self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.drafter.parameters()), modifier_rank=None):
                if rank == 0:
                    self._save_drafter(directory)
        elif rank == 0:
            self._save_drafter(directory)
        if self.portable:
            from pipelines.train.portable_optimizer import save_portable

            save_portable(self.engine, self.drafter, directory, rank)
        if rank == 0:
            state.save(directory)
        return True

    def load(self, directory: Path, state: TrainState) -> None:
        """The engine's own checkpoint when it was written by DeepSpeed at this world size;
        otherwise the weights alone (ZeRO shards do not re-partition), optimizer restarting."""
        if (directory / self.TAG).is_dir() and state.world_size == self.engine.world_size:
            path, _ = self.engine.load_checkpoint(str(directory), tag=self.TAG, load_optimizer_states=True,
                                                  load_lr_scheduler_states=False)
            if path is None:
                raise RuntimeError(f"DeepSpeed could not load the checkpoint in {directory}")
            return
        from pipelines.train.portable_optimizer import has_portable, load_portable

        if self.zero_stage == 2 and has_portable(directory):
            self._load_drafter_everywhere(directory)
            step = load_portable(self.engine, self.drafter, directory)
            log.info("checkpoint %s was written with %d workers (now %d): weights, fp32 master weights and AdamW "
                     "moments re-sharded, optimizer step %d", directory, state.world_size, self.engine.world_size, step)
            return
        log.warning("checkpoint %s was written by %s with %d workers (now deepspeed with %d): loading its "
                    "weights; optimizer moments restart", directory, state.strategy, state.world_size,
                    self.engine.world_size)
        self._load_drafter_everywhere(directory)

    def _load_drafter_everywhere(self, directory: Path) -> None:
        if self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.drafter.parameters()), modifier_rank=0):
                self._load_drafter(directory)
        else:
            self._load_drafter(directory)
        # ZeRO steps from fp32 master partitions: refresh them from the loaded weights
        if hasattr(self.engine.optimizer, "refresh_fp32_params"):
            self.engine.optimizer.refresh_fp32_params()


def _skip_deepspeed_shm_build() -> None:
    """DeepSpeed JIT-compiles a shared-memory all-reduce op with g++ whenever it sets up
    communication on CPU (minutes on a small machine, on every fresh node). Only its
    inference all-reduce uses that op; ZeRO training uses torch.distributed. So it is
    skipped unless DFLASH_DEEPSPEED_SHM=1."""
    if os.environ.get("DFLASH_DEEPSPEED_SHM") == "1":
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def make_runner(strategy: str, module: DrafterLoss, device: torch.device, bf16: bool, *, grad_clip: float,
                lr: float, weight_decay: float, zero_stage: int, micro_batch: int, portable: bool = False) -> Runner:
    """``portable``: DeepSpeed checkpoints also keep the optimizer in a world-size-independent
    form (elastic runs); DDP's optimizer state is whole on every worker anyway."""
    if strategy == "deepspeed":
        return DeepSpeedRunner(module, device, bf16, grad_clip, lr, weight_decay, zero_stage, micro_batch, portable)
    return DDPRunner(module, device, bf16, grad_clip, lr, weight_decay)


# ---------------------------------------------------------------------------- checkpoints on storage
def latest_checkpoint_state(run_uri: str, options: dict) -> tuple[TrainState | None, dict | None]:
    """The newest checkpoint of a run that already exists: (its state, its drafter config)."""
    fs, root = storage.filesystem(run_uri, options)
    names = [p for p in storage.list_files(fs, root) if Path(p).name.startswith(CHECKPOINT_PREFIX)]
    for path in sorted(names, reverse=True):
        try:
            state = json.loads(fs.cat_file(storage.join(path, "state.json")))
            cfg = json.loads(fs.cat_file(storage.join(path, DRAFTER_DIR, "config.json")))
        except FileNotFoundError:
            continue  # a checkpoint being written or deleted
        known = {f.name for f in dataclasses.fields(TrainState)}
        return TrainState(**{k: v for k, v in state.items() if k in known}), cfg
    return None, None
