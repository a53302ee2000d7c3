"""What a local stack is (cluster/stack.py starts and stops it): its state directory
(``stack.json`` under a lock, written atomically), its ports, the environment its processes
and your shell get (``stack.env``), the Ray token, and the small helpers the other stack
modules share.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import os
import shlex
import socket
import sys
from pathlib import Path

MARKER_ENV = "DFLASH_STACK_ID"  # every process the stack starts carries it
STATE_FILE, ENV_FILE, LOCK_FILE = "stack.json", "stack.env", ".lock"
DEFAULT_STATE_DIR = "runs/stack"
DEFAULT_BUCKET = "dflash"
DEFAULT_PORTS = {"ray": 6379, "dashboard": 8265, "client": 10001, "agent": 52365,
                 "mlflow": 5000, "s3": 9000}
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                  "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}


class StackError(RuntimeError):
    """A failure with a message for the user (no traceback)."""


def utc_now() -> str:
    """Now, local time, ISO 8601 to the second."""
    return _dt.datetime.now().isoformat(timespec="seconds")


def free_port(taken: set[int]) -> int:
    """A free port on 127.0.0.1 that is not in ``taken``."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            taken.add(port)
            return port


def port_busy(port: int) -> bool:
    """Whether something listens on ``port`` (127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def log_tail(path: Path, n: int = 25) -> str:
    """The last ``n`` lines of a log, for an error message."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in lines[-n:])


def bin_dir() -> str:
    """This interpreter's bin directory: the ``ray``, ``mlflow`` and ``python`` the stack runs."""
    # The directory of *this* interpreter (a venv's bin, not the symlink target), so that
    # `python` in a job's entrypoint is the interpreter that has the project installed.
    return os.path.dirname(os.path.abspath(sys.executable))


def ray_token() -> str | None:
    """The token ``ray job submit`` would send (same lookup order as Ray)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    for path in (os.environ.get("RAY_AUTH_TOKEN_PATH"), Path.home() / ".ray" / "auth_token"):
        if path and Path(path).is_file():
            token = Path(path).read_text().strip()
            if token:
                return token
    return None


def auth_headers(state: dict) -> dict:
    """The Ray token header for the dashboard's API, when the stack's Ray has token auth."""
    if not state["ray"].get("auth"):
        return {}
    token = ray_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


@contextlib.contextmanager
def locked(state_dir: Path):
    """The state directory's lock, held while a command reads and writes ``stack.json``."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / LOCK_FILE, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another `cluster.stack` command on {state_dir} ...", file=sys.stderr)
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def load_state(state_dir: Path) -> dict | None:
    try:
        return json.loads((state_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def save_state(state: dict) -> None:
    """Write ``stack.json`` atomically (a temp file, then a rename)."""
    path = Path(state["state_dir"]) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


def stack_env(state: dict) -> dict[str, str]:
    """The settings a shell (and every job on the head) needs to use the stack."""
    r = state["ray"]
    env = {
        # GCS address: ray.init(), `serve run`, `ray status` join the stack with it.
        "RAY_ADDRESS": r["gcs_address"],
        # Jobs API: `ray job submit/status/logs` (takes precedence over RAY_ADDRESS).
        "RAY_API_SERVER_ADDRESS": r["dashboard_url"],
        # `serve deploy/status` (dashboard).
        "RAY_DASHBOARD_ADDRESS": r["dashboard_url"],
    }
    if r.get("auth"):
        env["RAY_AUTH_MODE"] = "token"
    env.update(head_env(state))
    return env


def head_env(state: dict) -> dict[str, str]:
    """What the Ray head (hence every job) gets: the stack's settings except the Ray
    addresses, which Ray sets for its own processes."""
    env = {"MLFLOW_TRACKING_URI": state["mlflow"]["url"]}
    if state.get("s3"):
        s3 = state["s3"]
        env.update({"AWS_ENDPOINT_URL": s3["endpoint"], "AWS_ENDPOINT_URL_S3": s3["endpoint"],
                    **S3_CREDENTIALS, "DFLASH_S3_BUCKET": s3["bucket"], "DFLASH_STORAGE": f"s3://{s3['bucket']}"})
    return env


def write_env_file(state: dict) -> Path:
    """Write ``stack.env`` (what ``source`` gives your shell); returns its path."""
    path = Path(state["state_dir"]) / ENV_FILE
    lines = [f"# Written by `python -m cluster.stack up` at {state['started_at']}; removed by `down`.",
             f"# Use it with:  source {path}", ""]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in stack_env(state).items()]
    path.write_text("\n".join(lines) + "\n")
    return path
