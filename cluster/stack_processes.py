"""The processes of a local stack: finding exactly the ones it started (by the marker in their
environment and the pids it recorded; never another Ray on the machine), stopping them
(terminate, then kill past a grace period), and whether each component answers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from cluster.stack_state import MARKER_ENV, StackError, auth_headers, log_tail


def http_request(url: str, method: str = "GET", headers: dict | None = None, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body); status 0 when nothing answers."""
    req = urllib.request.Request(url, method=method, headers=headers or {})
    if method == "PUT":
        req.data = b""
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(4096).decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(4096).decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        return 0, ""


def stack_processes(state: dict) -> list:
    """Every live process that belongs to this stack: processes carrying its marker in
    their environment, Ray processes started with its temp dir, the recorded server pids,
    and all their descendants (Ray workers rename themselves, which hides their
    environment, but they stay children of the raylet)."""
    import psutil

    marker, temp_dir = state["id"], state["ray"]["temp_dir"]
    spec = importlib.util.find_spec("ray")
    ray_dir = os.path.dirname(spec.origin) if spec and spec.origin else None
    python = os.path.realpath(sys.executable)
    own = {os.getpid(), os.getppid()}
    found: dict[int, object] = {}
    for p in psutil.process_iter(["pid", "cmdline", "exe"]):
        if p.pid in own:
            continue
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            env = {}
        hit = env.get(MARKER_ENV) == marker
        if not hit:
            cmd = " ".join(p.info["cmdline"] or [])
            exe = p.info["exe"] or ""
            ours = exe == python or (ray_dir is not None and exe.startswith(ray_dir))
            hit = ours and (f"{temp_dir}/session_" in cmd or f"temp-dir={temp_dir}" in cmd
                            or f"temp_dir={temp_dir}" in cmd)
        if hit:
            found[p.pid] = p
    for comp in ("mlflow", "s3"):
        pid = (state.get(comp) or {}).get("pid")
        if pid and pid not in found:
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if _started_by_us(p, state):
                    found[pid] = p
    for p in list(found.values()):
        with contextlib.suppress(psutil.Error):
            for c in p.children(recursive=True):
                if c.pid not in own:
                    found.setdefault(c.pid, c)
    return [p for p in found.values() if _running(p)]


def _started_by_us(p, state: dict) -> bool:
    """A recorded pid is ours only if it was created after the stack (pid reuse)."""
    try:
        return p.create_time() >= state.get("created_unix", 0) - 1
    except Exception:
        return False


def component_pids(state: dict) -> dict[str, list[int]]:
    """Live pids per component (ray, mlflow, s3)."""
    import psutil

    procs = stack_processes(state)
    out: dict[str, list[int]] = {"ray": [], "mlflow": [], "s3": []}
    roots = {comp: (state.get(comp) or {}).get("pid") for comp in ("mlflow", "s3")}
    tree: dict[int, str] = {}
    for comp, pid in roots.items():
        if pid:
            tree[pid] = comp
            with contextlib.suppress(psutil.Error):
                for c in psutil.Process(pid).children(recursive=True):
                    tree[c.pid] = comp
    for p in procs:
        out[tree.get(p.pid, "ray")].append(p.pid)
    return out


def terminate(procs: list, grace_s: float = 10.0) -> list:
    """SIGTERM, wait, SIGKILL what is left; returns the processes still alive."""
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs(alive, timeout=5.0)
    return [p for p in alive if _running(p)]


def _running(p) -> bool:
    """Alive and not a zombie (an exited process whose parent has not reaped it yet)."""
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_all(state: dict, grace_s: float = 10.0) -> tuple[int, list[int]]:
    """Stop every process of the stack; rescans (a dying raylet may still spawn).
    Returns (number stopped, pids that survived)."""
    stopped, seen = 0, set()
    for _ in range(4):
        procs = stack_processes(state)
        if not procs:
            return stopped, []
        seen.update(p.pid for p in procs)
        alive = terminate(procs, grace_s)
        stopped = len(seen)
        if alive:
            time.sleep(1.0)
    left = stack_processes(state)
    return stopped, sorted(p.pid for p in left)


def health(state: dict) -> dict[str, dict]:
    """Per component: {"up": bool, "detail": str}."""
    out: dict[str, dict] = {}
    r = state["ray"]
    code, _ = http_request(r["dashboard_url"] + "/api/gcs_healthz", timeout=3)
    if code == 200:
        code2, _ = http_request(r["dashboard_url"] + "/api/version", headers=auth_headers(state), timeout=3)
        out["ray"] = {"up": code2 == 200, "detail": "" if code2 == 200 else f"job API answered {code2}"}
    else:
        out["ray"] = {"up": False, "detail": "dashboard does not answer" if code == 0 else f"GCS health {code}"}
    m = state["mlflow"]
    code, _ = http_request(m["url"] + "/health", timeout=3)
    out["mlflow"] = {"up": code == 200, "detail": "" if code == 200 else ("no answer" if code == 0 else f"HTTP {code}")}
    if state.get("s3"):
        code, _ = http_request(state["s3"]["endpoint"] + "/", timeout=3)
        out["s3"] = {"up": code == 200, "detail": "" if code == 200 else ("no answer" if code == 0 else f"HTTP {code}")}
    return out


def wait_until(what: str, check, timeout_s: float, proc=None, log: Path | None = None) -> None:
    """Poll ``check()`` until it holds; ``StackError`` naming ``what`` (and the log's tail)
    when ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if proc is not None and proc.poll() is not None:
            raise StackError(f"{what} exited with code {proc.returncode} while starting; "
                             f"last lines of {log}:\n{log_tail(log) if log else ''}")
        time.sleep(0.5)
    raise StackError(f"{what} did not answer within {timeout_s:.0f} s"
                     + (f"; last lines of {log}:\n{log_tail(log)}" if log else ""))
