"""GPU acceptance checks in one command (the checks: ``pipelines/gpu_check.py``).

    make gpu-check                                   # on a machine with an NVIDIA GPU
    python jobs/gpu_check.py --checks train_bf16_flex,vllm_serve_drafter --out /tmp/g.json
    python jobs/gpu_check.py --require-gpu           # "no GPU" is a FAIL (exit 1), not a SKIP
"""

import sys

from pipelines.gpu_check import main

if __name__ == "__main__":  # vLLM's LLM starts engine processes: checks only ever run under this guard
    sys.exit(main())
