"""Ray Train drafter training, the driver's entry: :func:`fit` plans the run
(``pipelines/train/plan.py``), hands a ``TorchTrainer`` the training rows (streamed and
split across workers) and the held-out rows (every worker sees them, each evaluates its
share) to run ``train_loop_per_worker`` (``pipelines/train/worker.py``) on every worker,
then exports and registers the checkpoint with the best held-out tau
(``pipelines/train/export.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

from pipelines import registry, storage
from pipelines.train.config import TrainRecipe
from pipelines.train.export import FitResult, export_and_register
from pipelines.train.plan import RunPlan, prepare
from pipelines.train.worker import train_loop_per_worker

log = logging.getLogger(__name__)

#: environment the driver forwards to its workers: the model cache, knobs, test fault injection
FORWARDED_ENV = ("DFLASH_CACHE", "DFLASH_DEEPSPEED_SHM", "DFLASH_FAIL_AT_STEP", "DFLASH_FAIL_MARKER", "HF_HUB_OFFLINE")


def fit(recipe: TrainRecipe) -> FitResult:
    """Train (or resume) the run ``recipe.train.run_name``; export and register the best
    drafter. Connects to the current Ray cluster (``ray.init()`` if none)."""
    import ray

    t0 = time.perf_counter()
    if not ray.is_initialized():
        ray.init()
    plan = prepare(recipe)
    log.info("prepared run %s in %.1f s (%d training rows, resume from step %s)", recipe.train.run_name,
             time.perf_counter() - t0, plan.train_rows, plan.resume.step if plan.resume else None)
    trainer = _torch_trainer(recipe, plan)
    t1 = time.perf_counter()
    try:
        result = trainer.fit()
    except BaseException:
        _safe(lambda: registry.finish_run(plan.tracking_uri, plan.run_id, "FAILED"))
        raise
    log.info("Ray Train finished in %.1f s", time.perf_counter() - t1)
    t2 = time.perf_counter()
    out = export_and_register(recipe, plan, result, time.perf_counter() - t0)
    log.info("exported and registered in %.1f s", time.perf_counter() - t2)
    return out


def _torch_trainer(recipe: TrainRecipe, plan: RunPlan):
    """The ``TorchTrainer`` for the plan: workers, storage, checkpoints kept by held-out tau."""
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
        "draft_vocab": plan.draft_vocab, "holdout": plan.holdout,
        "target": plan.target, "layout": plan.layout, "train_rows": plan.train_rows,
        "lam": tc.loss_lambda, "mlflow": {"tracking_uri": plan.tracking_uri, "run_id": plan.run_id,
                                          "live": plan.mlflow_live},
    }
    return TorchTrainer(train_loop_per_worker, train_loop_config=config,
                        scaling_config=ScalingConfig(num_workers=tc.num_workers, use_gpu=tc.use_gpu,
                                                     resources_per_worker=resources),
                        run_config=run_config, datasets=plan.datasets,
                        dataset_config=DataConfig(datasets_to_split=["train"]))


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


def _safe(fn) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        log.warning("%s", e)
