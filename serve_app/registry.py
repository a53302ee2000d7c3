"""Where a deployment's drafter comes from: a directory, or an MLflow registry reference
(``models:/<name>@<alias>`` or ``models:/<name>/<version>``) resolved to a version and
downloaded into the local cache. :func:`choose_drafter` is the one rule both backends
start from (``drafter=auto`` -> ``@champion`` -> the packaged reference drafter of an
embedded target -> none); ``DrafterSource.poll`` re-resolves an alias so that a replica
notices when the promotion job moves it. The registry calls themselves are
``pipelines.registry``'s, the one MLflow layer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipelines import registry
from pipelines.registry import NotFound as DrafterNotFound  # noqa: F401 - what serving catches
from pipelines.registry import find_drafter_dir, is_registry_uri, parse_models_uri

if TYPE_CHECKING:
    from serve_app.config import ServeConfig

log = logging.getLogger("ray.serve.dflash.registry")  # a child of Serve's logger: the replica log file

LOCAL_VERSION = "local"  # the version label of a drafter directory
REFERENCE_VERSION = "reference"  # the version label of the packaged reference drafter


@dataclass(frozen=True)
class ResolvedDrafter:
    source: str  # what the user configured
    version: str  # registry version, or "local" for a directory
    path: str  # local directory holding config.json + model.safetensors


class DrafterSource:
    """Resolves a configured drafter; for registry aliases, remembers the version in use.
    ``tracking_uri``: already resolved (:func:`pin_tracking_uri`)."""

    def __init__(self, source: str, tracking_uri: str | None = None):
        self.source = source
        self.registry = is_registry_uri(source)
        self.tracking_uri = tracking_uri
        if self.registry:
            self.name, self.alias, self.version = parse_models_uri(source)

    def current_version(self) -> str:
        """The version the reference points at now (raises DrafterNotFound)."""
        if not self.registry:
            return LOCAL_VERSION
        if self.version is not None:
            return self.version
        return registry.alias_version(self.tracking_uri, self.name, self.alias)

    def fetch(self, version: str | None = None) -> ResolvedDrafter:
        """Resolve (if needed) and download; returns the local checkpoint directory."""
        if not self.registry:
            path = Path(self.source).expanduser()
            if not path.exists():
                raise FileNotFoundError(f"drafter directory {path} does not exist")
            return ResolvedDrafter(self.source, LOCAL_VERSION, str(find_drafter_dir(path)))
        version = version or self.current_version()
        path = registry.download_version(self.tracking_uri, self.name, str(version))
        return ResolvedDrafter(self.source, str(version), str(path))

    def poll(self, known_version: str | None) -> ResolvedDrafter | None:
        """A newly resolved drafter if the alias moved away from ``known_version``, else None."""
        if not self.registry or self.version is not None:
            return None
        version = self.current_version()
        if version == known_version:
            return None
        log.info("drafter %s moved: version %s -> %s", self.source, known_version, version)
        return self.fetch(version)


# ---------------------------------------------------------------------- the drafter a deployment starts with
def pin_tracking_uri(cfg: ServeConfig) -> ServeConfig:
    """``cfg`` with the registry it reads pinned: for a registry drafter, the tracking URI
    resolved (the explicit one, else ``$MLFLOW_TRACKING_URI``, else MLflow's default; local
    stores made absolute). The one place serving resolves it; ``build_app`` calls it on the
    driver so that replicas and engine nodes read the driver's registry, whatever their
    working directory or environment. A pinned URI stays as it is."""
    if not (cfg.speculation_requested and is_registry_uri(cfg.drafter_source)):
        return cfg
    return cfg.model_copy(update={"tracking_uri": registry.resolve_tracking_uri(cfg.tracking_uri)})


@dataclass(frozen=True)
class DrafterChoice:
    """The drafter a deployment starts with (:func:`choose_drafter`)."""

    source: DrafterSource | None  # the configured drafter, 'auto' spelled out (None: speculation off);
    # its registry alias is what hf replicas follow, even while serving the reference or none
    version: str  # a registry version, LOCAL_VERSION, REFERENCE_VERSION, or "" (no drafter)
    path: str | None  # an absolute directory; None for a registry version (fetched where the engine runs)
    reason: str  # why this drafter (or none), for the deployment's log

    @property
    def kind(self) -> str:
        """One of: registry (a version to download), path (a directory), none."""
        if self.path is not None:
            return "path"
        return "registry" if self.version else "none"

    def fetch(self) -> str | None:
        """The drafter's directory on THIS node (a registry version is downloaded into the
        node's cache, a configured directory must exist here); None without a drafter."""
        if self.kind == "none":
            return None
        if self.version == REFERENCE_VERSION:  # packaged with the code: every node has it
            return self.path
        return self.source.fetch(self.version).path

    def log_to(self, logger: logging.Logger) -> None:
        # speculation was asked for, but there is nothing to speculate with (yet): worth a warning
        level = logging.WARNING if self.source is not None and self.kind == "none" else logging.INFO
        logger.log(level, "drafter: %s", self.reason)


def choose_drafter(cfg: ServeConfig) -> DrafterChoice:
    """The drafter rule of both backends: the configured directory or registry reference;
    with ``drafter=auto``, ``models:/dflash-<model>@champion``, else (nothing registered
    yet) the packaged reference drafter of an embedded target, else none (no speculation).
    A registry alias is resolved to the version it points at now (``DrafterNotFound`` for a
    missing explicit reference); nothing is downloaded."""
    if not cfg.speculation_requested:
        return DrafterChoice(None, "", None, f"none (speculation={cfg.speculation}, drafter={cfg.drafter})")
    cfg = pin_tracking_uri(cfg)
    src = DrafterSource(cfg.drafter_source, cfg.tracking_uri)
    if not src.registry:
        path = str(Path(src.source).expanduser().resolve())
        return DrafterChoice(src, LOCAL_VERSION, path, f"directory {path}")
    try:
        version = src.current_version()
        return DrafterChoice(src, version, None, f"{src.source} (version {version})")
    except DrafterNotFound as e:
        if cfg.drafter != "auto":
            raise
        missing = e
    reference = cfg.reference_drafter
    if reference is not None:  # until a champion is registered
        return DrafterChoice(src, REFERENCE_VERSION, str(Path(reference).resolve()),
                             f"the packaged reference drafter {reference} (nothing registered at {src.source} yet)")
    return DrafterChoice(src, "", None, f"none: nothing registered at {src.source} ({missing}) and no packaged "
                                        "reference drafter for this target; serving without speculation")
