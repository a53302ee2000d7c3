"""GPU acceptance checks in one command, from the repository, with no install
(the driver: ``harness/gpu_check.py``; the checks: ``harness/gpu_tier1.py``, ``harness/gpu_tier2.py``).

    PYTHONPATH=. python3 jobs/gpu_check.py --tier 1 --budget-s 420 --out $OUT/gpu_check.json
    PYTHONPATH=. python3 jobs/gpu_check.py --tiny --device cpu --out /tmp/gpu_check.json   # CPU smoke run
    PYTHONPATH=. python3 jobs/gpu_check.py --checks bf16_exactness,cycle_cost --target-layers 8
    PYTHONPATH=. python3 jobs/gpu_check.py --require-gpu      # "no GPU" is a FAIL (exit 1), not a SKIP
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness/ sits beside jobs/

from harness.gpu_check import main  # noqa: E402

if __name__ == "__main__":  # vLLM's LLM starts engine processes: checks only ever run under this guard
    sys.exit(main())
