"""Adaptive speculation on the vllm backend: vLLM's per-batch-size draft schedule
(``speculative_config.num_speculative_tokens_per_batch_size``, a list of
``(first_batch_size, last_batch_size, drafted_tokens)``, 0 = speculation off) derived from
our cost model (:mod:`serve_app.adaptive`), so both backends decide "speculate, and how far"
with the same rule: the block with the most expected tokens per second at each batch size.

vLLM expands the schedule once, when its scheduler starts, so the schedule is fixed for the
engine's life: a new acceptance estimate takes a new engine (a redeploy or a rolling update).
"""

from __future__ import annotations

from serve_app.adaptive import CostModel, choose_block_size


def draft_schedule(survival: list[float], cost: CostModel, max_rows: int, max_block: int,
                   margin: float = 0.03) -> list[tuple[int, int, int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` for batch sizes 1..``max_rows``:
    at each, the block :func:`serve_app.adaptive.choose_block_size` picks (k tokens verified,
    k - 1 drafted; k = 1: off), equal neighbours merged into one range."""
    out: list[tuple[int, int, int]] = []
    for rows in range(1, max(max_rows, 1) + 1):
        k, _ = choose_block_size(survival, cost, rows, max_block, margin)
        if out and out[-1][2] == k - 1:
            out[-1] = (out[-1][0], rows, k - 1)
        else:
            out.append((rows, rows, k - 1))
    return out
