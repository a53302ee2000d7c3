"""Run each test module in its own pytest process (Ray, Serve and MLflow keep process-wide
state; a fresh process per module keeps modules from seeing each other's clusters) and
print one closing line for the whole suite."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    modules = sorted(str(p) for p in Path("tests").glob("test_*.py"))
    extra = argv
    totals = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed_modules = []
    t0 = time.time()
    for mod in modules:
        print(f"\n##### {mod}", flush=True)
        proc = subprocess.run([sys.executable, "-m", "pytest", mod, *extra], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        print(proc.stdout, flush=True)
        tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        for key, pat in (("passed", r"(\d+) passed"), ("failed", r"(\d+) failed"), ("errors", r"(\d+) error"),
                         ("skipped", r"(\d+) skipped")):
            m = re.search(pat, tail)
            totals[key] += int(m.group(1)) if m else 0
        if proc.returncode not in (0, 5):
            failed_modules.append(mod)
    print(f"\nmodules with failures: {', '.join(failed_modules) or 'none'}; {time.time() - t0:.0f} s")
    failed = totals["failed"] + totals["errors"] + (len(failed_modules) if not (totals["failed"] + totals["errors"]) else 0)
    line = f"{totals['passed']} passed, {failed} failed"
    if totals["skipped"]:
        line += f", {totals['skipped']} skipped"
    print(line)
    return 1 if failed_modules or totals["passed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
