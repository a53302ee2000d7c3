"""Where a replica's drafter comes from: a directory, or an MLflow registry reference
(``models:/<name>@<alias>`` or ``models:/<name>/<version>``) resolved to a version and
downloaded into the local cache. ``DrafterSource.poll`` re-resolves an alias so that a
replica notices when the promotion job moves it."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")


class DrafterNotFound(LookupError):
    """The registry has no such model, alias or version."""


@dataclass(frozen=True)
class ResolvedDrafter:
    source: str  # what the user configured
    version: str  # registry version, or "local" for a directory
    path: str  # local directory holding config.json + model.safetensors


def is_registry_uri(source: str | None) -> bool:
    return bool(source) and source.startswith("models:/")


def parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``models:/name@alias`` -> (name, alias, None); ``models:/name/3`` -> (name, None, "3")."""
    m = _MODELS_URI.match(uri)
    if not m:
        raise ValueError(f"not a registry reference: {uri!r} "
                         "(expected models:/<name>@<alias> or models:/<name>/<version>)")
    return m["name"], m["alias"], m["version"]


def _sqlite_file(uri: str | None) -> Path | None:
    if uri and uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):])
    return None


def default_tracking_uri() -> str:
    """MLflow's tracking URI as this process sees it ($MLFLOW_TRACKING_URI, else MLflow's
    default, a sqlite file in the working directory), made absolute so that replicas on
    other processes resolve the same registry."""
    import mlflow

    return mlflow.get_tracking_uri()


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash-ray")) / "drafters"


def find_drafter_dir(root: str | Path) -> Path:
    """The directory under ``root`` (root itself first) that holds a drafter checkpoint."""
    root = Path(root)
    for cand in [root, *sorted(p.parent for p in root.rglob("config.json"))]:
        if (cand / "config.json").is_file() and (cand / "model.safetensors").is_file():
            return cand
    raise FileNotFoundError(f"no drafter checkpoint (config.json + model.safetensors) under {root}")


class DrafterSource:
    """Resolves a configured drafter; for registry aliases, remembers the version in use."""

    def __init__(self, source: str, tracking_uri: str | None = None):
        self.source = source
        self.tracking_uri = tracking_uri
        self.registry = is_registry_uri(source)
        if self.registry:
            self.name, self.alias, self.version = parse_models_uri(source)

    def _client(self):
        import mlflow

        return mlflow.MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    def current_version(self) -> str:
        """The version the reference points at now (raises DrafterNotFound)."""
        if not self.registry:
            return "local"
        if self.version is not None:
            return self.version
        db = _sqlite_file(self.tracking_uri)
        if db is not None and not db.exists():  # do not create an empty registry as a side effect
            raise DrafterNotFound(f"{self.source}: no registry database at {db}")
        from mlflow.exceptions import MlflowException

        try:
            return str(self._client().get_model_version_by_alias(self.name, self.alias).version)
        except MlflowException as e:
            raise DrafterNotFound(f"{self.source}: {e.message if hasattr(e, 'message') else e}") from e

    def fetch(self, version: str | None = None) -> ResolvedDrafter:
        """Resolve (if needed) and download; returns the local checkpoint directory."""
        if not self.registry:
            path = Path(self.source).expanduser()
            if not path.exists():
                raise FileNotFoundError(f"drafter directory {path} does not exist")
            return ResolvedDrafter(self.source, "local", str(find_drafter_dir(path)))
        import mlflow

        version = version or self.current_version()
        dst = cache_dir() / self.name / str(version)
        if not dst.exists() or not any(dst.iterdir()):
            tmp = dst.with_name(f"{dst.name}.tmp{os.getpid()}")
            tmp.mkdir(parents=True, exist_ok=True)
            # the version's own artifact URI: download_artifacts("models:/...") would consult the
            # process-global registry URI rather than ours
            uri = self._client().get_model_version_download_uri(self.name, str(version))
            mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp), tracking_uri=self.tracking_uri)
            try:
                tmp.rename(dst)
            except OSError:  # another replica on this node got there first
                pass
        return ResolvedDrafter(self.source, str(version), str(find_drafter_dir(dst)))

    def poll(self, known_version: str | None) -> ResolvedDrafter | None:
        """A newly resolved drafter if the alias moved away from ``known_version``, else None."""
        if not self.registry or self.version is not None:
            return None
        version = self.current_version()
        if version == known_version:
            return None
        log.info("drafter %s moved: version %s -> %s", self.source, known_version, version)
        return self.fetch(version)
