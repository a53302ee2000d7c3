"""What a built Serve app will ask of the cluster, held against what the cluster has.

Ray Serve does not refuse an app that cannot fit: its replicas wait to be scheduled and the only
sign is a warning every 30 s. So the builder (both backends) reads every deployment of the app it
built, with what Ray Serve LLM adds (its replica actor merged into the engine's first placement
bundle), and places the replicas on the cluster's nodes before deploying:

* the app at its minimum (every deployment at ``min_replicas``, or its fixed count) does not fit:
  :class:`AppDoesNotFit`, naming the numbers and the settings that change them;
* autoscaling could only reach part of ``max_replicas``, or a hot swap could not start the new
  engine replica beside the old one: a warning saying so.

Placement is first-fit of each replica's bundles onto the nodes' totals (each bundle on one node;
a replica's bundles where they fit, or all on one node for STRICT_PACK), as Ray places placement
groups and plain actors on an idle cluster; the cluster is the one Ray is connected to, or the one ``serve run``
will start on this machine.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

Bundle = dict[str, float]

#: resources a bundle is held to; others (memory, object store) Ray reports too but Serve does not reserve
IGNORED = ("memory", "object_store_memory")


class AppDoesNotFit(ValueError):
    """The app at its minimum cannot be placed on the cluster."""


@dataclass(frozen=True)
class DeploymentNeed:
    """One deployment: what each replica reserves (its bundles), and how many replicas."""
    name: str
    bundles: tuple[Bundle, ...]
    min_replicas: int
    max_replicas: int
    surge: bool  # a rolling update starts a new replica before an old one stops
    strict: bool = False  # STRICT_PACK: all of a replica's bundles on one node

    @property
    def per_replica(self) -> Bundle:
        total: Bundle = {}
        for b in self.bundles:
            for k, v in b.items():
                total[k] = total.get(k, 0.0) + v
        return total


def bound_apps(obj) -> list:
    """The ``Application`` objects bound in ``obj`` (nested dicts, lists and tuples)."""
    from ray.serve import Application

    if isinstance(obj, Application):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return [app for item in items for app in bound_apps(item)]


def deployment_needs(app) -> list[DeploymentNeed]:
    """Every deployment bound in ``app`` (a Serve ``Application``), children first."""
    d = app._bound_deployment
    needs = [n for child in bound_apps((d.init_args, d.init_kwargs)) for n in deployment_needs(child)]
    rc, dc = d._replica_config, d._deployment_config
    bundles = rc.placement_group_bundles or [rc.resource_dict]
    clean = tuple({k: float(v) for k, v in b.items() if v and k not in IGNORED} for b in bundles)
    auto = dc.autoscaling_config
    if auto is not None:
        lo = max(auto.min_replicas, auto.initial_replicas or 0, 1 if auto.min_replicas == 0 else 0)
        hi = auto.max_replicas
    else:
        lo = hi = dc.num_replicas
    needs.append(DeploymentNeed(d.name, clean, lo, hi, surge=bool(getattr(dc, "max_surge_percent", 0)),
                                strict=rc.placement_group_strategy == "STRICT_PACK"))
    named = {n.name: n for n in needs}  # a deployment bound twice (the hub) runs once
    return list(named.values())


def _place(need: DeploymentNeed, free: list[Bundle]) -> bool:
    """First fit of one replica's bundles onto ``free`` (changed only when all fit); with
    ``strict`` all on the first node that holds them all."""
    if need.strict:
        for i, node in enumerate(free):
            one = [dict(node)]
            if _place(DeploymentNeed(need.name, need.bundles, 1, 1, False), one):
                free[i] = one[0]
                return True
        return False
    trial = [dict(n) for n in free]
    for b in need.bundles:
        node = next((n for n in trial if all(n.get(k, 0.0) + 1e-9 >= v for k, v in b.items())), None)
        if node is None:
            return False
        for k, v in b.items():
            node[k] = node.get(k, 0.0) - v
    free[:] = trial
    return True


@dataclass
class FitReport:
    fits: bool
    reachable: dict[str, int]  # deployment -> replicas that fit (the minimum first, then one by one)
    surge_fits: dict[str, bool]  # deployment -> a rolling update's extra replica fits at the minimum
    need: Bundle  # the app at its minimum
    have: Bundle  # the cluster's totals


def fit(needs: list[DeploymentNeed], nodes: list[Bundle]) -> FitReport:
    """Place the app at its minimum, then grow the autoscaled deployments one replica at a
    time (in turn) while they fit; and, at the minimum, one surge replica of each that surges."""
    free = [dict(n) for n in nodes]
    have: Bundle = {}
    for n in nodes:
        for k, v in n.items():
            have[k] = have.get(k, 0.0) + v
    need: Bundle = {}
    for d in needs:
        for k, v in d.per_replica.items():
            need[k] = need.get(k, 0.0) + v * d.min_replicas
    fits = all(_place(d, free) for d in needs for _ in range(d.min_replicas))
    at_min = [dict(n) for n in free]
    surge_fits = {d.name: _place(d, [dict(n) for n in at_min]) for d in needs if d.surge}
    reachable = {d.name: d.min_replicas for d in needs}
    growing = [d for d in needs if d.max_replicas > d.min_replicas]
    while fits and growing:
        growing = [d for d in growing if reachable[d.name] < d.max_replicas and _place(d, free)]
        for d in growing:
            reachable[d.name] += 1
    return FitReport(fits, reachable, surge_fits, need, have)


def _fmt(b: Bundle) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(b.items())) + "}"


def describe(report: FitReport, needs: list[DeploymentNeed], settings: str) -> tuple[str | None, list[str]]:
    """(the error, or None; the warnings) for ``report``; ``settings`` names what to change."""
    if not report.fits:
        parts = "; ".join(f"{d.name} {d.min_replicas} x {' + '.join(_fmt(b) for b in d.bundles) or '{}'}"
                          for d in needs)
        return (f"the app needs {_fmt(report.need)} at its minimum ({parts}) but the cluster has "
                f"{_fmt(report.have)}: it would wait forever to be scheduled. Change {settings}"), []
    warnings = [f"{d.name}: autoscaling can reach {report.reachable[d.name]} of max_replicas={d.max_replicas} "
                f"replicas on this cluster ({_fmt(report.have)}, each replica {_fmt(d.per_replica)})"
                for d in needs if report.reachable[d.name] < d.max_replicas]
    warnings += [f"{d.name}: a hot swap cannot start a new replica ({_fmt(d.per_replica)}) beside the old one on "
                 f"this cluster ({_fmt(report.have)}) and will wait; set vllm_rollout_surge: false to stop the old "
                 f"one first" for d in needs if d.surge and not report.surge_fits.get(d.name, True)]
    return None, warnings


def cluster_nodes() -> tuple[list[Bundle], str] | None:
    """The nodes' total resources and where they come from: the cluster Ray is connected to,
    else the one ``serve run`` starts on this machine; None when it will connect elsewhere
    (``RAY_ADDRESS`` or ``--address``) and cannot be read yet."""
    import ray

    if ray.is_initialized():
        nodes = [{k: float(v) for k, v in n["Resources"].items() if k not in IGNORED and not k.startswith("node:")}
                 for n in ray.nodes() if n.get("Alive")]
        return nodes, "the connected cluster"
    if os.environ.get("RAY_ADDRESS") or any(a in ("--address", "-a") or a.startswith("--address=") for a in sys.argv):
        return None
    from ray._private.utils import get_num_cpus

    return [{"CPU": float(get_num_cpus())}], "the local cluster serve run starts on this machine"


def check_app_fits(app, settings: str, nodes: list[Bundle] | None = None) -> list[str]:
    """Raise :class:`AppDoesNotFit` if ``app`` cannot be placed at its minimum on ``nodes``
    (default: :func:`cluster_nodes`); log and return the warnings otherwise."""
    where = "the given nodes"
    if nodes is None:
        found = cluster_nodes()
        if found is None:
            log.info("resource check skipped: the cluster is not reachable before serve run connects")
            return []
        nodes, where = found
    needs = deployment_needs(app)
    error, warnings = describe(fit(needs, nodes), needs, settings)
    if error:
        raise AppDoesNotFit(f"{error} (checked against {where})")
    for w in warnings:
        log.warning("%s (%s)", w, where)
    return warnings
