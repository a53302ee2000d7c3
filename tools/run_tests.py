"""Run the test suite within its budget and show where the minutes go.

    python tools/run_tests.py                  # the whole suite, 2 lanes (what `make test` runs)
    python tools/run_tests.py --quick          # the unit tier only: no Ray, no servers (a few minutes)
    python tools/run_tests.py tests/test_train.py tests/test_engine.py   # some modules
    python tools/run_tests.py --jobs 1 -- -x   # one lane; arguments after -- go to pytest

Modules marked ``pytestmark = pytest.mark.unit`` (no Ray, no server) share one
pytest process; every other module gets a process of its own, since Ray, Serve and MLflow keep
process-wide state. Processes run in ``--jobs`` lanes, longest first by the seconds recorded in
``tests/module_seconds.json`` (``--record`` rewrites it from this run). Each module's seconds are
printed, then the total against the budget: a WARNING line past ``--budget-min`` (25) or for a
module past ``--module-max-s`` (180), so a change sees it before CI does. The last line is
``N passed, N failed``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECONDS_FILE = ROOT / "tests" / "module_seconds.json"
UNIT_MARK = re.compile(r"^pytestmark\s*=.*pytest\.mark\.unit\b", re.M)
UNIT_BATCH = "unit tier"
COUNTS = {"passed": r"(\d+) passed", "failed": r"(\d+) failed", "errors": r"(\d+) errors?\b",
          "skipped": r"(\d+) skipped"}


@dataclass
class Batch:
    """One pytest process: a module, or the unit tier's modules together."""
    name: str
    modules: list[str]
    weight: float
    seconds: float = 0.0
    returncode: int = 0
    counts: dict = field(default_factory=dict)
    output: str = ""


def is_unit(module: Path) -> bool:
    return bool(UNIT_MARK.search(module.read_text()))


def plan_batches(modules: list[Path], recorded: dict[str, float], quick: bool) -> list[Batch]:
    """The unit modules as one batch, every other module alone; heaviest first."""
    units = [m for m in modules if is_unit(m)]
    others = [] if quick else [m for m in modules if m not in units]
    rel = lambda m: str(m.relative_to(ROOT)) if m.is_absolute() else str(m)  # noqa: E731
    batches = [Batch(rel(m), [rel(m)], recorded.get(rel(m), 60.0)) for m in others]
    if units:
        batches.append(Batch(UNIT_BATCH, [rel(m) for m in units], sum(recorded.get(rel(m), 10.0) for m in units)))
    return sorted(batches, key=lambda b: -b.weight)


def lane_env(lane: int) -> dict[str, str]:
    """Each lane's Ray keeps its sessions and its "current cluster" file in a folder of its own:
    a bare ``ray.init()`` in one lane never joins the cluster another lane started."""
    ray_tmp = Path(os.environ.get("DFLASH_TEST_TMP", "/tmp")) / f"dflash-lane{lane}"
    ray_tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_TMPDIR": str(ray_tmp)}


def run_batch(batch: Batch, pytest_args: list[str], lock: threading.Lock, lane: int) -> None:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", *batch.modules, *pytest_args], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=lane_env(lane))
    batch.seconds, batch.returncode, batch.output = time.monotonic() - t0, proc.returncode, proc.stdout
    tail = next((ln for ln in reversed(proc.stdout.strip().splitlines()) if re.search(r"\d+ (passed|failed|error|"
                                                                                        r"skipped|deselected)", ln)), "")
    batch.counts = {k: int(m.group(1)) if (m := re.search(p, tail)) else 0 for k, p in COUNTS.items()}
    with lock:  # one batch's output at a time, whole
        print(f"\n##### {batch.name} ({batch.seconds:.0f} s)\n{proc.stdout}", flush=True)


def run_lanes(batches: list[Batch], jobs: int, pytest_args: list[str]) -> None:
    """``jobs`` worker threads take the next batch from the heaviest-first queue."""
    queue, lock = list(batches), threading.Lock()

    def lane(number: int):
        while True:
            with lock:
                if not queue:
                    return
                batch = queue.pop(0)
            run_batch(batch, pytest_args, lock, number)

    threads = [threading.Thread(target=lane, args=(n,)) for n in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def report(batches: list[Batch], wall: float, budget_min: float, module_max_s: float, jobs: int) -> None:
    """Print each batch's seconds and the budget lines."""
    print(f"\n{'seconds':>8}  module")
    for b in sorted(batches, key=lambda b: -b.seconds):
        flag = "  FAILED" if b.returncode not in (0, 5) else ""
        print(f"{b.seconds:8.0f}  {b.name}{' (' + str(len(b.modules)) + ' modules)' if len(b.modules) > 1 else ''}{flag}")
    busy = sum(b.seconds for b in batches)
    print(f"{busy:8.0f}  process seconds in {jobs} lane(s); wall {wall:.0f} s = {wall / 60:.1f} min "
          f"of a {budget_min:.0f}-minute budget")
    warnings = [f"WARNING: the suite took {wall / 60:.1f} min, over its {budget_min:.0f}-minute budget"] \
        if wall > budget_min * 60 else []
    warnings += [f"WARNING: {b.name} took {b.seconds:.0f} s, over the {module_max_s:.0f} s a module may take"
                 for b in batches if len(b.modules) == 1 and b.seconds > module_max_s]
    for w in warnings:
        print(w)


def record(batches: list[Batch]) -> None:
    """Module seconds for the next run's ordering (the unit tier split evenly: it runs as one)."""
    data = json.loads(SECONDS_FILE.read_text()) if SECONDS_FILE.exists() else {}
    for b in batches:
        for m in b.modules:
            data[m] = round(b.seconds / len(b.modules), 1)
    SECONDS_FILE.write_text(json.dumps(dict(sorted(data.items())), indent=1) + "\n")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, theirs = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("modules", nargs="*", help="test modules (default: tests/test_*.py)")
    p.add_argument("--jobs", type=int, default=int(os.environ.get("DFLASH_TEST_JOBS", "2")),
                   help="pytest processes at once (default 2, or $DFLASH_TEST_JOBS)")
    p.add_argument("--quick", action="store_true", help="only the unit tier (modules marked pytest.mark.unit)")
    p.add_argument("--budget-min", type=float, default=25.0)
    p.add_argument("--module-max-s", type=float, default=180.0)
    p.add_argument("--record", action="store_true", help=f"write the seconds to {SECONDS_FILE.relative_to(ROOT)}")
    args, unknown = p.parse_known_args(ours)
    return args, unknown + theirs  # unknown options (e.g. -q, --durations=25) go to pytest too


def main(argv: list[str]) -> int:
    args, pytest_args = parse(argv)
    modules = [Path(m) for m in args.modules] or sorted((ROOT / "tests").glob("test_*.py"))
    recorded = json.loads(SECONDS_FILE.read_text()) if SECONDS_FILE.exists() else {}
    batches = plan_batches(modules, recorded, args.quick)
    print(f"{sum(len(b.modules) for b in batches)} modules in {len(batches)} processes, {args.jobs} at a time",
          flush=True)
    t0 = time.monotonic()
    run_lanes(batches, args.jobs, pytest_args)
    report(batches, time.monotonic() - t0, args.budget_min, args.module_max_s, args.jobs)
    if args.record:
        record(batches)
    failed_batches = [b.name for b in batches if b.returncode not in (0, 5)]
    totals = {k: sum(b.counts.get(k, 0) for b in batches) for k in COUNTS}
    failed = totals["failed"] + totals["errors"]
    failed = failed or len(failed_batches)  # a process that died without a summary still counts
    print(f"processes with failures: {', '.join(failed_batches) or 'none'}")
    line = f"{totals['passed']} passed, {failed} failed"
    print(line + (f", {totals['skipped']} skipped" if totals["skipped"] else ""))
    return 1 if failed_batches or totals["passed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
