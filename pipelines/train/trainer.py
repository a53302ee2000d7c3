"""Ray Train drafter training: ``fit(recipe)`` on the driver, ``train_loop_per_worker``
on every worker.

Driver (:func:`fit`): loads the target once (its identity decides which feature runs are
acceptable and is the drafter's lineage), checks the feature manifest, builds the drafter
config and its initial weights, opens (or reopens) the MLflow run, hands a
``TorchTrainer`` the training rows (streamed and split across workers) and the held-out
rows (every worker sees them, each evaluates its share), then exports the checkpoint with
the best held-out tau as a drafter directory and registers it in MLflow.

Worker (:func:`train_loop_per_worker`): the drafter plus the target's frozen embedding and
LM head (the whole target only in online mode, where it computes the features), AdamW
with warmup + cosine, DDP or DeepSpeed ZeRO; evaluates held-out simulated acceptance every
``eval_every`` steps and at each epoch end, and reports a checkpoint each time. Ray Train
keeps the best ``keep_best`` by held-out tau (and always the latest, which resuming uses:
after a worker failure, or when the same run name is run again).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipelines import registry, storage
from pipelines.config import ConfigError
from pipelines.train.config import TrainRecipe, TrainSection
from pipelines.train.faults import FaultInjector
from pipelines.train.data import (Collate, bucket_window, bucketed, manifest_sha256, read_sequences,
                                  sequences_sha256, simulated_padding, split_holdout)
from pipelines.train.feature_cache import FeatureCache
from pipelines.train.runner import (CHECKPOINT_PREFIX, DRAFTER_DIR, ONLINE_TEACHER_TOPK, DrafterLoss, TrainState,
                                     enable_gradient_checkpointing, latest_checkpoint_state, make_runner)

log = logging.getLogger(__name__)

#: environment the driver forwards to its workers: the model cache, knobs, test fault injection
LONGALIGN_FILE = "longalign.parquet"  # train.longalign's rows, in the run directory
FORWARDED_ENV = ("DFLASH_CACHE", "DFLASH_DEEPSPEED_SHM", "DFLASH_FAIL_AT_STEP", "DFLASH_FAIL_MARKER", "HF_HUB_OFFLINE")


# ============================================================================ schedule
def lr_at(progress: float, lr: float, warmup: float, min_ratio: float) -> float:
    """Linear warmup over the first ``warmup`` share of training, then cosine to
    ``lr * min_ratio``; ``progress`` in [0, 1] (training samples seen / planned)."""
    progress = min(max(progress, 0.0), 1.0)
    if warmup > 0 and progress < warmup:
        return lr * progress / warmup
    t = (progress - warmup) / max(1e-12, 1 - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# ============================================================================ worker
def _quiet_report_logs() -> None:
    """Ray Train logs every ``ray.train.report`` call with its whole metrics dict at INFO, on
    every rank (a logger named by its file's path); the ``[train]`` lines and MLflow already
    say it in one line, so the console keeps only its warnings."""
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:  # another Ray layout: its logs stay as they are
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def train_loop_per_worker(config: dict) -> None:
    """One Ray Train worker: resume or start, train, evaluate, checkpoint."""
    import ray
    import ray.train
    import ray.train.torch

    from specdec.drafter import DFlashDrafter, DrafterConfig

    tc = TrainSection(**config["train"])
    _quiet_report_logs()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(tc.threads_per_worker or max(1, int(tc.cpus_per_worker)))
    device = ray.train.torch.get_device() if tc.use_gpu else torch.device("cpu")
    bf16 = tc.precision == "bf16" or (tc.precision == "auto" and device.type == "cuda")
    use_flex = tc.attention == "flex" or (tc.attention == "auto" and device.type == "cuda")

    target = _load_worker_target(config["target"], tc.online, device, torch.bfloat16 if bf16 else torch.float32)
    drafter = DFlashDrafter(DrafterConfig(**config["drafter"]))
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
    runner = make_runner(tc.strategy, module, device, bf16, grad_clip=tc.grad_clip, lr=tc.lr,
                         weight_decay=tc.weight_decay, zero_stage=tc.zero_stage, micro_batch=tc.batch_size)

    state = TrainState(world_size=world, strategy=tc.strategy)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            saved = TrainState.load(d)
            runner.load(Path(d), saved)
        state = dataclasses.replace(saved, world_size=world, strategy=tc.strategy, resumed_from_step=saved.step,
                                    batch_in_epoch=saved.batch_in_epoch * saved.world_size // world)
        if rank == 0:
            log.info("[train] resumed from step %d (epoch %d, %d samples)", saved.step, saved.epoch, saved.samples)

    train_rows = max(1, int(config["train_rows"]))
    total_samples = tc.epochs * train_rows
    if tc.max_steps is not None:
        total_samples = min(total_samples, tc.max_steps * tc.batch_size * world)
    collate = Collate(config["layout"], tc.max_length, torch.bfloat16 if bf16 else torch.float32)
    train_shard = ray.train.get_dataset_shard("train")
    holdout = ray.train.get_dataset_shard("holdout")
    mlflow = config["mlflow"]
    live = rank == 0 and mlflow["live"]
    metrics_log = registry.MetricsLogger(mlflow["tracking_uri"] if live else None, mlflow["run_id"])
    faults = FaultInjector.from_env(rank)
    window = _Window(drafter.config.block_size)
    generator = torch.Generator(device=device)

    def evaluate_and_report(with_checkpoint: bool) -> bool:
        """Held-out evaluation, history, MLflow, ``ray.train.report``; True to stop early."""
        t0 = time.perf_counter()
        ev = evaluate(runner, holdout, collate, tc, device, rank, world,
                      shard=not (tc.strategy == "deepspeed" and tc.zero_stage == 3))
        state.train_seconds += time.perf_counter() - t0
        improved = state.best_tau is None or ev["holdout_tau"] > state.best_tau
        if state.step > 0:
            state.best_tau, state.best_step = (ev["holdout_tau"], state.step) if improved else (state.best_tau,
                                                                                                state.best_step)
            state.evals_since_best = 0 if improved else state.evals_since_best + 1
        record = {"step": state.step, "epoch": round(state.samples / train_rows, 4), "samples": state.samples,
                  **ev, **window.summary_since_eval(), "train_seconds": round(state.train_seconds, 2)}
        state.history.append(record)
        flat = {k: v for k, v in record.items() if not isinstance(v, list)}
        flat.update({f"holdout_acc_{k + 1}": a for k, a in enumerate(ev["holdout_acc"])})
        if rank == 0:
            log.info("[eval] step %d | epoch %.2f | holdout tau %.3f | loss %.4f | acc@1..3 %s", state.step,
                     record["epoch"], ev["holdout_tau"], ev["holdout_loss"],
                     " ".join(f"{a:.3f}" for a in ev["holdout_acc"][:3]))
            metrics_log.log({k: v for k, v in flat.items() if k.startswith("holdout_")} | {"epoch": record["epoch"]},
                            state.step)
            metrics_log.flush()
        if with_checkpoint:
            _save_and_report(runner, state, rank, flat)
        else:
            ray.train.report(flat)
        window.pause(time.perf_counter() - t0)  # evaluations and checkpoints are not training throughput
        return tc.early_stop_patience is not None and state.evals_since_best >= tc.early_stop_patience

    if state.step == 0 and not state.history:
        evaluate_and_report(with_checkpoint=False)  # the baseline: the untrained drafter

    def finished() -> bool:
        return state.epoch >= tc.epochs or (tc.max_steps is not None and state.step >= tc.max_steps)

    stop = finished()
    while not stop:
        shuffle = dict(local_shuffle_buffer_size=tc.shuffle_buffer or None,
                       local_shuffle_seed=tc.seed + state.epoch if tc.shuffle_buffer else None)
        if tc.length_buckets:  # sort a window of rows by length, cut it into batches, shuffle those
            windows = train_shard.iter_batches(batch_size=bucket_window(tc.batch_size, tc.shuffle_buffer),
                                               batch_format="pyarrow", prefetch_batches=1, **shuffle)
            # one permutation for every worker: their k-th batches hold the same length rank of
            # their windows, so DDP's all-reduce does not wait on one worker's longest batch
            batches = bucketed(windows, tc.batch_size, (tc.seed, state.epoch))
        else:
            batches = train_shard.iter_batches(batch_size=tc.batch_size, batch_format="pyarrow", prefetch_batches=2,
                                               **shuffle)
        for i, raw in enumerate(batches):
            if i < state.batch_in_epoch:
                continue  # consumed before the checkpoint this attempt resumed from
            t0 = time.perf_counter()
            batch = collate(raw).to(device)
            lr = lr_at((state.samples + batch.rows * world) / total_samples, tc.lr, tc.warmup, tc.min_lr_ratio)
            generator.manual_seed(_step_seed(tc.seed, rank, state.step))
            out = runner.train_step(batch, tc.num_anchors, lr, generator)
            state.step += 1
            state.batch_in_epoch += 1
            state.samples += batch.rows * world
            state.train_seconds += time.perf_counter() - t0
            window.add(out, batch.rows)
            if state.step % tc.log_every == 0:
                stats = window.flush(device)  # a collective: every rank logs at the same steps
                if rank == 0:
                    stats.update(lr=lr, epoch=round(state.samples / train_rows, 4), samples=state.samples)
                    log.info("[train] step %d | epoch %.2f | loss %.4f | tau %.3f | acc@1 %.3f | lr %.2e | "
                             "%.0f block tok/s", state.step, stats["epoch"], stats["train_loss"], stats["train_tau"],
                             stats["train_acc_1"], lr, stats["block_tokens_per_s"])
                    metrics_log.log(stats, state.step)
            faults.after_step(state.step)
            if tc.eval_every and state.step % tc.eval_every == 0:
                if evaluate_and_report(with_checkpoint=True):
                    stop = True
                    break
            if tc.max_steps is not None and state.step >= tc.max_steps:
                break
        else:
            state.epoch += 1
            state.batch_in_epoch = 0
            if state.history[-1]["step"] != state.step and evaluate_and_report(with_checkpoint=True):
                stop = True
        stop = stop or finished()
    if state.history[-1]["step"] != state.step:
        evaluate_and_report(with_checkpoint=True)
    metrics_log.flush()


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


def _all_reduce(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        on = t.to(device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(on)
        return on.cpu()
    return t


def batch_cost(table) -> int:
    """What evaluating a batch costs, in padded token slots (rows x longest row): the
    target's forward (online features) and the drafter's both run over the padded batch."""
    import pyarrow.compute as pc

    longest = pc.max(pc.list_value_length(table.column("input_ids"))).as_py()
    return table.num_rows * int(longest or 0)


def take_turn(load: list[int], cost: int) -> int:
    """The worker that evaluates the next batch: the least loaded so far (the lowest rank on
    ties), charged ``cost``. Every worker iterates the same batches in the same order, so
    all of them compute the same owners without talking; with long-context rows of 1K-8K
    tokens, turn-taking by index left one worker idle while the other ran every long batch."""
    owner = min(range(len(load)), key=load.__getitem__)
    load[owner] += cost
    return owner


@torch.no_grad()
def evaluate(runner, holdout, collate: Collate, tc: TrainSection, device: torch.device, rank: int, world: int,
             shard: bool = True) -> dict:
    """Held-out loss, per-offset accuracy and simulated greedy tau over every held-out
    sequence. Anchors are drawn from a seed fixed by the batch's sample ids, so every
    evaluation of a run scores the same blocks. With ``shard`` the batches are dealt out by
    cost (``take_turn``) and the sums are all-reduced (ZeRO-3 needs every rank in every
    forward, so there each rank evaluates all batches)."""
    B1 = runner.drafter.config.block_size - 1
    anchors = tc.eval_anchors or tc.num_anchors
    # sums: weighted loss, labelled tokens, leading matches, blocks, rows, hits per offset, labels per offset
    sums = torch.zeros(5 + 2 * B1, dtype=torch.float64)
    load = [0] * world
    for raw in holdout.iter_batches(batch_size=tc.batch_size, batch_format="pyarrow"):
        if shard and take_turn(load, batch_cost(raw)) != rank:
            continue
        batch = collate(raw).to(device)
        gen = torch.Generator(device=device).manual_seed(batch.seed(tc.seed))
        out = runner.eval_step(batch, anchors, gen)
        if out.n_blocks == 0:
            continue
        count = out.acc_count.double().cpu()
        sums[0] += float(out.loss) * out.n_tokens
        sums[1] += out.n_tokens
        sums[2] += (float(out.tau) - 1) * out.n_blocks
        sums[3] += out.n_blocks
        sums[4] += batch.rows
        sums[5: 5 + B1] += out.acc.double().cpu() * count
        sums[5 + B1:] += count
    if shard:
        sums = _all_reduce(sums, device)
    if sums[3] == 0:
        raise RuntimeError("the held-out set has no response tokens to evaluate")
    return {"holdout_loss": float(sums[0] / sums[1].clamp(min=1)), "holdout_tau": float(1 + sums[2] / sums[3]),
            "holdout_acc": [round(float(h / max(c, 1)), 5) for h, c in zip(sums[5: 5 + B1], sums[5 + B1:])],
            "holdout_blocks": int(sums[3]), "holdout_rows": int(sums[4])}


class _Window:
    """Running training statistics between progress lines and between evaluations."""

    def __init__(self, block_size: int):
        self.B1 = block_size - 1
        self.block_size = block_size
        self.since_eval: list[dict] = []
        self._reset()

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` (an evaluation) out of the throughput window."""
        self.t0 += seconds

    def _reset(self):
        # weighted loss, labelled tokens, leading matches, blocks, block tokens, rows, hits@k, labels@k
        self.sums = torch.zeros(6 + 2 * self.B1, dtype=torch.float64)
        self.t0 = time.perf_counter()

    def add(self, out, rows: int) -> None:
        s, B1 = self.sums, self.B1
        count = out.acc_count.double().cpu()
        s[0] += float(out.loss.detach()) * out.n_tokens
        s[1] += out.n_tokens
        s[2] += (float(out.tau) - 1) * out.n_blocks if out.n_blocks else 0.0
        s[3] += out.n_blocks
        s[4] += out.n_blocks * self.block_size
        s[5] += rows
        s[6: 6 + B1] += out.acc.detach().double().cpu() * count
        s[6 + B1:] += count

    def flush(self, device) -> dict:
        """Statistics of all workers since the last call (a collective)."""
        wall = max(time.perf_counter() - self.t0, 1e-9)
        s = _all_reduce(self.sums.clone(), device)
        self._reset()
        s = [float(x) for x in s]
        stats = {"train_loss": s[0] / max(s[1], 1.0), "train_tau": 1 + s[2] / max(s[3], 1.0),
                 "train_acc_1": s[6] / max(s[6 + self.B1], 1.0),
                 "block_tokens_per_s": s[4] / wall, "rows_per_s": s[5] / wall}
        self.since_eval.append(stats)
        return stats

    def summary_since_eval(self) -> dict:
        """Mean training loss / tau / throughput over the progress lines since the last eval."""
        lines, self.since_eval = self.since_eval, []
        if not lines:
            return {}
        keys = ("train_loss", "train_tau", "block_tokens_per_s", "rows_per_s")
        return {k: round(sum(x[k] for x in lines) / len(lines), 5) for k in keys}


# ============================================================================ driver
@dataclass
class FitResult:
    run_name: str
    run_uri: str  # <storage_path>/<run_name>: Ray Train's run directory
    checkpoint: str  # the best checkpoint (by held-out tau)
    drafter_dir: str  # the exported drafter
    holdout_tau: float | None
    best_step: int | None
    steps: int
    samples: int
    resumed_from_step: int | None
    history: list[dict]
    tracking_uri: str
    mlflow_run_id: str
    model_name: str | None
    model_version: str | None
    seconds: float
    learning_curve: str | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class _Plan:
    """What the driver worked out before starting the trainer."""

    target: dict
    drafter_config: object
    draft_vocab: list[int] | None
    init_state: dict
    datasets: dict
    layout: dict | None
    train_rows: int
    lineage: dict
    tracking_uri: str
    run_id: str
    run_uri: str
    storage_options: dict
    resume: TrainState | None
    mlflow_live: bool  # workers can reach the tracking store (else the driver logs evaluations at the end)


def fit(recipe: TrainRecipe) -> FitResult:
    """Train (or resume) the run ``recipe.train.run_name``; export and register the best
    drafter. Connects to the current Ray cluster (``ray.init()`` if none)."""
    import ray

    t0 = time.perf_counter()
    if not ray.is_initialized():
        ray.init()
    plan = _prepare(recipe)
    log.info("prepared run %s in %.1f s (%d training rows, resume from step %s)", recipe.train.run_name,
             time.perf_counter() - t0, plan.train_rows, plan.resume.step if plan.resume else None)
    trainer = _trainer(recipe, plan)
    t1 = time.perf_counter()
    try:
        result = trainer.fit()
    except BaseException:
        _safe(lambda: registry.finish_run(plan.tracking_uri, plan.run_id, "FAILED"))
        raise
    log.info("Ray Train finished in %.1f s", time.perf_counter() - t1)
    t2 = time.perf_counter()
    out = _finish(recipe, plan, result, time.perf_counter() - t0)
    log.info("exported and registered in %.1f s", time.perf_counter() - t2)
    return out


def _prepare(recipe: TrainRecipe) -> _Plan:
    """Everything that can be checked is checked here, cheapest first, before any worker
    starts: the target, its feature run, the drafter shape against an existing run."""
    import ray

    from pipelines.features.format import FeatureLayout, tokenizer_fingerprint
    from pipelines.features import load_manifest
    from specdec.drafter import DFlashDrafter, drafter_config_for_target, init_from_target
    from specdec.target import load_target

    tc, dc, spec = recipe.train, recipe.drafter, recipe.features.target
    target = load_target(spec.model, dtype=spec.dtype, trust_remote_code=spec.trust_remote_code)
    tok_hash = tokenizer_fingerprint(target.tokenizer)["hash"] if target.tokenizer is not None else None
    options = storage.resolve_options(recipe.feature_uris[0], recipe.features.storage.options)
    run_uri = storage.join(storage.absolute_uri(tc.storage_path), tc.run_name)
    tracking_uri = registry.resolve_tracking_uri(recipe.registry.tracking_uri)

    # ---- LongAlign conversations -> token rows in the run directory (checked before anything is written)
    longalign = _longalign_sequences(recipe, target, run_uri) if tc.longalign else {}
    sequences = tc.sequences or longalign.get("uri")

    # ---- the feature run (absent only for online training from token sequences)
    manifests = {}  # uri -> manifest, in the recipe's order; the first one fixes layers and layout
    if not (tc.online and sequences):
        for uri in map(storage.absolute_uri, recipe.feature_uris):
            try:
                manifests[uri] = load_manifest(uri, options)
            except FileNotFoundError as e:
                raise ConfigError(f"{'train.features' if tc.features else 'features.output'}: {e}") from None
    manifest_uri, manifest = next(iter(manifests.items()), (None, None))
    layer_ids = _layer_ids(recipe, target, manifest, manifest_uri)
    layout = FeatureLayout.from_manifest(manifest) if manifest is not None and not tc.online else None
    for uri, m in manifests.items():
        if layout is not None and FeatureLayout.from_manifest(m) != layout:
            raise ConfigError(f"train.features: the feature run {uri} stores {FeatureLayout.from_manifest(m)}, "
                              f"but {manifest_uri} stores {layout}; runs trained on together need the same "
                              "layers and storage layout")
        if tc.distill and not tc.online and not m.get("teacher_topk"):
            raise ConfigError(f"train.distill: {tc.distill} needs the target's log-probs, which the feature run "
                              f"{uri} does not store; make it with features.storage.teacher_topk > 0 "
                              "(or train with train.online: true)")

    # ---- the drafter, and the run it may resume
    try:
        cfg = drafter_config_for_target(target, num_hidden_layers=dc.num_layers, block_size=dc.block_size,
                                        target_layer_ids=layer_ids, mask_token_id=dc.mask_token_id,
                                        intermediate_size=dc.intermediate_size, sliding_window=dc.sliding_window,
                                        layer_types=dc.layer_types)
    except ValueError as e:  # the window rules (>= block size, <= context, one kind per layer)
        raise ConfigError(f"drafter.{e}") from None
    resume, resume_cfg = latest_checkpoint_state(run_uri, tc.storage_options)
    if resume_cfg is not None:
        _check_same_drafter(resume_cfg, cfg, tc.run_name, run_uri)
    torch.manual_seed(tc.seed)
    drafter = DFlashDrafter(cfg)
    parent = {}  # lineage of the drafter this run fine-tunes
    if dc.init_from:
        parent = _init_from_drafter(drafter, dc.init_from, target, tracking_uri)
    elif dc.init_from_target:
        init_from_target(drafter, target)
    init_state = {k: v.detach().float().clone() for k, v in drafter.state_dict().items()}

    # ---- data
    datasets, train_rows = _datasets(recipe, target, tok_hash, layer_ids, manifests, options, sequences)
    inherited = drafter.draft_vocab
    if dc.draft_vocab_size and inherited is not None and inherited.numel() == dc.draft_vocab_size:
        log.info("draft vocabulary: the parent's %d tokens", inherited.numel())
    elif dc.draft_vocab_size:
        drafter.set_draft_vocab(_draft_vocab(recipe, target, list(manifests), options, datasets["train"]))
    else:
        drafter.set_draft_vocab(None)

    # ---- MLflow (the run of a resumed training continues)
    lineage = {
        "target_model": spec.model, "target_identity": target.identity, "tokenizer_hash": tok_hash,
        "features_uri": ",".join(manifests) or storage.absolute_uri(sequences),
        "features_manifest_sha256": _manifests_sha256(list(manifests), options) if manifests else None,
        "config_sha256": recipe.config_hash(), "git_commit": registry.git_commit(), "run_name": tc.run_name,
        "recipe": recipe.source, "block_size": cfg.block_size, "num_layers": cfg.num_hidden_layers,
        "target_layer_ids": list(cfg.target_layer_ids), "online_features": tc.online, **parent,
        **{k: v for k, v in longalign.items() if k != "uri"}, **recipe.version_tags,
    }
    run_id = registry.start_run(
        tracking_uri, recipe.registry.experiment or recipe.model_name, tc.run_name,
        tags={f"dflash.{k}": v for k, v in lineage.items() if v is not None} | {"dflash.run_uri": run_uri},
        resume_run_id=(resume_cfg or {}).get("dflash_ray", {}).get("mlflow_run_id"))
    registry.log_params(tracking_uri, run_id, recipe.as_dict())
    lineage["mlflow_run_id"] = run_id
    cfg.extra = dict(lineage)

    mlflow_live = not registry.is_local_store(tracking_uri) or _single_node()
    if not mlflow_live:
        log.warning("MLflow store %s is local to this node and the cluster has several: workers will not log "
                    "live metrics (the driver logs the evaluations at the end); set MLFLOW_TRACKING_URI to a "
                    "server for live metrics", tracking_uri)

    collate_layout = layout.as_dict() if layout is not None else None
    if collate_layout is not None and not tc.distill:
        collate_layout["teacher_topk"] = 0  # stored teacher log-probs the loss will not use are never decoded
    return _Plan(target=dataclasses.asdict(spec) | {"identity": target.identity}, drafter_config=cfg,
                 draft_vocab=drafter.draft_vocab.tolist() if drafter.draft_vocab is not None else None,
                 init_state=ray.put(init_state), datasets=datasets, layout=collate_layout, train_rows=train_rows,
                 lineage=lineage, tracking_uri=tracking_uri, run_id=run_id, run_uri=run_uri,
                 storage_options=tc.storage_options, resume=resume, mlflow_live=mlflow_live)


def _init_from_drafter(drafter, path: str, target, tracking_uri: str) -> dict:
    """Copy a trained drafter's weights into ``drafter`` (same shape; the draft vocabulary
    is an index set over the target's LM head, so the new run's own one is kept).
    ``path`` is a drafter directory or a registry version (``models:/name@alias``,
    ``models:/name/<version>``, downloaded through pipelines.registry). Returns the
    parent's lineage fields."""
    from specdec.checkpoint import DrafterMismatchError, load_drafter

    parent = {"parent_drafter": path, "parent_uri": path}
    local = path
    if registry.is_registry_uri(path):
        try:
            found, _, version = registry.resolve_drafter(tracking_uri, path)
        except (ValueError, registry.RegistryError) as e:
            raise ConfigError(f"drafter.init_from: {e}") from None
        local = str(found)
        parent["parent_version"] = version
    try:
        source = load_drafter(local, dtype=torch.float32, target=target)
    except (FileNotFoundError, DrafterMismatchError) as e:
        raise ConfigError(f"drafter.init_from: {e}") from None
    mine, theirs = drafter.config, source.config
    for name in ("num_hidden_layers", "block_size", "target_layer_ids", "intermediate_size", "mask_token_id"):
        if getattr(mine, name) != getattr(theirs, name):
            raise ConfigError(f"drafter.init_from: {path} has {name}={getattr(theirs, name)!r} but the recipe "
                              f"builds {getattr(mine, name)!r}")
    drafter.load_state_dict(source.state_dict())
    log.info("drafter initialised from %s%s", path, f" (v{parent['parent_version']})" if "parent_version" in parent
             else "")
    # the parent's draft vocabulary, built on its (larger) data: a fine-tuning set of a few
    # hundred answers would give a vocabulary that covers little of what the parent drafts
    drafter.set_draft_vocab(source.draft_vocab)
    return parent | {"parent_mlflow_run_id": theirs.extra.get("mlflow_run_id")}


def _longalign_sequences(recipe: TrainRecipe, target, run_uri: str) -> dict:
    """Read ``train.longalign`` with the target's chat template and write its token rows to
    ``<run>/longalign.parquet`` (once: a resumed run reuses the file, and refuses a source
    whose rows changed). Returns the rows' URI and the lineage fields."""
    from pipelines.longalign import LongAlignError, read_longalign, write_sequences

    tc = recipe.train
    if target.tokenizer is None:
        raise ConfigError(f"train.longalign: the target {recipe.features.target.model} has no tokenizer")
    source = storage.absolute_uri(tc.longalign)
    src_fs, src_path = storage.filesystem(source, tc.storage_options)
    try:
        if not src_fs.isfile(src_path):
            raise ConfigError(f"train.longalign: {source} is not a file (expected a LongAlign JSONL)")
        with tempfile.TemporaryDirectory(prefix="dflash-longalign-") as tmp:
            local = src_path
            if not storage.is_local(src_fs):  # object storage: read a local copy
                local = str(Path(tmp) / Path(src_path).name)
                src_fs.get_file(src_path, local)
            data = read_longalign(local, target.tokenizer, tc.max_length)
    except LongAlignError as e:  # "<path>:<line>: <field>: ..."
        raise ConfigError(f"train.longalign: {e}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"train.longalign: {source}: {e}") from None
    if not data.rows:
        raise ConfigError(f"train.longalign: {tc.longalign} has no conversation of at most {tc.max_length} tokens "
                          f"({data.lines} lines, {data.skipped_too_long} longer than train.max_length)")
    print(f"longalign: {len(data.rows)} sequences, {data.tokens} tokens, {data.skipped_too_long} skipped "
          f"(longer than max_length)", flush=True)
    # in a stable pseudo-random order: files often come sorted by length, and Ray Data splits
    # the rows file into contiguous shares, one per worker (measured: one DDP worker got every
    # 4K-8K conversation and ran at 93% CPU while the other waited at 27%)
    rows = sorted(data.rows, key=_hashed_order)
    sha = sequences_sha256(rows)
    lengths = [len(r["input_ids"]) for r in rows]
    pad = simulated_padding(lengths, tc.batch_size, tc.shuffle_buffer, tc.seed)
    log.info("longalign padding at batch size %d: %.1f%% in random batches, %.1f%% length-bucketed (%s)",
             tc.batch_size, 100 * pad["random"], 100 * pad["bucketed"],
             "on: train.length_buckets" if tc.length_buckets else "off")
    uri = storage.join(run_uri, LONGALIGN_FILE)
    fs, path = storage.filesystem(uri, tc.storage_options)
    if fs.exists(path):
        import pyarrow.parquet as pq

        with fs.open(path, "rb") as f:
            # content, not order: a rows file written before the hashed order still resumes
            have = sequences_sha256(sorted(pq.read_table(f, columns=["id", "input_ids", "loss_mask"]).to_pylist(),
                                           key=_hashed_order))
        if have != sha:
            raise ConfigError(f"train.longalign: run '{tc.run_name}' was started on other rows ({uri} has content "
                              f"sha256 {have[:12]}.., {tc.longalign} now gives {sha[:12]}..); use another "
                              "train.run_name to start afresh")
    elif storage.is_local(fs):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        write_sequences(rows, tmp)
        os.replace(tmp, path)
    else:
        with tempfile.TemporaryDirectory(prefix="dflash-longalign-") as tmp:
            write_sequences(rows, str(Path(tmp) / LONGALIGN_FILE))
            fs.put_file(str(Path(tmp) / LONGALIGN_FILE), path)
    return {"uri": uri, "longalign": storage.absolute_uri(tc.longalign), "longalign_sha256": sha,
            "longalign_sequences": len(data.rows), "longalign_tokens": data.tokens}


def _hashed_order(row: dict) -> bytes:
    return hashlib.sha256(row["id"].encode()).digest()


def _manifests_sha256(uris: list[str], options: dict) -> str:
    """One run: its manifest's sha256; several: the sha256 of theirs, in order."""
    shas = [manifest_sha256(uri, options) for uri in uris]
    return shas[0] if len(shas) == 1 else hashlib.sha256(",".join(shas).encode()).hexdigest()


def _draft_vocab(recipe: TrainRecipe, target, manifest_uris: list[str], options: dict, train_ds) -> torch.Tensor:
    """The ``drafter.draft_vocab_size`` most frequent response tokens of the training rows
    (held-out rows never count), plus the target's stop tokens."""
    from pipelines.features import response_token_counts
    from specdec.draft_vocab import build_vocab, count_tokens, coverage

    size = recipe.drafter.draft_vocab_size
    if size > target.vocab_size:
        raise ConfigError(f"drafter.draft_vocab_size: {size} exceeds the target vocabulary ({target.vocab_size})")
    tc = recipe.train
    if manifest_uris:  # stored features: read just the token columns of each shard
        holdout = 0.0 if tc.holdout else tc.holdout_fraction
        counts = sum(response_token_counts(uri, options, target.vocab_size, holdout) for uri in manifest_uris)
    else:
        rows = train_ds.select_columns(["input_ids", "loss_mask"]).iter_rows()
        counts = count_tokens(((r["input_ids"], r["loss_mask"]) for r in rows), target.vocab_size)
    ids = build_vocab(counts, size, always=target.stop_token_ids())
    log.info("draft vocabulary: %d tokens cover %.2f%% of %d training response tokens", ids.numel(),
             100 * coverage(counts, ids), int(counts.sum()))
    return ids


def _layer_ids(recipe: TrainRecipe, target, manifest: dict | None, manifest_uri: str | None) -> list[int]:
    """The target layers the drafter reads: stored features fix them; online features
    take the recipe's (or the paper's spacing)."""
    from specdec.target import default_target_layer_ids

    dc = recipe.drafter
    if recipe.train.online:
        layer_ids = list(dc.layer_ids or default_target_layer_ids(target.num_layers, dc.num_features))
    else:
        layer_ids = list(dc.layer_ids or manifest["layer_ids"])
        if layer_ids != list(manifest["layer_ids"]):
            raise ConfigError(f"drafter.layer_ids: {layer_ids} but the feature run at {manifest_uri} holds layers "
                              f"{manifest['layer_ids']}; leave it null or train with online features")
    if any(not 0 <= i < target.num_layers for i in layer_ids) or len(set(layer_ids)) != len(layer_ids):
        raise ConfigError(f"drafter.layer_ids: {layer_ids} are not distinct layers of a {target.num_layers}-layer "
                          "target")
    return layer_ids


def _datasets(recipe: TrainRecipe, target, tok_hash, layer_ids, manifests: dict, options, sequences=None):
    """({"train": streamed rows, "holdout": materialised rows}, training rows estimate).
    Feature runs are checked against the target (identity, tokenizer; layers and width
    unless the features are computed online); several runs are read as one."""
    from pipelines.features import read_features

    tc = recipe.train
    expect = {"target_identity": target.identity, "tokenizer_hash": tok_hash}
    if not tc.online:
        expect.update(layer_ids=list(layer_ids), hidden_size=target.hidden_size)

    def feature_run(uri):
        ds = read_features(storage.absolute_uri(uri), storage_options=options, **expect)
        return ds.select_columns(["id", "input_ids", "loss_mask"]) if tc.online else ds

    def source(uri, field_name):
        if tc.online and sequences:
            return read_sequences(uri, tc.storage_options or options, field_name)
        return feature_run(uri)

    if tc.online and sequences:
        train_ds = source(sequences, "train.longalign" if tc.longalign else "train.sequences")
    else:
        first, *rest = [feature_run(uri) for uri in manifests]
        train_ds = first.union(*rest) if rest else first
    if tc.holdout:
        holdout_ds = source(tc.holdout, "train.holdout")
    elif tc.holdout_fraction > 0:
        holdout_ds = split_holdout(train_ds, tc.holdout_fraction, holdout=True)
        train_ds = split_holdout(train_ds, tc.holdout_fraction, holdout=False)
    else:
        raise ConfigError("train.holdout_fraction: evaluation needs held-out rows; set a fraction > 0 or "
                          "train.holdout")
    for ds in (train_ds, holdout_ds):  # workers print their own progress lines
        ds.context.enable_progress_bars = False
    holdout_ds = holdout_ds.limit(tc.eval_samples).materialize()
    holdout_ds.context.enable_progress_bars = False
    if holdout_ds.count() == 0:
        raise ConfigError("train.holdout_fraction: no sequence falls in the held-out share; raise it or set "
                          "train.holdout")
    if manifests and not (tc.online and sequences):
        samples = sum(m["num_samples"] for m in manifests.values())
        train_rows = int(samples * (1 if tc.holdout else 1 - tc.holdout_fraction))
    else:
        train_rows = train_ds.count()
    return {"train": train_ds, "holdout": holdout_ds}, max(1, train_rows)


def _check_same_drafter(saved: dict, cfg, run_name: str, run_uri: str) -> None:
    """A resumed run must train the same drafter shape; name the first field that differs."""
    now = cfg.to_hf_dict()
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "block_size", "sliding_window", "layer_types"):
        if saved.get(key, now.get(key) if key == "layer_types" else None) != now.get(key):
            field_name = {"num_hidden_layers": "drafter.num_layers", "block_size": "drafter.block_size",
                          "intermediate_size": "drafter.intermediate_size", "sliding_window": "drafter.sliding_window",
                          "layer_types": "drafter.layer_types"}.get(key, f"drafter ({key})")
            raise ConfigError(f"{field_name}: run '{run_name}' at {run_uri} was trained with {key}={saved.get(key)}, "
                              f"the recipe now gives {now.get(key)}; use another train.run_name to start afresh")
    for key in ("target_layer_ids", "mask_token_id"):
        if saved["dflash_config"].get(key) != now["dflash_config"].get(key):
            raise ConfigError(f"drafter.{'layer_ids' if key == 'target_layer_ids' else key}: run '{run_name}' at "
                              f"{run_uri} was trained with {saved['dflash_config'].get(key)}, the recipe now gives "
                              f"{now['dflash_config'].get(key)}; use another train.run_name")


def _ray_storage(uri: str, options: dict):
    """(storage_path, storage_filesystem) for Ray Train: local paths as they are; S3 with
    explicit endpoint or credentials through a pyarrow filesystem built from them."""
    if "://" not in uri or uri.startswith("file://"):
        return storage.absolute_uri(uri), None
    opts = storage.resolve_options(uri, options)
    if uri.startswith(("s3://", "s3a://")) and (opts.get("endpoint_url") or opts.get("key")):
        import pyarrow.fs as pafs

        client_kwargs = opts.get("client_kwargs") or {}
        fs = pafs.S3FileSystem(access_key=opts.get("key"), secret_key=opts.get("secret"),
                               session_token=opts.get("token"), region=client_kwargs.get("region_name"),
                               endpoint_override=opts.get("endpoint_url"))
        return uri.split("://", 1)[1], fs
    return uri, None


def _trainer(recipe: TrainRecipe, plan: _Plan):
    import ray
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    tc = recipe.train
    storage_path, storage_fs = _ray_storage(tc.storage_path, tc.storage_options)
    resources = {"CPU": tc.cpus_per_worker} | ({"GPU": 1} if tc.use_gpu else {})
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    run_config = RunConfig(
        name=tc.run_name, storage_path=storage_path, storage_filesystem=storage_fs,
        failure_config=FailureConfig(max_failures=tc.max_failures),
        checkpoint_config=CheckpointConfig(num_to_keep=tc.keep_best, checkpoint_score_attribute="holdout_tau",
                                           checkpoint_score_order="max"),
        worker_runtime_env={"env_vars": env} if env else None,
    )
    train = dataclasses.asdict(tc)
    if tc.feature_cache:  # a relative path means the driver's directory (workers run elsewhere)
        train["feature_cache"] = str(Path(tc.feature_cache).expanduser().resolve())
    config = {
        "train": train, "drafter": plan.drafter_config.as_dict(), "init_state": plan.init_state,
        "draft_vocab": plan.draft_vocab,
        "target": plan.target, "layout": plan.layout, "train_rows": plan.train_rows,
        "lam": tc.loss_lambda, "mlflow": {"tracking_uri": plan.tracking_uri, "run_id": plan.run_id,
                                          "live": plan.mlflow_live},
    }
    del ray
    return TorchTrainer(train_loop_per_worker, train_loop_config=config,
                        scaling_config=ScalingConfig(num_workers=tc.num_workers, use_gpu=tc.use_gpu,
                                                     resources_per_worker=resources),
                        run_config=run_config, datasets=plan.datasets,
                        dataset_config=DataConfig(datasets_to_split=["train"]))


def _single_node() -> bool:
    import ray

    return len([n for n in ray.nodes() if n.get("Alive")]) <= 1


def _finish(recipe: TrainRecipe, plan: _Plan, result, seconds: float) -> FitResult:
    """Export the best checkpoint, log it and the learning curve, register a version."""
    from pipelines.train.curves import write_learning_curve
    from specdec.checkpoint import load_drafter, save_drafter

    tc = recipe.train
    scored = [(c, m) for c, m in (result.best_checkpoints or []) if m.get("holdout_tau") is not None]
    if not scored:
        raise RuntimeError(f"run {tc.run_name} reported no checkpoint with a held-out tau")
    best_ckpt, best = max(scored, key=lambda cm: (cm[1]["holdout_tau"], cm[1].get("step", 0)))
    with result.checkpoint.as_directory() as d:
        final = TrainState.load(d)
    export_uri = storage.absolute_uri(tc.export) if tc.export else storage.join(plan.run_uri, DRAFTER_DIR)
    uri, run_id = plan.tracking_uri, plan.run_id
    with tempfile.TemporaryDirectory(prefix="dflash-export-") as tmp:
        # ---- the drafter directory, with its lineage
        with best_ckpt.as_directory() as d:
            drafter = load_drafter(Path(d) / DRAFTER_DIR)
        drafter.config.extra.update(plan.lineage)
        drafter.config.extra.update(holdout_tau=float(best["holdout_tau"]), best_step=int(best["step"]),
                                    samples=int(best["samples"]), checkpoint=_checkpoint_uri(best_ckpt))
        bf16 = tc.precision == "bf16" or (tc.precision == "auto" and tc.use_gpu)
        dtype = getattr(torch, tc.export_dtype) if tc.export_dtype != "auto" else (
            torch.bfloat16 if bf16 else torch.float32)
        local = Path(tmp) / DRAFTER_DIR
        save_drafter(drafter, local, dtype=dtype)
        _publish_dir(local, export_uri, tc.storage_options)
        curve_dir = Path(tmp) / "eval"
        curve = write_learning_curve(final.history, curve_dir, title=f"{tc.run_name}: held-out tau")
        _publish_dir(curve_dir, storage.join(plan.run_uri, "eval"), tc.storage_options)

        # ---- MLflow: artifacts, final metrics, a registered version
        if not plan.mlflow_live:
            logger = registry.MetricsLogger(uri, run_id)
            for rec in final.history:
                logger.log({k: v for k, v in rec.items() if k.startswith("holdout_") and not isinstance(v, list)},
                           rec["step"])
            logger.flush()
        source = registry.log_artifacts(uri, run_id, local, DRAFTER_DIR)
        registry.log_artifacts(uri, run_id, curve_dir, "eval")
        registry.MetricsLogger(uri, run_id, flush_every=1).log(
            {"best_holdout_tau": best["holdout_tau"], "best_step": best["step"]}, final.step)
        version = None
        if recipe.registry.register:
            version = _registered_version(recipe, plan, final, int(best["step"]))
            if version is None:
                version = registry.register_drafter(uri, run_id, source, recipe.model_name,
                                                    registry.lineage_tags(drafter.config.extra)
                                                    | recipe.version_tags,
                                                    description=f"run {tc.run_name}, best step {best['step']}")
                registry.client(uri).set_tag(run_id, "dflash.model_version", f"{recipe.model_name}/{version}")
        registry.finish_run(uri, run_id)
    return FitResult(
        run_name=tc.run_name, run_uri=plan.run_uri, checkpoint=_checkpoint_uri(best_ckpt), drafter_dir=export_uri,
        holdout_tau=float(best["holdout_tau"]), best_step=int(best["step"]), steps=final.step,
        samples=final.samples, resumed_from_step=_first_resume(plan, final), history=final.history,
        tracking_uri=plan.tracking_uri, mlflow_run_id=plan.run_id,
        model_name=recipe.model_name if version else None, model_version=version, seconds=round(seconds, 2),
        learning_curve=storage.join(plan.run_uri, "eval", Path(curve["png"]).name) if curve.get("png") else None,
        extra=dict(drafter.config.extra))


def _registered_version(recipe: TrainRecipe, plan: _Plan, final: TrainState, best_step: int) -> str | None:
    """The version this run already registered, when this call trained nothing new (the
    same run name run again after it finished): registering it twice would add nothing."""
    if plan.resume is None or final.step != plan.resume.step:
        return None
    tag = registry.client(plan.tracking_uri).get_run(plan.run_id).data.tags.get("dflash.model_version", "")
    name, _, version = tag.rpartition("/")
    if name != recipe.model_name or not version:
        return None
    tags = registry.client(plan.tracking_uri).get_model_version(name, version).tags
    return version if tags.get("best_step") == str(best_step) else None


def _first_resume(plan: _Plan, final: TrainState) -> int | None:
    """The step this fit() started from: the run's state before the call, else the step a
    restarted worker group resumed from during it."""
    return plan.resume.step if plan.resume is not None else final.resumed_from_step


def _checkpoint_uri(ckpt) -> str:
    fs_type = getattr(ckpt.filesystem, "type_name", "local")
    return ckpt.path if fs_type == "local" else f"{fs_type}://{ckpt.path}"


def _publish_dir(local: Path, uri: str, options: dict) -> None:
    """Copy a local directory to ``uri`` (a local path or object storage), replacing it."""
    fs, path = storage.filesystem(uri, options)
    if storage.is_local(fs):
        tmp = Path(f"{path}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(local, tmp)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        return
    if fs.exists(path):
        fs.rm(path, recursive=True)
    for f in sorted(local.rglob("*")):
        if f.is_file():
            fs.put_file(str(f), storage.join(path, f.relative_to(local).as_posix()))


def _safe(fn) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        log.warning("%s", e)
