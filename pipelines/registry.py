"""The one MLflow layer, shared by training, promotion and serving: where the tracking
server is, runs that survive restarts, metrics that never crash training, drafters as
registered model versions with lineage tags, alias reads and all-or-nothing alias moves,
registry errors mapped to two exceptions, and a version's download into the local cache.

Tracking: ``$MLFLOW_TRACKING_URI`` when set (an ``mlflow server`` for clusters), else
MLflow's own default (an embedded sqlite database, ``sqlite:///mlflow.db`` in the working
directory), made absolute so that workers with another working directory find it.
A drafter version's ``source`` is the run artifact holding ``config.json`` +
``model.safetensors``; ``models:/dflash-<target>/<version>`` downloads it.

One room over 400 lines on purpose: every MLflow call of the system goes through it (one
place maps MLflow's errors and absorbs its version changes). Its sections: tracking and runs,
lineage, errors, models/versions/aliases, downloads.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CHAMPION, PREVIOUS = "champion", "previous"
_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")

#: config.json "dflash_ray" keys that become model-version tags (the lineage)
LINEAGE_KEYS = ("target_identity", "target_model", "features_uri", "features_manifest_sha256", "config_sha256",
                "git_commit", "run_name", "mlflow_run_id", "holdout_tau", "best_step", "block_size",
                "num_layers", "target_layer_ids", "checkpoint", "parent_version", "parent_uri", "parent_drafter",
                "context")

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


def sqlite_file(uri: str | None) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for any other store)."""
    if uri and uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):])
    return None


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


def register_directory(tracking_uri: str, name: str, drafter_dir: str | Path) -> tuple[str, bool]:
    """Register a drafter directory that no training run of this store made (the packaged
    reference drafter, one trained elsewhere) as a new version of ``name``: one MLflow run
    holds its files, the version carries its ``dflash_ray`` lineage, ``weights_sha256`` and
    ``registered_from``. Returns (version, True); a directory whose weights a version of
    ``name`` already holds returns (that version, False) and registers nothing, so that
    running it twice adds nothing. ``FileNotFoundError`` when it is not a drafter directory."""
    import json

    from specdec.checkpoint import is_drafter_dir

    d = Path(drafter_dir)
    if not is_drafter_dir(d):
        raise FileNotFoundError(f"{d}: not a drafter directory (expected config.json and model.safetensors)")
    digest, where = sha256_bytes((d / "model.safetensors").read_bytes()), str(d.resolve())
    c = client(tracking_uri)
    try:
        versions = call(tracking_uri, f"listing versions of {name}",
                        lambda: c.search_model_versions(f"name = '{name}'"))
    except NotFound:
        versions = []
    for mv in versions:
        if (mv.tags or {}).get("weights_sha256") == digest:
            return str(mv.version), False
    extra = json.loads((d / "config.json").read_text()).get("dflash_ray") or {}
    run_id = start_run(tracking_uri, name, f"register-{d.name}", tags={"dflash.registered_from": where})
    source = log_artifacts(tracking_uri, run_id, d, "drafter")
    version = register_drafter(tracking_uri, run_id, source, name,
                               lineage_tags(extra) | {"weights_sha256": digest, "registered_from": where},
                               description=f"registered from {d}")
    c.set_tag(run_id, "dflash.model_version", f"{name}/{version}")
    finish_run(tracking_uri, run_id)
    return version, True


def lineage_tags(extra: dict) -> dict[str, str]:
    """Model-version tags from a drafter's ``dflash_ray`` lineage (config.json)."""
    return {k: str(extra[k]) for k in LINEAGE_KEYS if extra.get(k) is not None}


def finish_run(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    client(tracking_uri).set_terminated(run_id, status=status)


def log_benchmark(tracking_uri: str | None, experiment: str, metrics: dict[str, float],
                  files: tuple[Path, ...], params: dict | None = None) -> str:
    """One finished run in ``experiment`` holding a benchmark's metrics (names sanitised
    for MLflow), its params and its report files as artifacts; returns the run id."""
    import tempfile

    uri = resolve_tracking_uri(tracking_uri)
    run_id = start_run(uri, experiment, f"{experiment}-{int(time.time())}")
    if params:
        log_params(uri, run_id, params)
    logger = MetricsLogger(uri, run_id, flush_every=10**6)
    logger.log({re.sub(r"[^A-Za-z0-9_./ -]", "_", k): v for k, v in metrics.items()}, 0)
    logger.flush()
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            Path(tmp, Path(f).name).write_bytes(Path(f).read_bytes())
        log_artifacts(uri, run_id, tmp, experiment.replace("-", "_"))
    finish_run(uri, run_id)
    return run_id


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


# ---------------------------------------------------------------------------- errors
class RegistryError(RuntimeError):
    """A registry problem (no such model, version or alias; a failed call): the message
    says which registry and what was being done."""


class RegistryUnreachable(RegistryError):
    """The tracking/registry server does not answer; nothing was changed."""


class NotFound(RegistryError, LookupError):
    """The registry has no such model, alias or version."""


def check_reachable(tracking_uri: str, timeout_s: float = 5.0) -> None:
    """Raise ``RegistryUnreachable`` unless the registry answers. HTTP servers are asked
    for ``/health`` once, with a short timeout (MLflow's own client would retry for
    minutes); local stores (sqlite, file) need their directory to exist."""
    if tracking_uri.startswith(("http://", "https://")):
        url = tracking_uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                resp.read(64)
        except urllib.error.HTTPError as e:
            if e.code >= 500:  # a proxy in front of a dead server
                raise RegistryUnreachable(f"registry at {tracking_uri} unreachable: HTTP {e.code} from {url}") from None
            # 4xx (auth, no /health route): the server is there; API calls will say more
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            raise RegistryUnreachable(f"registry at {tracking_uri} unreachable: {reason}") from None
        return
    for prefix in ("sqlite:///", "file://"):
        if tracking_uri.startswith(prefix):
            path = Path(tracking_uri[len(prefix):])
            where = path.parent if prefix == "sqlite:///" else path
            if not where.exists():
                raise RegistryUnreachable(f"registry at {tracking_uri} unreachable: {where} does not exist")
            if prefix == "sqlite:///" and not path.exists():
                raise RegistryUnreachable(f"registry at {tracking_uri} unreachable: no database at {path} "
                                          "(train and register a drafter first, or pass --tracking-uri)")


def call(tracking_uri: str, what: str, fn):
    """Run one registry call; connection problems become ``RegistryUnreachable``, a missing
    resource ``NotFound``, other MLflow errors ``RegistryError`` (each saying which registry
    and what was being done)."""
    from mlflow.exceptions import MlflowException

    try:
        return fn()
    except MlflowException as e:
        msg = str(e.message if hasattr(e, "message") else e)
        if any(s in msg for s in ("Max retries exceeded", "Connection refused", "ConnectionError",
                                  "Failed to establish", "timed out")):
            raise RegistryUnreachable(f"registry at {tracking_uri} unreachable while {what}: "
                                      f"{msg.splitlines()[0]}") from None
        kind = NotFound if _is_missing(e) else RegistryError
        raise kind(f"registry at {tracking_uri}: {what} failed: {msg.splitlines()[0]}") from None
    except OSError as e:  # requests' ConnectionError is an OSError
        raise RegistryUnreachable(f"registry at {tracking_uri} unreachable while {what}: {e}") from None


def _is_missing(e) -> bool:
    return "RESOURCE_DOES_NOT_EXIST" in str(getattr(e, "error_code", "")) or "not found" in str(e).lower()


# ---------------------------------------------------------------------------- models, versions, aliases
def is_registry_uri(source: str | None) -> bool:
    return bool(source) and source.startswith("models:/")


def parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``models:/name@alias`` -> (name, alias, None); ``models:/name/3`` -> (name, None, "3")."""
    m = _MODELS_URI.match(uri)
    if not m:
        raise ValueError(f"not a registry reference: {uri!r} "
                         "(expected models:/<name>@<alias> or models:/<name>/<version>)")
    return m["name"], m["alias"], m["version"]


@dataclass
class ModelState:
    """What the registry holds for one model, read once before any decision."""

    name: str
    aliases: dict[str, str]  # alias -> version
    versions: dict[str, object]  # version -> ModelVersion (tags, run_id, source, ...)
    tags: dict[str, str]

    @property
    def champion(self) -> str | None:
        return self.aliases.get(CHAMPION)

    @property
    def previous(self) -> str | None:
        return self.aliases.get(PREVIOUS)

    def aliases_of(self, version: str) -> list[str]:
        return sorted(a for a, v in self.aliases.items() if v == version)

    def latest(self) -> str | None:
        return max(self.versions, key=int) if self.versions else None


def read_model(tracking_uri: str, name: str) -> ModelState:
    """Aliases, versions and tags of registered model ``name`` (``NotFound`` if absent)."""
    from mlflow.exceptions import MlflowException

    c = client(tracking_uri)

    def get():
        try:
            return c.get_registered_model(name)
        except MlflowException as e:
            if _is_missing(e):
                return None
            raise

    rm = call(tracking_uri, f"reading model {name}", get)
    if rm is None:
        raise NotFound(f"registry at {tracking_uri} has no model {name!r} (train and register a drafter "
                       "first: jobs/train_drafter.py; or check --model / --target)")
    versions = call(tracking_uri, f"listing versions of {name}",
                    lambda: list(c.search_model_versions(f"name='{name}'")))
    return ModelState(name=name, aliases={a: str(v) for a, v in (rm.aliases or {}).items()},
                      versions={str(mv.version): mv for mv in versions}, tags=dict(rm.tags or {}))


def resolve_version(state: ModelState, spec: str | None) -> str:
    """``latest`` (default), a version number, or an alias (``champion``, ``@previous``)."""
    spec = (spec or "latest").strip()
    if spec == "latest":
        v = state.latest()
        if v is None:
            raise NotFound(f"model {state.name!r} has no versions")
        return v
    alias = spec.removeprefix("@")
    if alias in state.aliases:
        return state.aliases[alias]
    if spec.removeprefix("v").isdigit() and spec.removeprefix("v") in state.versions:
        return spec.removeprefix("v")
    have = ", ".join(sorted(state.versions, key=int)) or "none"
    raise NotFound(f"model {state.name!r} has no version or alias {spec!r} (versions: {have}; "
                   f"aliases: {', '.join(f'@{a}' for a in sorted(state.aliases)) or 'none'})")


def alias_version(tracking_uri: str, name: str, alias: str) -> str:
    """The version ``name@alias`` points at now (``NotFound`` if the alias or the registry
    database does not exist; a missing sqlite file is never created as a side effect)."""
    db = sqlite_file(tracking_uri)
    if db is not None and not db.exists():
        raise NotFound(f"models:/{name}@{alias}: no registry database at {db}")
    try:
        mv = call(tracking_uri, f"reading models:/{name}@{alias}",
                  lambda: client(tracking_uri).get_model_version_by_alias(name, alias))
    except RegistryUnreachable:
        raise
    except RegistryError as e:  # no such model or alias (MLflow's error codes vary by store)
        raise NotFound(str(e)) from None
    return str(mv.version)


def set_aliases(tracking_uri: str, name: str, moves: list[tuple[str, str]], before: dict[str, str | None]) -> None:
    """Apply alias moves in order; if one fails, undo the ones already made (restore each
    alias to ``before[alias]``, deleting it where it did not exist) and raise saying what
    state the aliases are in."""
    c = client(tracking_uri)
    done: list[str] = []
    for alias, version in moves:
        try:
            call(tracking_uri, f"setting @{alias} -> {version}",
                 lambda: c.set_registered_model_alias(name, alias, str(version)))
        except RegistryError as e:
            failed_undo = []
            for a in reversed(done):
                old = before.get(a)
                try:
                    if old is None:
                        c.delete_registered_model_alias(name, a)
                    else:
                        c.set_registered_model_alias(name, a, str(old))
                except Exception as undo_error:  # noqa: BLE001 - report below
                    failed_undo.append(f"@{a} (should be {old or 'unset'}: {undo_error})")
            state = ("aliases restored: " + ", ".join(f"@{a}={before.get(a) or 'unset'}" for a in done)
                     if done and not failed_undo else "no alias was changed" if not done else
                     "COULD NOT RESTORE " + "; ".join(failed_undo) + " - fix by hand with set_registered_model_alias")
            raise type(e)(f"{e}; {state}") from None
        done.append(alias)


def set_version_tags(tracking_uri: str, name: str, version: str, tags: dict[str, str]) -> None:
    c = client(tracking_uri)
    for k, v in tags.items():  # MLflow has no batch call for version tags
        call(tracking_uri, f"tagging v{version}", lambda k=k, v=v: c.set_model_version_tag(name, version, k, v))


# ---------------------------------------------------------------------------- downloads
def drafter_cache() -> Path:
    """Where downloaded drafter versions are kept (``$DFLASH_CACHE/drafters``)."""
    from specdec.target import cache_root

    return cache_root() / "drafters"


def resolve_drafter(tracking_uri: str, uri: str, dst: str | Path | None = None) -> tuple[Path, str, str]:
    """``models:/name@alias`` or ``models:/name/<version>`` -> (the drafter directory,
    downloaded once into the drafter cache, the model name, the version number it
    resolved to). ``NotFound`` when the model, alias or version does not exist."""
    name, alias, version = parse_models_uri(uri)
    if alias is not None:
        version = alias_version(tracking_uri, name, alias)
    else:
        db = sqlite_file(tracking_uri)
        if db is not None and not db.exists():
            raise NotFound(f"{uri}: no registry database at {db}")
        call(tracking_uri, f"reading {uri}", lambda: client(tracking_uri).get_model_version(name, str(version)))
    return download_version(tracking_uri, name, str(version), dst), name, str(version)


def find_drafter_dir(root: str | Path) -> Path:
    """The directory under ``root`` (root itself first) that holds a drafter checkpoint."""
    from specdec.checkpoint import is_drafter_dir

    root = Path(root)
    for cand in [root, *sorted(p.parent for p in root.rglob("config.json"))]:
        if is_drafter_dir(cand):
            return cand
    raise FileNotFoundError(f"no drafter checkpoint (config.json + model.safetensors) under {root}")


def download_version(tracking_uri: str, name: str, version: str, dst: str | Path | None = None) -> Path:
    """The drafter directory of ``name`` v``version``, downloaded once into ``dst`` (default:
    the drafter cache, shared by the replicas of a node: written to a temporary folder and
    renamed, so a half-written download is never used)."""
    import mlflow

    # the version's own artifact URI through OUR client: downloading "models:/..." would
    # resolve the name against the process-wide registry URI, ignoring ours
    source = call(tracking_uri, f"resolving {name} v{version}",
                  lambda: client(tracking_uri).get_model_version_download_uri(name, str(version)))
    # keyed by the artifact too: "v1" of the same name in another registry is another drafter
    key = f"{version}-{sha256_bytes(source.encode())[:12]}"
    dst = Path(dst) if dst is not None else drafter_cache() / name / key
    if not (dst.exists() and any(dst.iterdir())):
        tmp = dst.with_name(f"{dst.name}.tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        call(tracking_uri, f"downloading {name} v{version} from {source}",
             lambda: mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(tmp),
                                                         tracking_uri=tracking_uri))
        try:
            if dst.exists():
                dst.rmdir()  # an empty leftover
            tmp.rename(dst)
        except OSError:  # another replica on this node got there first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    try:
        return find_drafter_dir(dst)
    except FileNotFoundError:
        raise RegistryError(f"{name} v{version}: its artifact ({dst}) holds no drafter "
                            "(config.json + model.safetensors)") from None
