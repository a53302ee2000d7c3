"""The local stack: a Ray head with its dashboard (for ``ray job submit``), an MLflow
server and, with ``--s3``, a local S3 API (moto) -- the cluster path on one machine.

    python -m cluster.stack up [--s3] [--state-dir runs/stack] [--default-ports] [--num-cpus N]
    source runs/stack/stack.env            # RAY_ADDRESS, MLFLOW_TRACKING_URI, AWS_* ...
    ray job submit --working-dir . -- python jobs/generate_features.py --config configs/smollm2-135m.yaml
    python -m cluster.stack status [--json]
    python -m cluster.stack down

What ``up`` starts, all on 127.0.0.1 where the program lets us choose:

* Ray head: ``ray start --head`` with its own temp dir under the state dir (so a plain
  ``ray.init()`` elsewhere on the machine never joins it by accident), dashboard and job
  API on 127.0.0.1, token authentication on. Ray's internal gRPC ports (GCS, raylet,
  object manager) listen on the node's address: Ray offers no loopback-only mode; the
  token is what guards them.
* MLflow: ``mlflow server`` with a sqlite backend store (``<state>/mlflow.db``) and
  proxied artifacts in ``<state>/mlartifacts`` (clients upload through the server, so
  job workers need no shared file system). Both survive ``down``/``up``.
* S3 (``--s3``): moto's server with one bucket (in memory: gone after ``down``).

The Ray head is started with MLFLOW_TRACKING_URI (and the AWS_* settings with ``--s3``)
in its environment, so every job submitted to it sees them without further flags.
``<state>/stack.env`` holds the same settings for your shell; ``<state>/stack.json``
records what runs. ``down`` stops exactly the processes this stack started (never
``ray stop``, which would kill every Ray on the machine) and checks that none is left.

Exit codes: 0 ok; 1 failed (the message says why); ``status``: 3 when the stack is not
running or a component does not answer.

This file is the commands (``up``'s start sequence, ``down``, ``status``, ``env``, the CLI);
what a stack is (state, ports, environment) is ``stack_state.py``'s, its processes and health
``stack_processes.py``'s. Just over 400 lines as one room: ``up`` is one sequence (ports, Ray
head, MLflow, S3, waiting, rolling back a failed start) read top to bottom.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path

from cluster.stack_processes import component_pids, health, http_request, stack_processes, stop_all, wait_until
from cluster.stack_state import (DEFAULT_BUCKET, DEFAULT_PORTS, DEFAULT_STATE_DIR, ENV_FILE, MARKER_ENV, STATE_FILE,
                                 StackError, auth_headers, bin_dir, free_port, head_env, load_state, locked,
                                 log_tail, port_busy, ray_token, save_state, stack_env, utc_now, write_env_file)

# Ray puts unix sockets under <temp>/session_<date>_<pid>/sockets/...; paths over 107
# bytes do not work, so a long state dir gets its Ray temp dir under /tmp instead.
_MAX_RAY_TEMP_LEN = 40  # plasma socket paths past ~107 bytes make `ray start` fail
_PORT_TAKEN = 75  # internal: start failed because a port was taken (retried once)


def _choose_ports(args) -> dict[str, int]:
    explicit = {"ray": args.ray_port, "dashboard": args.dashboard_port, "mlflow": args.mlflow_port,
                "s3": args.s3_port}
    ports: dict[str, int] = {}
    taken = {p for p in explicit.values() if p}
    for name in ("ray", "dashboard", "client", "agent", "mlflow", "s3"):
        if explicit.get(name):
            ports[name] = explicit[name]
        elif args.default_ports:
            ports[name] = DEFAULT_PORTS[name]
        else:
            ports[name] = free_port(taken)
    if not args.s3:
        ports.pop("s3")
    busy = [f"{name} {port}" for name, port in ports.items() if port_busy(port)]
    if busy:
        raise StackError("port(s) already in use: " + ", ".join(busy)
                         + " (drop --default-ports to use free ports, or choose others)")
    return ports


def _ray_temp_dir(state_dir: Path) -> Path:
    candidate = state_dir / "ray"
    if len(str(candidate)) <= _MAX_RAY_TEMP_LEN:
        return candidate
    digest = hashlib.sha1(str(state_dir).encode()).hexdigest()[:10]
    return Path("/tmp") / f"dflash-stack-{digest}"


def _ensure_token(env: dict) -> bool:
    """Token auth unless the user disabled it; creates ~/.ray/auth_token if missing."""
    if env.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return False
    if ray_token() is None:
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"],
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=120)
    env["RAY_AUTH_MODE"] = "token"
    return True


def up(args) -> int:
    state_dir = Path(args.state_dir).absolute()
    with locked(state_dir):
        old = load_state(state_dir)
        if old is not None:
            h = health(old)
            for _ in range(3):  # a busy machine answers slowly: ask again before judging
                if all(c["up"] for c in h.values()):
                    break
                time.sleep(3.0)
                h = health(old)
            if all(c["up"] for c in h.values()):
                print(f"already running (state in {state_dir}):")
                _print_summary(old, h)
                if args.s3 and not old.get("s3"):
                    print("note: running without --s3; `down` then `up --s3` to add the S3 API")
                return 0
            down_parts = ", ".join(k for k, c in h.items() if not c["up"])
            if stack_processes(old):
                raise StackError(f"the stack in {state_dir} runs, but {down_parts} does not answer (see "
                                 f"`status` and {state_dir / 'logs'}); `down`, then `up` to restart it")
            print(f"found a stale stack in {state_dir} (its processes are gone); starting a new one")
            _stop(old, args.grace)
        pinned = args.default_ports or any((args.ray_port, args.dashboard_port, args.mlflow_port, args.s3_port))
        rc = _start(args, state_dir)
        if rc == _PORT_TAKEN and not pinned:
            # A free port picked at start-up can be taken by another program before the
            # component binds it (busy machines, Ray workers binding random ports).
            print("a port was taken by another program while starting; retrying with other free ports",
                  file=sys.stderr)
            rc = _start(args, state_dir)
        return 1 if rc == _PORT_TAKEN else rc


def _start(args, state_dir: Path) -> int:
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ports = _choose_ports(args)
    temp_dir = _ray_temp_dir(state_dir)
    temp_dir.mkdir(parents=True, exist_ok=True)
    state = _new_state(args, state_dir, ports, temp_dir)
    base = _base_env(state["id"])
    try:
        state["ray"]["auth"] = _ensure_token(base)
        save_state(state)  # from here on, `down` can clean up whatever got started

        # MLflow and S3 first: their addresses go into the Ray head's environment.
        mlflow_log = logs / "mlflow.log"
        mlflow_proc = _start_mlflow(state, base, mlflow_log, ports["mlflow"])
        s3_proc = s3_log = None
        if args.s3:
            s3_log = logs / "s3.log"
            s3_proc = _spawn([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(ports["s3"])],
                             base, state_dir, s3_log)
            state["s3"]["pid"] = s3_proc.pid
        save_state(state)

        _start_ray_head(args, state, {**base, **head_env(state)}, logs / "ray-start.log", ports, temp_dir)
        _wait_until_answering(args, state, (mlflow_proc, mlflow_log), (s3_proc, s3_log), temp_dir)
    except BaseException as e:
        rc = _stop_after_failed_start(e, state, state_dir, args.grace)
        if rc is None:
            raise
        return rc
    state["status"] = "running"
    save_state(state)
    env_path = write_env_file(state)
    print(f"stack is up (state in {state_dir})")
    _print_summary(state, health(state))
    print(f"\n  source {_rel(env_path)}\n  ray job submit --working-dir . -- python jobs/generate_features.py "
          f"--config configs/smollm2-135m.yaml\n  python -m cluster.stack down")
    return 0


def _new_state(args, state_dir: Path, ports: dict[str, int], temp_dir: Path) -> dict:
    """The state record of a stack about to start (``stack.json``): addresses, no pids yet."""
    return {
        "version": 1, "id": uuid.uuid4().hex, "state_dir": str(state_dir), "started_at": utc_now(),
        "created_unix": time.time(), "python": sys.executable, "status": "starting",
        "ray": {"port": ports["ray"], "dashboard_url": f"http://127.0.0.1:{ports['dashboard']}",
                "temp_dir": str(temp_dir), "gcs_address": None, "num_cpus": args.num_cpus,
                "auth": False},
        "mlflow": {"url": f"http://127.0.0.1:{ports['mlflow']}", "pid": None,
                   "backend_store": f"sqlite:///{state_dir / 'mlflow.db'}",
                   "artifacts": str(state_dir / "mlartifacts")},
        "s3": ({"endpoint": f"http://127.0.0.1:{ports['s3']}", "pid": None, "bucket": args.bucket}
               if args.s3 else None),
    }


def _base_env(stack_id: str) -> dict[str, str]:
    """The environment of every process the stack starts: ours without another stack's or
    cluster's addresses, the venv's bin first, and the marker that finds them again."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_DASHBOARD_ADDRESS", MARKER_ENV)}
    base["PATH"] = bin_dir() + os.pathsep + base.get("PATH", "")
    base[MARKER_ENV] = stack_id
    base.setdefault("PYTHONUNBUFFERED", "1")
    return base


def _spawn(cmd: list[str], env: dict, cwd: Path, log: Path) -> subprocess.Popen:
    """A detached server process (its own session) writing to ``log``."""
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _start_mlflow(state: dict, base: dict, log: Path, port: int) -> subprocess.Popen:
    """``mlflow server`` on the stack's sqlite store, serving the artifacts it stores."""
    m = state["mlflow"]
    Path(m["artifacts"]).mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", m["backend_store"],
           "--artifacts-destination", m["artifacts"], "--serve-artifacts",
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    # MLflow's job runner (GenAI evaluation jobs, unused here) would start 7 more Python
    # processes of ~270 MB each at every start: off unless asked for
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **base}
    proc = _spawn(cmd, env, Path(state["state_dir"]), log)
    m["pid"] = proc.pid
    return proc


def _start_ray_head(args, state: dict, env: dict, log: Path, ports: dict[str, int], temp_dir: Path) -> None:
    """``ray start --head`` (it returns once the head runs; its processes detach), then the
    GCS address it writes into the state."""
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head",
           "--port", str(ports["ray"]),
           "--dashboard-host", "127.0.0.1", "--dashboard-port", str(ports["dashboard"]),
           "--include-dashboard", "true",
           "--ray-client-server-port", str(ports["client"]),
           "--dashboard-agent-listen-port", str(ports["agent"]),
           "--temp-dir", str(temp_dir), "--disable-usage-stats", "--log-style", "record"]
    if args.num_cpus is not None:
        cmd += ["--num-cpus", str(args.num_cpus)]
    if args.object_store_memory:
        cmd += ["--object-store-memory", str(int(args.object_store_memory * (1 << 20)))]
    with open(log, "wb") as fh:
        try:
            rc = subprocess.run(cmd, env=env, cwd=args.workdir, stdin=subprocess.DEVNULL,
                                stdout=fh, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            raise StackError(f"`ray start --head` did not return within {args.timeout:.0f} s; "
                             f"last lines of {log}:\n{log_tail(log)}") from None
    if rc != 0:
        raise StackError(f"`ray start --head` failed (exit {rc}); last lines of {log}:\n{log_tail(log)}")
    addr_file = temp_dir / "ray_current_cluster"
    wait_until("Ray head (GCS address file)", addr_file.is_file, 30)
    state["ray"]["gcs_address"] = addr_file.read_text().strip()
    save_state(state)


def _wait_until_answering(args, state: dict, mlflow: tuple, s3: tuple, temp_dir: Path) -> None:
    """Wait (``args.timeout`` in all) for MLflow, S3 (creating the bucket) and the Ray
    dashboard and job API to answer; ``mlflow`` and ``s3`` are (process, log)."""
    deadline = time.monotonic() + args.timeout
    left = lambda: max(5.0, deadline - time.monotonic())  # noqa: E731
    mlflow_proc, mlflow_log = mlflow
    wait_until("MLflow server", lambda: http_request(state["mlflow"]["url"] + "/health", timeout=2)[0] == 200,
          left(), mlflow_proc, mlflow_log)
    s3_proc, s3_log = s3
    if s3_proc is not None:
        endpoint = state["s3"]["endpoint"]
        wait_until("S3 API (moto)", lambda: http_request(endpoint + "/", timeout=2)[0] == 200, left(), s3_proc, s3_log)
        code, body = http_request(f"{endpoint}/{args.bucket}", method="PUT", timeout=10)
        if code not in (200, 409):
            raise StackError(f"could not create bucket {args.bucket!r}: HTTP {code} {body[:200]}")
    dash = state["ray"]["dashboard_url"]
    headers = auth_headers(state)
    wait_until("Ray dashboard", lambda: http_request(dash + "/api/gcs_healthz", timeout=2)[0] == 200, left(),
          log=temp_dir / "session_latest" / "logs" / "dashboard.log")
    wait_until("Ray job API", lambda: http_request(dash + "/api/jobs/", headers=headers, timeout=3)[0] == 200, left(),
          log=temp_dir / "session_latest" / "logs" / "dashboard_JobHead.log")


def _stop_after_failed_start(e: BaseException, state: dict, state_dir: Path, grace_s: float) -> int | None:
    """Say why starting failed and stop what was started; the exit code, or None when
    ``e`` is not a failure to report (the caller re-raises it)."""
    print(f"error: {e if isinstance(e, StackError) else repr(e)}", file=sys.stderr)
    print("stopping what was started ...", file=sys.stderr)
    _, left_pids = stop_all(state, grace_s)
    if left_pids:
        print(f"warning: processes still alive: {left_pids}", file=sys.stderr)
    else:
        (state_dir / STATE_FILE).unlink(missing_ok=True)
    if isinstance(e, StackError) and "in use" in str(e).lower():
        return _PORT_TAKEN
    if isinstance(e, (StackError, subprocess.TimeoutExpired)):
        return 1
    return None


def _rel(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)


def _print_summary(state: dict, h: dict) -> None:
    def mark(name):
        c = h.get(name, {"up": False, "detail": "not checked"})
        return "up  " if c["up"] else f"DOWN ({c['detail']})"

    r, m = state["ray"], state["mlflow"]
    print(f"  ray     {mark('ray')}  dashboard/jobs {r['dashboard_url']}   gcs {r['gcs_address']}")
    print(f"  mlflow  {mark('mlflow')}  {m['url']}   store {m['backend_store']}, artifacts {m['artifacts']}")
    if state.get("s3"):
        s = state["s3"]
        print(f"  s3      {mark('s3')}  {s['endpoint']}   bucket s3://{s['bucket']} (in memory)")


def _stop(state: dict, grace_s: float) -> tuple[int, list[int]]:
    stopped, left = stop_all(state, grace_s)
    state_dir = Path(state["state_dir"])
    if not left:
        (state_dir / STATE_FILE).unlink(missing_ok=True)
        (state_dir / ENV_FILE).unlink(missing_ok=True)
    return stopped, left


def down(args) -> int:
    state_dir = Path(args.state_dir).absolute()
    with locked(state_dir):
        state = load_state(state_dir)
        if state is None:
            print(f"not running (no {STATE_FILE} in {state_dir})")
            return 0
        stopped, left = _stop(state, args.grace)
        if left:
            print(f"error: {len(left)} process(es) of the stack survived SIGKILL: {left}", file=sys.stderr)
            return 1
        print(f"stopped {stopped} process(es); no process of the stack is left "
              f"(MLflow data kept in {state_dir})")
        return 0


def status(args) -> int:
    state_dir = Path(args.state_dir).absolute()
    state = load_state(state_dir)
    if state is None:
        if args.json:
            print(json.dumps({"running": False, "state_dir": str(state_dir)}))
        else:
            print(f"not running (no {STATE_FILE} in {state_dir})")
        return 3
    h = health(state)
    pids = component_pids(state)
    ok = all(c["up"] for c in h.values())
    if args.json:
        print(json.dumps({"running": ok, "state_dir": str(state_dir), "components": h, "pids": pids,
                          "env": stack_env(state), "state": state}, indent=1))
    else:
        print(f"stack {'running' if ok else 'DEGRADED'} (state in {state_dir}, started {state['started_at']})")
        _print_summary(state, h)
        print("  processes: " + ", ".join(f"{k} {len(v)}" for k, v in pids.items() if k != "s3" or state.get("s3")))
        env_path = state_dir / ENV_FILE
        if env_path.is_file():
            print(f"  env: source {_rel(env_path)}")
    return 0 if ok else 3


def env_cmd(args) -> int:
    state = load_state(Path(args.state_dir).absolute())
    if state is None:
        print(f"not running (no {STATE_FILE} in {Path(args.state_dir).absolute()})", file=sys.stderr)
        return 3
    for k, v in stack_env(state).items():
        print(f"export {k}={shlex.quote(v)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster.stack",
                                 description="Local stack: Ray head + dashboard, MLflow server, optional S3 API.")
    ap.add_argument("--state-dir", default=os.environ.get("DFLASH_STACK_DIR", DEFAULT_STATE_DIR),
                    help="where state, logs, mlflow.db and stack.env live (default: %(default)s)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start the stack (says so if it already runs)")
    u.add_argument("--s3", action="store_true", help="also start a local S3 API (moto) with one bucket")
    u.add_argument("--bucket", default=DEFAULT_BUCKET, help="bucket to create with --s3 (default: %(default)s)")
    u.add_argument("--default-ports", action="store_true",
                   help="use Ray's and MLflow's usual ports (6379, 8265, 10001, 52365; MLflow 5000; S3 9000) "
                        "instead of free ones")
    u.add_argument("--ray-port", type=int, help="GCS port")
    u.add_argument("--dashboard-port", type=int, help="dashboard / job API port")
    u.add_argument("--mlflow-port", type=int)
    u.add_argument("--s3-port", type=int)
    u.add_argument("--num-cpus", type=int, default=None, help="CPUs the head offers (default: all)")
    u.add_argument("--object-store-memory", type=float, default=None, metavar="MB",
                   help="object store size in MB (default: Ray's, 30%% of memory)")
    u.add_argument("--workdir", default=os.getcwd(),
                   help="working directory of the Ray head: jobs submitted without --working-dir run here "
                        "(default: the current directory)")
    u.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for everything to answer")
    u.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL on failure")
    d = sub.add_parser("down", help="stop everything the stack started and check nothing is left")
    d.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    s = sub.add_parser("status", help="show each component (exit 3 if not running or degraded)")
    s.add_argument("--json", action="store_true")
    e = sub.add_parser("env", help="print the stack's settings as shell exports: eval \"$(python -m cluster.stack env)\"")
    for p in (u, d, s, e):  # `--state-dir` also after the command
        p.add_argument("--state-dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        return {"up": up, "down": down, "status": status, "env": env_cmd}[args.cmd](args)
    except StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
