"""The demo's processes: a port that is free, a pid that is alive, a URL that answers, and
:func:`stop` (``make demo-stop``), which ends the served apps and the stack a demo left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from harness.demo_console import say

ROOT = Path(__file__).resolve().parents[1]
STATE = "demo.json"


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET, with the API key when one is set; (0, "") when nothing answers."""
    headers = {}
    if os.environ.get("DFLASH_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['DFLASH_API_KEY']}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (urllib.error.URLError, OSError, ValueError):
        return 0, ""


def port_or_free(port: int) -> int:
    """``port`` if nothing listens there, else a free one."""
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop(out: Path | str = "runs/demo", grace_s: float = 20.0) -> int:
    """``make demo-stop``: end ``serve run`` and the stack; check no process is left."""
    import psutil

    out = Path(out) if Path(out).is_absolute() else ROOT / out
    state = json.loads((out / STATE).read_text()) if (out / STATE).is_file() else {}
    pid = state.get("serving", {}).get("pid")
    left = []
    if pid and alive(pid):
        say(f"stopping serve run (pid {pid})")
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
            os.killpg(pid, signal.SIGINT)  # what Ctrl-C does: serve run shuts the apps down
            _, left = psutil.wait_procs(procs, timeout=grace_s)
            for p in left:
                p.kill()
            _, left = psutil.wait_procs(left, timeout=5)
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
    state.get("serving", {}).pop("pid", None)
    if (out / STATE).is_file():
        (out / STATE).write_text(json.dumps(state, indent=1, default=str))
    rc = subprocess.run([sys.executable, "-m", "cluster.stack", "--state-dir", str(out / "stack"), "down"],
                        cwd=ROOT).returncode
    if left:
        say(f"still running: {[p.pid for p in left]}")
        return 1
    return rc
