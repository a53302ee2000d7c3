"""Helpers for the simulated multi-node tests (``ray.cluster_utils.Cluster``)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path


def node_env(root: Path, name: str) -> dict:
    """A node's own local directories: nothing a worker writes there is seen by another node."""
    d = root / name
    (d / "cache").mkdir(parents=True)
    (d / "tmp").mkdir()
    return {"DFLASH_CACHE": str(d / "cache"), "TMPDIR": str(d / "tmp")}


@contextmanager
def two_node_cluster(root: Path, num_cpus: int):
    """A head and a second node of ``num_cpus`` CPUs each, every node with its own local
    directories, and this process connected to it: yields (cluster, the second node)."""
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": num_cpus, "env_vars": node_env(root, "head")})
    node = c.add_node(num_cpus=num_cpus, env_vars=node_env(root, "node-b"))
    ray.init(address=c.address, log_to_driver=False, logging_level="warning")
    try:
        yield c, node
    finally:
        ray.shutdown()
        c.shutdown()
