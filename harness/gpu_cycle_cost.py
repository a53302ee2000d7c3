"""Tier 1's ``cycle_cost`` check: one AR decode step, one verify of B tokens and one draft pass
timed at batch 1 and 8; draft and verify cost in target steps and the oracle ceiling (every
draft accepted) against the goal, and a DFlash2 draft pass of the same shape.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

import torch

from harness.gpu_models import (Shapes, build_dflash2, build_drafter, build_target, describe, proposer_classes,
                                random_prompts, setup, time_left, timed)

if TYPE_CHECKING:
    from specdec.drafter import DFlashDrafter
    from specdec.engine import Engine
    from specdec.target import Target


GOAL_CEILING = 5.0  # the goal: oracle ceiling >= 5x AR at batch 1


# ============================================================================ cycle_cost
def time_steps(engine: Engine, prompts: list[list[int]], k: int, s: Shapes, dev: torch.device) -> float:
    """Median seconds of ``engine.step(k)`` over ``s.reps`` steps after warm-up."""
    from specdec.engine import Request

    warm = 2
    engine.add([Request(p, (warm + s.reps + 2) * k + 8, stop_ids=frozenset()) for p in prompts])
    for _ in range(warm):
        engine.step(k)
    return statistics.median(timed(lambda: engine.step(k), dev) for _ in range(s.reps))


def cycle_row(target: Target, drafter: DFlashDrafter, s: Shapes, bsz: int, dev: torch.device) -> dict:
    """AR step, verify of B tokens, draft pass and full DFlash cycle at batch ``bsz``."""
    from specdec.engine import Engine

    dflash, oracle = proposer_classes()
    B = s.block_size
    prompts = random_prompts(s, bsz, seed=2, length=s.cycle_context)
    ar = time_steps(Engine(target, None, width=1), prompts, 1, s, dev)
    verify = time_steps(Engine(target, oracle(), width=B), prompts, B, s, dev)  # drafts cost nothing
    engine = Engine(target, dflash(drafter, target), width=B, seed=0)
    cycle = time_steps(engine, prompts, B, s, dev)
    draft = statistics.median(timed(lambda: engine.proposer.propose(engine, B - 1), dev) for _ in range(s.reps))
    engine2 = Engine(target, dflash(build_dflash2(drafter, dev), target), width=B, seed=0)
    time_steps(engine2, prompts, B, s, dev)  # fills its cache to the same context
    draft2 = statistics.median(timed(lambda: engine2.proposer.propose(engine2, B - 1), dev) for _ in range(s.reps))
    r_d, r_v = draft / ar, verify / ar
    return {"draft2_ms": round(draft2 * 1000, 3), "dflash2_draft_ratio": round(draft2 / draft, 3),
            "batch": bsz, "context": s.cycle_context, "ar_step_ms": round(ar * 1000, 3),
            "verify_ms": round(verify * 1000, 3), "draft_ms": round(draft * 1000, 3),
            "cycle_ms": round(cycle * 1000, 3), "r_d": round(r_d, 3), "r_v": round(r_v, 3),
            "cycle_steps": round(cycle / ar, 3), "oracle_tau": B, "oracle_speedup": round(B / (r_d + r_v), 2)}


def check_cycle_cost(metrics: dict, opts: dict) -> str:
    """Draft and verify cost in target steps at B = 16, batch 1 and 8; the oracle ceiling."""
    s, dev, dtype = setup(opts)
    metrics.update(describe(s, dev, dtype, s.target_layers), reps=s.reps)
    target = build_target(s, dev, dtype)
    drafter = build_drafter(target, s, dev)
    rows = []
    for bsz in s.cycle_batches:
        if rows and time_left(opts) < 10:
            break
        rows.append(cycle_row(target, drafter, s, bsz, dev))
        metrics["batches"] = rows
    one = rows[0]
    metrics.update(goal_ceiling=GOAL_CEILING, goal_met=one["oracle_speedup"] >= GOAL_CEILING)
    timings = ("ar_step_ms", "verify_ms", "draft_ms")
    bad = [r for r in rows if not all(math.isfinite(r[k]) and r[k] > 0 for k in timings)]
    if bad:
        raise AssertionError(f"a timing is not a positive number: {bad[0]}")
    return f"B={s.block_size}, {metrics['target_layers']}-layer target: " + "; ".join(
        f"batch {r['batch']}: AR {r['ar_step_ms']:.1f} ms, draft {r['r_d']:.2f} + verify {r['r_v']:.2f} steps "
        f"-> oracle ceiling {r['oracle_speedup']:.1f}x, DFlash2 draft {r['dflash2_draft_ratio']:.2f}x DFlash's"
        for r in rows)
