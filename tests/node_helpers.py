"""Helpers for the simulated multi-node tests (``ray.cluster_utils.Cluster``)."""

from __future__ import annotations

from pathlib import Path


def node_env(root: Path, name: str) -> dict:
    """A node's own local directories: nothing a worker writes there is seen by another node."""
    d = root / name
    (d / "cache").mkdir(parents=True)
    (d / "tmp").mkdir()
    return {"DFLASH_CACHE": str(d / "cache"), "TMPDIR": str(d / "tmp")}
