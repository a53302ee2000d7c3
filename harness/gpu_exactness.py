"""Tier 1's ``bf16_exactness`` check (its method: harness/gpu_tier1.py's docstring): greedy AR vs
speculative greedy through the engine with a random drafter, a DFlash2 drafter and an oracle
proposer, plus AR at batch 1 vs batched AR as the control; every divergence is explained by
rounding (the path noise between the engine's shapes, or a near tie) or the check fails.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Callable

import torch

from harness.gpu_models import (EMBED_STD, LOGIT_STD, Shapes, build_dflash2, build_drafter, build_target, describe,
                                generate, proposer_classes, random_prompts, setup, time_left, ulp)

if TYPE_CHECKING:
    from specdec.drafter import DFlashDrafter
    from specdec.target import Target


TIE_ULPS = 4  # a divergence within this many ulps of the top-1 logit is a rounding tie
GOAL_IDENTICAL = 0.95  # the goal: identical to AR on >= 95% of prompts


@torch.no_grad()
def ar_gaps(target: Target, prompt: list[int], tokens: list[int]) -> tuple[list[float], list[float]]:
    """(top-1 logit, top1 - top2) of the target's law before each of ``tokens``, teacher-forced."""
    ids = torch.tensor([prompt + tokens[:-1]], device=target.device)
    hidden = target(ids, torch.arange(ids.shape[1], device=target.device)[None]).hidden[0, len(prompt) - 1:]
    top = target.logits(hidden).float().topk(2, dim=-1).values
    return top[:, 0].tolist(), (top[:, 0] - top[:, 1]).tolist()


@torch.no_grad()
def chunked_logits(target: Target, prompt: list[int], tokens: list[int], chunk: int) -> torch.Tensor:
    """The target's logits before each of ``tokens`` (teacher-forced), computed as the engine
    computes them: the prompt prefilled, then ``tokens[:-1]`` fed ``chunk`` at a time through
    the cache (1: AR decoding's shapes; B: verification's)."""
    from transformers import DynamicCache

    from specdec import kvcache

    dev, cache = target.device, DynamicCache()
    lens = torch.tensor([len(prompt)], device=dev)
    ids = torch.tensor([prompt], device=dev)
    out = [target(ids, torch.arange(len(prompt), device=dev)[None], cache,
                  kvcache.attention_mask(lens, 0, len(prompt), causal=True)).hidden[:, -1:]]
    fed = tokens[:-1]
    for i in range(0, len(fed), chunk):
        part = torch.tensor([fed[i:i + chunk]], device=dev)
        k, past = part.shape[1], len(prompt) + i
        mask = kvcache.attention_mask(torch.tensor([past], device=dev), past, k, causal=True)
        out.append(target(part, past + torch.arange(k, device=dev)[None], cache, mask).hidden)
    return target.logits(torch.cat(out, dim=1)[0]).float()


def path_noise(target: Target, prompts: list, ar: list, block: int, n: int) -> dict:
    """How far bf16 rounding alone moves the logits between the engine's shapes: for ``n``
    prompts, teacher-forced logits from one whole-sequence forward vs AR decoding's (chunks of
    1) and verification's (chunks of ``block``). An argmax can only flip between two shapes
    where the top-1/top-2 gap is at most |d top1| + |d top2|: ``bound`` is that sum's maximum
    over every position measured (a wrong cache slot, mask or position moves logits by far more)."""
    worst, per = 0.0, {}
    for name, chunk in (("decode", 1), ("verify", block)):
        sums = []
        for p, toks in zip(prompts[:n], ar[:n]):
            ids = torch.tensor([p + toks[:-1]], device=target.device)
            whole = target.logits(target(ids, torch.arange(ids.shape[1], device=target.device)[None])
                                  .hidden[0, len(p) - 1:]).float()
            top2 = whole.topk(2, dim=-1).indices
            delta = (whole - chunked_logits(target, p, toks, chunk)).abs().gather(-1, top2).sum(-1)
            sums.append(delta)
        d = torch.cat(sums)
        per[name] = {"max": round(float(d.max()), 4), "p99": round(float(d.quantile(0.99)), 4),
                     "median": round(float(d.median()), 4)}
        worst = max(worst, float(d.max()))
    return {"bound": round(worst, 4), "prompts": n, **per}


def compare(ar: list[list[int]], other: list[list[int]], gaps: list, dtype: torch.dtype, bound: float) -> dict:
    """Identical share of ``other`` against ``ar`` and, per divergent prompt, the AR gap at
    its first divergent token in logits and in ulps of the top-1 logit; a divergence is
    explained when that gap is within ``bound`` (the measured rounding noise between shapes,
    at least :data:`TIE_ULPS` ulps)."""
    div = []
    for i, (a, o) in enumerate(zip(ar, other)):
        j = next((k for k, (x, y) in enumerate(zip(a, o)) if x != y), None)
        if j is None and len(a) == len(o):
            continue
        if j is None or j >= len(gaps[i][0]):  # same tokens, different lengths: not a tie
            div.append({"prompt": i, "token": j, "gap": None, "gap_ulps": None, "explained": False})
            continue
        top1, gap = gaps[i][0][j], gaps[i][1][j]
        ulps = gap / ulp(top1, dtype)
        div.append({"prompt": i, "token": j, "ar": a[j], "other": o[j], "gap": round(gap, 5),
                    "gap_ulps": round(ulps, 2), "explained": ulps <= TIE_ULPS or gap <= bound})
    n = len(other)
    return {"prompts": n, "identical": (n - len(div)) / n if n else None, "divergences": div,
            "explained": all(d["explained"] for d in div)}


def exactness_runs(target: Target, drafter: DFlashDrafter, s: Shapes, prompts: list,
                   ar: list) -> dict[str, Callable[[], tuple]]:
    """The runs compared with the batched AR output, by name."""
    dflash, oracle = proposer_classes()
    control = prompts[: s.control_prompts]
    return {
        "dflash": lambda: generate(target, dflash(drafter, target), prompts, s.new_tokens, s.block_size),
        "ar_batch1": lambda: ([generate(target, None, [p], s.new_tokens, 1)[0][0] for p in control], []),
        "oracle": lambda: generate(target, oracle(), prompts, s.new_tokens, s.block_size, oracle=ar),
        "dflash2": lambda: generate(target, dflash(build_dflash2(drafter, target.device), target), prompts,
                                    s.new_tokens, s.block_size),
    }


def check_bf16_exactness(metrics: dict, opts: dict) -> str:
    """Speculative greedy == AR greedy, or every divergence explained by a rounding tie."""
    from specdec.engine import tau_of

    s, dev, dtype = setup(opts)
    metrics.update(describe(s, dev, dtype, s.target_layers), prompts=s.prompts, new_tokens=s.new_tokens,
                   tie_ulps=TIE_ULPS, embed_std=EMBED_STD, logit_std=LOGIT_STD)
    target = build_target(s, dev, dtype)
    drafter = build_drafter(target, s, dev)
    prompts = random_prompts(s, s.prompts, seed=1)
    t0 = time.perf_counter()
    ar, _ = generate(target, None, prompts, s.new_tokens, 1)
    ar_s = time.perf_counter() - t0
    gaps = [ar_gaps(target, p, a) for p, a in zip(prompts, ar)]
    flat = [(t, g) for top, gap in gaps for t, g in zip(top, gap)]
    metrics.update(ar_s=round(ar_s, 3), gap_median=round(statistics.median(g for _, g in flat), 4),
                   near_tie_steps=round(sum(g <= TIE_ULPS * ulp(t, dtype) for t, g in flat) / len(flat), 4))
    metrics["noise"] = noise = path_noise(target, prompts, ar, s.block_size, s.noise_prompts)
    metrics["within_noise_steps"] = round(sum(g <= noise["bound"] for _, g in flat) / len(flat), 4)
    modes, skipped = {}, []
    # what a run costs in batched AR runs: a DFlash cycle verifies B tokens and drafts (~2),
    # the oracle's few cycles (~1), the control one AR run per prompt
    cost = {"dflash": 2.0, "dflash2": 2.0, "oracle": 1.0, "ar_batch1": float(s.control_prompts)}
    for name, run in exactness_runs(target, drafter, s, prompts, ar).items():
        if time_left(opts) < 1.5 * cost[name] * ar_s + 5:  # too little time: keep the results we have
            skipped.append(name)
        else:
            tokens, accepted = run()
            modes[name] = {**compare(ar[: len(tokens)], tokens, gaps, dtype, noise["bound"]),
                           "tau": tau_of(accepted)}
        metrics.update(modes=modes, skipped_for_time=skipped)
    return exactness_verdict(metrics, modes, skipped, dtype)


def exactness_verdict(metrics: dict, modes: dict, skipped: list, dtype: torch.dtype) -> str:
    """PASS when every speculative divergence is a rounding tie (module docstring)."""
    spec = {k: v for k, v in modes.items() if k != "ar_batch1"}
    if not spec:
        raise AssertionError(f"no speculative run finished in the time left (skipped: {skipped})")
    bad = [(k, d) for k, v in spec.items() for d in v["divergences"] if not d["explained"]]
    worst = min(v["identical"] for v in spec.values())
    # the control (AR at batch 1 vs batched AR) is the same rounding question without speculation
    control = modes.get("ar_batch1", {}).get("identical")
    metrics.update(identical=worst, goal_identical=GOAL_IDENTICAL, control_identical=control,
                   goal_met=worst >= GOAL_IDENTICAL, at_least_control=None if control is None else worst >= control)
    parts = [f"{k} {round(v['identical'] * v['prompts'])}/{v['prompts']} identical" for k, v in modes.items()]
    noise = metrics["noise"]
    summary = (f"{', '.join(parts)} ({metrics['dtype']}, {metrics['target_layers']}-layer target); "
               f"{metrics['near_tie_steps']:.1%} of AR steps within {TIE_ULPS} ulps, "
               f"{metrics['within_noise_steps']:.1%} within the measured shape noise {noise['bound']:.2f}")
    if bad:
        k, d = bad[0]
        raise AssertionError(f"{len(bad)} divergence(s) not explained by rounding: {k} prompt {d['prompt']} "
                             f"token {d['token']}, AR gap {d['gap']} ({d['gap_ulps']} ulps > {TIE_ULPS}, "
                             f"> noise bound {noise['bound']}); {summary}")
    n_div = sum(len(v["divergences"]) for v in spec.values())
    ties = f"{n_div} speculative divergence(s), all rounding ties" if n_div else "no speculative divergence"
    return f"{summary}; {ties}" + (
        f"; skipped for time: {', '.join(skipped)}" if skipped else "")
