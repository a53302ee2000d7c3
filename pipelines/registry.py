"""MLflow helpers shared by training and promotion: where the tracking server is, runs
that survive restarts, metrics that never crash training, drafters as registered model
versions with lineage tags.

Tracking: ``$MLFLOW_TRACKING_URI`` when set (an ``mlflow server`` for clusters), else
MLflow's own default (an embedded sqlite database, ``sqlite:///mlflow.db`` in the working
directory), made absolute so that workers with another working directory find it.
A drafter version's ``source`` is the run artifact holding ``config.json`` +
``model.safetensors``; ``models:/dflash-<target>/<version>`` downloads it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: config.json "dflash_ray" keys that become model-version tags (the lineage)
LINEAGE_KEYS = ("target_identity", "target_model", "features_uri", "features_manifest_sha256", "config_sha256",
                "git_commit", "run_name", "mlflow_run_id", "holdout_tau", "best_step", "block_size",
                "num_layers", "target_layer_ids", "checkpoint")

_PARAM_MAX = 6000  # MLflow's limit on a parameter value


def resolve_tracking_uri(uri: str | None = None) -> str:
    """The explicit ``uri``, else ``$MLFLOW_TRACKING_URI``, else MLflow's default; local
    sqlite / file paths are made absolute."""
    import mlflow

    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or mlflow.get_tracking_uri()
    for prefix in ("sqlite:///", "file://"):
        if uri.startswith(prefix):
            path = uri[len(prefix):]
            if prefix == "sqlite:///" and path.startswith("/"):
                return uri
            return prefix + str(Path(path).expanduser().resolve())
    if "://" not in uri:  # a bare directory: MLflow's file store
        return str(Path(uri).expanduser().resolve())
    return uri


def is_local_store(uri: str) -> bool:
    """True for stores that live on one machine's disk (sqlite, file)."""
    return uri.startswith(("sqlite:", "file:")) or "://" not in uri


def client(tracking_uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def ensure_experiment(tracking_uri: str, name: str) -> str:
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(name)
    return exp.experiment_id if exp is not None else c.create_experiment(name)


def start_run(tracking_uri: str, experiment: str, run_name: str, tags: dict | None = None,
              resume_run_id: str | None = None) -> str:
    """A run id: ``resume_run_id`` reopened when it still exists in this store, else a new run."""
    c = client(tracking_uri)
    if resume_run_id:
        try:
            c.get_run(resume_run_id)
            c.update_run(resume_run_id, status="RUNNING")
            return resume_run_id
        except Exception:  # noqa: BLE001 - another store, or deleted: start afresh
            log.warning("MLflow run %s is not in %s; starting a new run", resume_run_id, tracking_uri)
    run = c.create_run(ensure_experiment(tracking_uri, experiment), run_name=run_name,
                       tags={k: str(v) for k, v in (tags or {}).items()})
    return run.info.run_id


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = str(v)[:_PARAM_MAX]
    return out


def log_params(tracking_uri: str, run_id: str, params: dict) -> None:
    """Log (nested) params; keys the run already has are left alone (MLflow params are
    immutable, and a resumed run re-sends them)."""
    from mlflow.entities import Param

    c = client(tracking_uri)
    have = c.get_run(run_id).data.params
    new = [Param(k, v) for k, v in flatten(params).items() if k not in have]
    for i in range(0, len(new), 100):
        c.log_batch(run_id, params=new[i: i + 100])


class MetricsLogger:
    """Buffered metric logging that never takes training down: a failing tracking server
    costs a warning, not the run."""

    def __init__(self, tracking_uri: str | None, run_id: str | None, flush_every: int = 50):
        self.enabled = bool(tracking_uri and run_id)
        self.tracking_uri, self.run_id, self.flush_every = tracking_uri, run_id, flush_every
        self.buffer: list = []
        self._client = None

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.buffer += [Metric(k, float(v), now, int(step)) for k, v in metrics.items() if v is not None]
        if len(self.buffer) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self.enabled or not self.buffer:
            return
        try:
            self._client = self._client or client(self.tracking_uri)
            for i in range(0, len(self.buffer), 500):
                self._client.log_batch(self.run_id, metrics=self.buffer[i: i + 500])
        except Exception as e:  # noqa: BLE001
            log.warning("MLflow logging to %s failed (%s); metrics are kept in checkpoints only", self.tracking_uri, e)
            self.enabled = False
        self.buffer = []


def log_artifacts(tracking_uri: str, run_id: str, local_dir: str | Path, artifact_path: str) -> str:
    """Upload a directory; returns its artifact URI (a registrable model source)."""
    c = client(tracking_uri)
    c.log_artifacts(run_id, str(local_dir), artifact_path)
    return f"{c.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"


def register_drafter(tracking_uri: str, run_id: str, source: str, name: str, tags: dict,
                     description: str | None = None) -> str:
    """Register ``source`` (an artifact URI holding a drafter directory) as a new version
    of model ``name``; returns the version number as a string."""
    from mlflow.exceptions import MlflowException

    c = client(tracking_uri)
    try:
        c.create_registered_model(name, description=f"DFlash drafters for target {name.removeprefix('dflash-')}")
    except MlflowException as e:
        if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code) and "already exists" not in str(e).lower():
            raise
    tags = {k: str(v) for k, v in tags.items() if v is not None}
    mv = c.create_model_version(name, source, run_id=run_id, tags=tags, description=description)
    return str(mv.version)


def lineage_tags(extra: dict) -> dict[str, str]:
    """Model-version tags from a drafter's ``dflash_ray`` lineage (config.json)."""
    return {k: str(extra[k]) for k in LINEAGE_KEYS if extra.get(k) is not None}


def finish_run(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    client(tracking_uri).set_terminated(run_id, status=status)


# ---------------------------------------------------------------------------- lineage helpers
def git_commit(start: str | Path | None = None) -> str | None:
    """The checked-out commit of the repository holding ``start`` (read from ``.git``;
    ``$GIT_COMMIT`` wins, e.g. under ``ray job submit`` whose working dir has no .git)."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    here = Path(start or Path(__file__).resolve().parent).resolve()
    for d in [here, *here.parents]:
        git = d / ".git"
        if git.is_file():  # a worktree: "gitdir: <path>"
            git = Path(git.read_text().split(":", 1)[1].strip())
        if not git.is_dir():
            continue
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head or None
        ref = head.split(":", 1)[1].strip()
        if (git / ref).is_file():
            return (git / ref).read_text().strip()
        packed = git / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
        return None  # a branch without commits
    return None


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
