"""One Ray Train worker (:func:`train_loop_per_worker`, shipped to the workers by
``pipelines/train/trainer.py``): the drafter plus the target's frozen embedding and LM head
(the whole target only in online mode, where it computes the features), AdamW with warmup
+ cosine, DDP or DeepSpeed ZeRO; evaluates held-out simulated acceptance every
``eval_every`` steps and at each epoch end, and reports a checkpoint each time. Ray Train
keeps the best ``keep_best`` by held-out tau (and always the latest, which resuming uses:
after a worker failure, or when the same run name is run again).

Ray Train pickles ``train_loop_per_worker`` by reference to this module, so everything it
calls stays a module-level name here.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipelines import registry
from pipelines.train.config import TrainSection
from pipelines.train.data import Collate, bucket_window, bucketed
from pipelines.train.faults import FaultInjector
from pipelines.train.feature_cache import FeatureCache
from pipelines.train.heldout import HeldOut
from pipelines.train.metrics import TrainingWindow, evaluate
from pipelines.train.runner import (CHECKPOINT_PREFIX, ONLINE_TEACHER_TOPK, DrafterLoss, TrainState,
                                    enable_gradient_checkpointing, make_runner)

log = logging.getLogger(__name__)


def lr_at(progress: float, lr: float, warmup: float, min_ratio: float) -> float:
    """Linear warmup over the first ``warmup`` share of training, then cosine to
    ``lr * min_ratio``; ``progress`` in [0, 1] (training samples seen / planned)."""
    progress = min(max(progress, 0.0), 1.0)
    if warmup > 0 and progress < warmup:
        return lr * progress / warmup
    t = (progress - warmup) / max(1e-12, 1 - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


@dataclass
class _WorkerRun:
    """What one worker's training loop works with, set up once per attempt."""

    tc: TrainSection
    rank: int
    world: int
    device: torch.device
    runner: object  # pipelines.train.runner.Runner
    state: TrainState
    collate: Collate
    train_shard: object  # this worker's share of the training rows (Ray Data)
    holdout: HeldOut  # the held-out blocks (each worker reads and evaluates its own)
    metrics_log: registry.MetricsLogger
    faults: FaultInjector
    window: TrainingWindow
    generator: torch.Generator  # the anchors' random draws
    train_rows: int
    total_samples: int  # what the learning-rate schedule spans


def train_loop_per_worker(config: dict) -> None:
    """One Ray Train worker: resume or start, train, evaluate, checkpoint."""
    w = _start_worker(config)
    if w.state.step == 0 and not w.state.history:
        _evaluate_and_report(w, with_checkpoint=False)  # the baseline: the untrained drafter
    stop = _finished(w)
    while not stop:
        stop = _train_epoch(w) or _finished(w)
    if w.state.history[-1]["step"] != w.state.step:
        _evaluate_and_report(w, with_checkpoint=True)
    w.metrics_log.flush()


def _start_worker(config: dict) -> _WorkerRun:
    """The worker's device, runner (resumed from the run's latest checkpoint if any), data
    shards and loggers."""
    import ray.train
    import ray.train.torch

    tc = TrainSection(**config["train"])
    _quiet_report_logs()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(tc.threads_per_worker or max(1, int(tc.cpus_per_worker)))
    device = ray.train.torch.get_device() if tc.use_gpu else torch.device("cpu")
    bf16 = tc.precision == "bf16" or (tc.precision == "auto" and device.type == "cuda")
    runner = _build_runner(config, tc, device, bf16)
    state = _resume_state(runner, tc, rank, world)
    train_rows = max(1, int(config["train_rows"]))
    total_samples = tc.epochs * train_rows
    if tc.max_steps is not None:
        total_samples = min(total_samples, tc.max_steps * tc.batch_size * world)
    mlflow = config["mlflow"]
    live = rank == 0 and mlflow["live"]
    return _WorkerRun(
        tc=tc, rank=rank, world=world, device=device, runner=runner, state=state,
        collate=Collate(config["layout"], tc.max_length, torch.bfloat16 if bf16 else torch.float32),
        train_shard=ray.train.get_dataset_shard("train"), holdout=config["holdout"],
        metrics_log=registry.MetricsLogger(mlflow["tracking_uri"] if live else None, mlflow["run_id"]),
        faults=FaultInjector.from_env(rank), window=TrainingWindow(runner.drafter.config.block_size),
        generator=torch.Generator(device=device), train_rows=train_rows, total_samples=total_samples)


def _build_runner(config: dict, tc: TrainSection, device: torch.device, bf16: bool):
    """The drafter from the driver's initial weights, wrapped with the target's part it
    needs in the loss module, behind the DDP or DeepSpeed runner."""
    import ray

    from specdec.checkpoint_format import DrafterConfig
    from specdec.dflash2 import build_drafter, is_dflash2

    use_flex = tc.attention == "flex" or (tc.attention == "auto" and device.type == "cuda")
    target = _load_worker_target(config["target"], tc.online, device, torch.bfloat16 if bf16 else torch.float32)
    drafter = build_drafter(DrafterConfig(**config["drafter"]))
    if is_dflash2(drafter):
        drafter.selector_alpha = tc.selector_alpha
    drafter.load_state_dict(ray.get(config["init_state"]))  # identical start on every worker
    if config.get("draft_vocab") is not None:
        drafter.set_draft_vocab(torch.tensor(config["draft_vocab"]))
    drafter.set_dropout(tc.dropout)
    if tc.gradient_checkpointing:
        enable_gradient_checkpointing(drafter)
    cache = None
    if tc.feature_cache:  # keyed by what the features are of: another target or layer choice never reads them
        cache = FeatureCache(tc.feature_cache,
                             {"target": config["target"], "layer_ids": list(drafter.config.target_layer_ids),
                              "teacher_topk": ONLINE_TEACHER_TOPK if tc.distill else 0})
    module = DrafterLoss(drafter.to(device), target, tc.online, config["lam"], use_flex=use_flex, distill=tc.distill,
                         cache=cache, context_anchors=tc.context_anchors)
    return make_runner(tc.strategy, module, device, bf16, grad_clip=tc.grad_clip, lr=tc.lr,
                       weight_decay=tc.weight_decay, zero_stage=tc.zero_stage, micro_batch=tc.batch_size,
                       portable=tc.min_workers != tc.max_workers)


def _resume_state(runner, tc: TrainSection, rank: int, world: int) -> TrainState:
    """A fresh state, or the latest checkpoint's loaded into ``runner``; the position in
    the epoch is rescaled when the number of workers changed."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return TrainState(world_size=world, strategy=tc.strategy)
    with checkpoint.as_directory() as d:
        saved = TrainState.load(d)
        runner.load(Path(d), saved)
    if rank == 0:
        log.info("[train] resumed from step %d (epoch %d, %d samples)", saved.step, saved.epoch, saved.samples)
    return dataclasses.replace(saved, world_size=world, strategy=tc.strategy, resumed_from_step=saved.step,
                               batch_in_epoch=saved.batch_in_epoch * saved.world_size // world)


def _finished(w: _WorkerRun) -> bool:
    return w.state.epoch >= w.tc.epochs or (w.tc.max_steps is not None and w.state.step >= w.tc.max_steps)


def _train_epoch(w: _WorkerRun) -> bool:
    """Train through the rest of the current epoch (or up to ``max_steps``), evaluating
    every ``eval_every`` steps and at its end; True when early stopping says stop."""
    tc, state = w.tc, w.state
    for i, raw in enumerate(_epoch_batches(w)):
        if i < state.batch_in_epoch:
            continue  # consumed before the checkpoint this attempt resumed from
        _train_step(w, raw)
        if tc.eval_every and state.step % tc.eval_every == 0 and _evaluate_and_report(w, with_checkpoint=True):
            return True
        if tc.max_steps is not None and state.step >= tc.max_steps:
            return False
    state.epoch += 1
    state.batch_in_epoch = 0
    return state.history[-1]["step"] != state.step and _evaluate_and_report(w, with_checkpoint=True)


def _epoch_batches(w: _WorkerRun):
    """This worker's training batches of the current epoch (pyarrow tables)."""
    tc = w.tc
    shuffle = dict(local_shuffle_buffer_size=tc.shuffle_buffer or None,
                   local_shuffle_seed=tc.seed + w.state.epoch if tc.shuffle_buffer else None)
    if tc.length_buckets:  # sort a window of rows by length, cut it into batches, shuffle those
        windows = w.train_shard.iter_batches(batch_size=bucket_window(tc.batch_size, tc.shuffle_buffer),
                                             batch_format="pyarrow", prefetch_batches=1, **shuffle)
        # one permutation for every worker: their k-th batches hold the same length rank of
        # their windows, so DDP's all-reduce does not wait on one worker's longest batch
        return bucketed(windows, tc.batch_size, (tc.seed, w.state.epoch))
    return w.train_shard.iter_batches(batch_size=tc.batch_size, batch_format="pyarrow", prefetch_batches=2,
                                      **shuffle)


def _train_step(w: _WorkerRun, raw) -> None:
    """One optimizer step on ``raw``; a progress line every ``log_every`` steps."""
    tc, state = w.tc, w.state
    t0 = time.perf_counter()
    batch = w.collate(raw).to(w.device)
    lr = lr_at((state.samples + batch.rows * w.world) / w.total_samples, tc.lr, tc.warmup, tc.min_lr_ratio)
    w.generator.manual_seed(_step_seed(tc.seed, w.rank, state.step))
    out = w.runner.train_step(batch, tc.num_anchors, lr, w.generator)
    state.step += 1
    state.batch_in_epoch += 1
    state.samples += batch.rows * w.world
    state.train_seconds += time.perf_counter() - t0
    w.window.add(out, batch.rows)
    if state.step % tc.log_every == 0:
        _log_progress(w, lr)
    w.faults.after_step(state.step)


def _log_progress(w: _WorkerRun, lr: float) -> None:
    stats = w.window.flush(w.device)  # a collective: every rank logs at the same steps
    if w.rank != 0:
        return
    state = w.state
    stats.update(lr=lr, epoch=round(state.samples / w.train_rows, 4), samples=state.samples)
    log.info("[train] step %d | epoch %.2f | loss %.4f | tau %.3f | acc@1 %.3f | lr %.2e | "
             "%.0f block tok/s", state.step, stats["epoch"], stats["train_loss"], stats["train_tau"],
             stats["train_acc_1"], lr, stats["block_tokens_per_s"])
    w.metrics_log.log(stats, state.step)


def _evaluate_and_report(w: _WorkerRun, with_checkpoint: bool) -> bool:
    """Held-out evaluation, history, MLflow, ``ray.train.report``; True to stop early."""
    import ray.train

    tc, state = w.tc, w.state
    t0 = time.perf_counter()
    ev = evaluate(w.runner, w.holdout, w.collate, tc, w.device, w.rank, w.world,
                  shard=not (tc.strategy == "deepspeed" and tc.zero_stage == 3))
    state.train_seconds += time.perf_counter() - t0
    improved = state.best_tau is None or ev["holdout_tau"] > state.best_tau
    if state.step > 0:
        state.best_tau, state.best_step = (ev["holdout_tau"], state.step) if improved else (state.best_tau,
                                                                                            state.best_step)
        state.evals_since_best = 0 if improved else state.evals_since_best + 1
    record = {"step": state.step, "epoch": round(state.samples / w.train_rows, 4), "samples": state.samples,
              **ev, **w.window.summary_since_eval(), "train_seconds": round(state.train_seconds, 2)}
    state.history.append(record)
    flat = {k: v for k, v in record.items() if not isinstance(v, list)}
    flat.update({f"holdout_acc_{k + 1}": a for k, a in enumerate(ev["holdout_acc"])})
    if w.rank == 0:
        log.info("[eval] step %d | epoch %.2f | holdout tau %.3f | loss %.4f | acc@1..3 %s", state.step,
                 record["epoch"], ev["holdout_tau"], ev["holdout_loss"],
                 " ".join(f"{a:.3f}" for a in ev["holdout_acc"][:3]))
        w.metrics_log.log({k: v for k, v in flat.items() if k.startswith("holdout_")} | {"epoch": record["epoch"]},
                          state.step)
        w.metrics_log.flush()
    if with_checkpoint:
        _save_and_report(w.runner, state, w.rank, flat)
    else:
        ray.train.report(flat)
    w.window.pause(time.perf_counter() - t0)  # evaluations and checkpoints are not training throughput
    return tc.early_stop_patience is not None and state.evals_since_best >= tc.early_stop_patience


def _quiet_report_logs() -> None:
    """Ray Train logs every ``ray.train.report`` call with its whole metrics dict at INFO, on
    every rank (a logger named by its file's path); the ``[train]`` lines and MLflow already
    say it in one line, so the console keeps only its warnings."""
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:  # another Ray layout: its logs stay as they are
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def _load_worker_target(spec: dict, online: bool, device: torch.device, compute_dtype: torch.dtype):
    """Online: the whole target (it computes features). Stored features: only its
    embedding and LM head, the rest stays on the meta device."""
    from specdec.frozen import load_embed_and_head
    from specdec.target import load_target

    if online:
        return load_target(spec["model"], dtype=spec["dtype"], device=device,
                           trust_remote_code=spec["trust_remote_code"])
    dtype = compute_dtype if device.type == "cuda" else getattr(torch, spec["dtype"])
    return load_embed_and_head(spec["model"], dtype=dtype, device=device,
                               trust_remote_code=spec["trust_remote_code"], identity=spec["identity"])


def _step_seed(seed: int, rank: int, step: int) -> int:
    """Anchors of a step depend on (seed, rank, step) only: a resumed run draws the same."""
    return (seed * 1_000_003 + rank * 7_919 + step * 104_729) % (2**63 - 1)


def _save_and_report(runner, state: TrainState, rank: int, metrics: dict) -> None:
    import ray.train

    name = f"{CHECKPOINT_PREFIX}{state.step:08d}"
    with tempfile.TemporaryDirectory(prefix="dflash-ckpt-") as tmp:
        wrote = runner.save(Path(tmp), state, rank)
        ckpt = ray.train.Checkpoint.from_directory(tmp) if wrote else None
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=name)
    # The controller registers a reported checkpoint when it next polls the workers; a worker
    # that died before that poll would leave its restart nothing to resume from. Wait until
    # the checkpoint is committed to the run's snapshot (at most one poll interval).
    ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
