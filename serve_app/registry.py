"""Where a replica's drafter comes from: a directory, or an MLflow registry reference
(``models:/<name>@<alias>`` or ``models:/<name>/<version>``) resolved to a version and
downloaded into the local cache. ``DrafterSource.poll`` re-resolves an alias so that a
replica notices when the promotion job moves it. The registry calls themselves are
``pipelines.registry``'s, the one MLflow layer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from pipelines import registry
from pipelines.registry import NotFound as DrafterNotFound  # noqa: F401 - what serving catches
from pipelines.registry import find_drafter_dir, is_registry_uri, parse_models_uri

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedDrafter:
    source: str  # what the user configured
    version: str  # registry version, or "local" for a directory
    path: str  # local directory holding config.json + model.safetensors


class DrafterSource:
    """Resolves a configured drafter; for registry aliases, remembers the version in use."""

    def __init__(self, source: str, tracking_uri: str | None = None):
        self.source = source
        self.registry = is_registry_uri(source)
        self.tracking_uri = registry.resolve_tracking_uri(tracking_uri) if self.registry else tracking_uri
        if self.registry:
            self.name, self.alias, self.version = parse_models_uri(source)

    def current_version(self) -> str:
        """The version the reference points at now (raises DrafterNotFound)."""
        if not self.registry:
            return "local"
        if self.version is not None:
            return self.version
        return registry.alias_version(self.tracking_uri, self.name, self.alias)

    def fetch(self, version: str | None = None) -> ResolvedDrafter:
        """Resolve (if needed) and download; returns the local checkpoint directory."""
        if not self.registry:
            path = Path(self.source).expanduser()
            if not path.exists():
                raise FileNotFoundError(f"drafter directory {path} does not exist")
            return ResolvedDrafter(self.source, "local", str(find_drafter_dir(path)))
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
