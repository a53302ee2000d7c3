"""The reference drafter shipped in ``specdec/drafters/<slug>`` (library side of
``jobs/publish_reference.py``): replaced only by a candidate that wins by the promotion rule,
measured side by side by the same harness as a promotion."""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

from pipelines import evaluate
from pipelines.evaluate import Candidate, evaluations_from_report
from pipelines.promotion_rule import DEFAULT_MARGIN, Decision, decide


def publish_reference(candidate: str | Path, slug: str = "smollm2-135m", prompts: str = "sharegpt",
                      num_prompts: int = 8, max_new_tokens: int = 64, margin: float = DEFAULT_MARGIN,
                      command: str = "", target=None, root: str | Path | None = None,
                      block_size: int | None = None) -> tuple[Decision, dict]:
    """Replace the reference drafter shipped in ``specdec/drafters/<slug>`` by ``candidate``
    only when it wins: the promotion harness measures it side by side with the current
    reference (or, with none yet, with the target alone) and the promotion rule decides.
    The winner is written in fp16 (the published layout) with its numbers in the lineage.
    ``block_size`` None: each drafter's own; else the block both are measured at, and the
    published config's ``block_size`` (the training block stays in the lineage).
    ``target``/``root``: another target and folder of reference drafters (tests)."""
    import shutil

    import torch

    from specdec.assets import REFERENCE_DRAFTERS, reference_drafter
    from specdec.bench import load_prompt_ids
    from specdec.checkpoint import load_drafter, save_drafter
    from specdec.target import load_target

    target = target or load_target(None)
    root = Path(root) if root is not None else REFERENCE_DRAFTERS
    current = reference_drafter(slug, root)
    candidates = []
    for role, name, path in (("champion", "reference", current), ("challenger", "candidate", Path(candidate))):
        if path is not None:
            d = load_drafter(path, target=target)
            candidates.append(Candidate(f"dflash:{name}", role, name, d, block_size or d.config.block_size))
    prompt_ids, ps = load_prompt_ids(target, prompts, num_prompts)
    report = evaluate.measure(target, candidates, ps, prompt_ids, max_new_tokens, prompts)
    evals = evaluations_from_report(report)
    decision = decide(evals["challenger"], evals.get("champion"), "speedup", margin)
    if decision.promote:
        drafter = candidates[-1].drafter
        drafter.config.block_size = candidates[-1].block_size  # the block it was measured (and serves) at
        ch = evals["challenger"]
        drafter.config.extra["reference"] = {
            "prompts": prompts, "num_prompts": len(ps), "max_new_tokens": max_new_tokens, "tau": ch.tau,
            "speedup_vs_ar": ch.speedup, "ar_tokens_per_s": ch.ar_tokens_per_s, "exact": ch.exact,
            "published_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "command": command}
        dst = root / slug
        tmp = dst.with_name(f".{slug}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_drafter(drafter, tmp, dtype=torch.float16)
        shutil.rmtree(dst, ignore_errors=True)
        tmp.rename(dst)
    return decision, report
