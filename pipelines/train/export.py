"""After Ray Train's ``fit()``: the checkpoint with the best held-out tau exported as a
drafter directory (with its lineage), the learning curve, the MLflow artifacts and
metrics, a registered model version, and the :class:`FitResult` that says where all of
it went."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipelines import registry, storage
from pipelines.train.config import TrainRecipe, TrainSection
from pipelines.train.plan import RunPlan
from pipelines.train.runner import DRAFTER_DIR, TrainState


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


def export_and_register(recipe: TrainRecipe, plan: RunPlan, result, seconds: float) -> FitResult:
    """Export the best checkpoint, log it and the learning curve, register a version."""
    from pipelines.train.curves import write_learning_curve

    tc = recipe.train
    best_ckpt, best = _best_checkpoint(result, tc.run_name)
    with result.checkpoint.as_directory() as d:
        final = TrainState.load(d)
    export_uri = storage.absolute_uri(tc.export) if tc.export else storage.join(plan.run_uri, DRAFTER_DIR)
    with tempfile.TemporaryDirectory(prefix="dflash-export-") as tmp:
        local = Path(tmp) / DRAFTER_DIR
        drafter = _export_drafter(tc, plan, best_ckpt, best, local, export_uri)
        curve_dir = Path(tmp) / "eval"
        curve = write_learning_curve(final.history, curve_dir, title=f"{tc.run_name}: held-out tau")
        _publish_dir(curve_dir, storage.join(plan.run_uri, "eval"), tc.storage_options)
        version = _log_and_register(recipe, plan, final, best, drafter, local, curve_dir)
    return FitResult(
        run_name=tc.run_name, run_uri=plan.run_uri, checkpoint=_checkpoint_uri(best_ckpt), drafter_dir=export_uri,
        holdout_tau=float(best["holdout_tau"]), best_step=int(best["step"]), steps=final.step,
        samples=final.samples, resumed_from_step=_first_resume(plan, final), history=final.history,
        tracking_uri=plan.tracking_uri, mlflow_run_id=plan.run_id,
        model_name=recipe.model_name if version else None, model_version=version, seconds=round(seconds, 2),
        learning_curve=storage.join(plan.run_uri, "eval", Path(curve["png"]).name) if curve.get("png") else None,
        extra=dict(drafter.config.extra))


def _best_checkpoint(result, run_name: str):
    """(checkpoint, its metrics) with the highest held-out tau (the later step on ties)."""
    scored = [(c, m) for c, m in (result.best_checkpoints or []) if m.get("holdout_tau") is not None]
    if not scored:
        raise RuntimeError(f"run {run_name} reported no checkpoint with a held-out tau")
    return max(scored, key=lambda cm: (cm[1]["holdout_tau"], cm[1].get("step", 0)))


def _export_drafter(tc: TrainSection, plan: RunPlan, best_ckpt, best: dict, local: Path, export_uri: str):
    """The best checkpoint's drafter, with its lineage, saved to ``local`` in the export
    dtype and published to ``export_uri``; returns the drafter."""
    from specdec.checkpoint import load_drafter, save_drafter

    with best_ckpt.as_directory() as d:
        drafter = load_drafter(Path(d) / DRAFTER_DIR)
    drafter.config.extra.update(plan.lineage)
    drafter.config.extra.update(holdout_tau=float(best["holdout_tau"]), best_step=int(best["step"]),
                                samples=int(best["samples"]), checkpoint=_checkpoint_uri(best_ckpt))
    bf16 = tc.precision == "bf16" or (tc.precision == "auto" and tc.use_gpu)
    dtype = getattr(torch, tc.export_dtype) if tc.export_dtype != "auto" else (
        torch.bfloat16 if bf16 else torch.float32)
    save_drafter(drafter, local, dtype=dtype)
    _publish_dir(local, export_uri, tc.storage_options)
    return drafter


def _log_and_register(recipe: TrainRecipe, plan: RunPlan, final: TrainState, best: dict, drafter, local: Path,
                      curve_dir: Path) -> str | None:
    """MLflow: the evaluations (when the workers could not log them), artifacts, final
    metrics, a registered version (returned; None when not registering); ends the run."""
    tc, uri, run_id = recipe.train, plan.tracking_uri, plan.run_id
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
    return version


def _registered_version(recipe: TrainRecipe, plan: RunPlan, final: TrainState, best_step: int) -> str | None:
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


def _first_resume(plan: RunPlan, final: TrainState) -> int | None:
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
