"""Serving pieces without Ray: adaptive block size, OpenAI validation, the engine
worker (continuous batching, cancel, drafter swap), the vLLM backend's generated
config, registry resolution, drafter refusal, metrics rendering and app config."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import yaml

from serve_app import adaptive
from serve_app.adaptive import AcceptanceModel, BlockSizeController, CostModel, LinearCost, choose_block_size
from serve_app.config import ServeConfig, load_config
from serve_app.protocol import APIError, Limits, parse_chat, parse_completion, parse_json
from serve_helpers import BLOCK, ar_tokens, make_drafter, private_dir, register_drafter, tiny_target_dir

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- adaptive
def test_acceptance_model_survival_and_tau():
    m = AcceptanceModel(max_drafts=4, prior_weight=1e-6)
    # every row accepted exactly 2 of 4 drafts: positions 1, 2 accepted, 3 rejected, 4 never tried
    for _ in range(50):
        m.observe(4, [2, 2, 2])
    c = m.conditional()
    assert c[0] == pytest.approx(1.0) and c[1] == pytest.approx(1.0) and c[2] == pytest.approx(0.0, abs=1e-6)
    assert m.tau(1) == 1.0
    assert m.tau(3) == pytest.approx(3.0)
    assert m.tau(5) == pytest.approx(3.0, abs=1e-3)


def test_linear_cost_recovers_line_and_is_well_posed_on_one_point():
    fit = LinearCost(decay=1.0, ridge=1e-6)
    for n in (1, 4, 8, 16, 32) * 3:
        fit.observe(n, 0.05 + 0.003 * n)
    a, b = fit.coefficients()
    assert a == pytest.approx(0.05, rel=1e-2) and b == pytest.approx(0.003, rel=1e-2)
    single = LinearCost()
    for _ in range(5):
        single.observe(1, 0.06)
    assert single.predict(1) == pytest.approx(0.06, rel=1e-3)
    assert single.predict(16) > single.predict(1)  # slope from the prior, not zero


def _cost(a=0.056, b=0.0029, da=0.01, db=0.001) -> CostModel:
    cost = CostModel()
    for n in (1, 2, 4, 8, 16, 32, 64):
        for _ in range(5):
            cost.verify.observe(n, a + b * n)
            cost.draft.observe(n, da + db * n)
    return cost


def test_choose_block_size_follows_acceptance_and_concurrency():
    cost = _cost()
    good = [0.8 ** j for j in range(1, BLOCK)]
    useless = [0.0] * (BLOCK - 1)
    k1, s1 = choose_block_size(good, cost, rows=1, max_block=BLOCK)
    assert k1 > 1 and s1 > 2.0
    k32, s32 = choose_block_size(good, cost, rows=32, max_block=BLOCK)
    assert k32 == 1 and s32 == 1.0  # at high concurrency verify is too dear: speculation off
    assert choose_block_size(useless, cost, rows=1, max_block=BLOCK) == (1, 1.0)
    k4, _ = choose_block_size(good, cost, rows=4, max_block=BLOCK)
    assert 1 < k4 <= k1  # smaller blocks as the batch grows


@pytest.mark.parametrize("accept,rows", [(0.0, 1), (0.0, 16), (0.3, 16), (0.8, 1), (0.8, 16), (0.95, 4)])
def test_controller_in_simulation_never_loses_to_ar_and_finds_the_best_block(accept, rows):
    """Closed loop against a synthetic engine: realised tokens/s vs AR and vs the best
    fixed block in hindsight (noisy timings, geometric acceptance)."""
    rnd = random.Random(0)
    verify = lambda n: 0.056 + 0.0029 * n  # noqa: E731  (SmolLM2-on-CPU-like costs)
    draft = lambda n: 0.01 + 0.001 * n  # noqa: E731
    ctl = BlockSizeController(BLOCK)
    tokens = seconds = 0.0
    for _ in range(2000):
        k = ctl.choose(rows)
        acc = []
        for _ in range(rows):
            a = 0
            while a < k - 1 and rnd.random() < accept:
                a += 1
            acc.append(a)
        v = verify(rows * k) * (1 + 0.05 * rnd.gauss(0, 1))
        d = draft(rows * BLOCK) * (1 + 0.05 * rnd.gauss(0, 1)) if k > 1 else 0.0  # the whole block, as the engine
        ctl.observe(rows, k, acc, d, v)
        tokens += sum(a + 1 for a in acc)
        seconds += v + d
    ar = rows / verify(rows)
    surv = [accept ** j for j in range(1, BLOCK)]
    best = max(rows * adaptive.expected_tau(surv, k) / (verify(rows * k) + (draft(rows * BLOCK) if k > 1 else 0))
               for k in range(1, BLOCK + 1))
    realised = tokens / seconds
    assert realised >= 0.98 * ar  # never slower than AR beyond probe noise (~1%)
    assert realised >= 0.95 * best


@pytest.mark.parametrize("slow,factor", [({0}, 40.0), ({30}, 40.0), ({0, 1, 2, 3}, 3.0), ({0, 1}, 10.0)])
def test_one_timing_hiccup_does_not_switch_speculation_off_for_long(slow, factor):
    """A cold start (the first cycles ``factor`` x slower) or a pause mid-chat must not keep a
    good drafter off: the chat the demo serves is ~40 cycles long."""
    rnd = random.Random(1)
    verify = lambda n: 0.011 + 0.0003 * n  # noqa: E731  (the demo's tiny target on CPU)
    draft = lambda n: 0.002 + 0.0001 * n  # noqa: E731
    ctl = BlockSizeController(4)  # the demo's drafter: block 4, tau ~1.9
    ks = []
    for i in range(120):
        k = ctl.choose(1)
        ks.append(k)
        acc = [0]
        while acc[0] < k - 1 and rnd.random() < 0.5:
            acc[0] += 1
        f = factor if i in slow else 1.0
        ctl.observe(1, k, acc, f * draft(4) if k > 1 else 0.0, f * verify(k))
    after = max(slow) + 1
    assert sum(k > 1 for k in ks[after:after + 40]) >= 20, ks  # back on within a few probes
    assert all(k > 1 for k in ks[after + 40:]), ks
    assert ctl.cost.cycle_seconds(1, 4) == pytest.approx(verify(4) + draft(4), rel=0.3)  # hiccup forgotten


def test_draft_cost_is_the_whole_blocks_whatever_k_is_verified():
    """The drafter always denoises its B positions: draft seconds that depend on rows only
    are predicted as such at every k (a fit over rows * k would call k=2 cheap, k=B dear)."""
    ctl = BlockSizeController(8)
    for k in (2, 3, 5, 8) * 20:
        for rows in (1, 4):
            ctl.observe(rows, k, [0] * rows, 0.01 + 0.002 * rows * 8, 0.05 + 0.003 * rows * k)
    draft = [ctl.cost.cycle_seconds(1, k) - ctl.cost.cycle_seconds(1, k, drafter=False) for k in (2, 8)]
    assert draft[0] == pytest.approx(draft[1], rel=1e-9) and draft[0] == pytest.approx(0.026, rel=0.1)  # 0.1: ridge
    assert ctl.cost.cycle_seconds(4, 2) - ctl.cost.cycle_seconds(4, 2, drafter=False) == pytest.approx(0.074, rel=0.1)


def test_controller_modes():
    assert BlockSizeController(8, "off").choose(1) == 1
    assert BlockSizeController(8, 4).choose(32) == 4
    assert BlockSizeController(8, 16).choose(1) == 8  # capped at the drafter's block
    assert BlockSizeController(1, "auto").choose(1) == 1  # no drafter


def test_acceptance_counts_each_row_only_up_to_what_it_drafted():
    m = AcceptanceModel(max_drafts=4, prior_weight=1e-6)
    m.observe([2, 4], [2, 1])  # row 0 drafted 2 and kept both: position 3 was never tried
    assert m.attempts == [2, 2, 0, 0] and m.successes == [2, 1, 0, 0]


def test_controller_learns_lookup_and_drafter_apart():
    """Lookup rows that accept whatever they draft and drafter rows that accept nothing: the
    drafter is turned off, lookup keeps its whole block; lookup-only steps teach no drafter cost."""
    ctl = BlockSizeController(4, "auto", lookup_block=8)
    for _ in range(300):
        k = ctl.choose(1)
        kl = ctl.choose_lookup(1, k)
        ctl.observe(2, max(k, kl), [kl - 1, 0], 0.0, 0.06 + 0.003 * 2 * max(k, kl),
                    [("lookup", kl - 1), ("dflash", k - 1)] if k > 1 else [("lookup", kl - 1), ("none", 0)],
                    [True, False])
    assert ctl.choose(1) == 1 and ctl.choose_lookup(1, 1) == 8 and ctl.match_rate == pytest.approx(0.5, abs=0.01)
    assert ctl.acceptance.conditional()[0] < 0.05 and ctl.lookup.conditional()[0] > 0.95
    lookup_only = BlockSizeController(4, "auto", lookup_block=8)
    lookup_only.observe(1, 8, [7], 0.0, 0.07, [("lookup", 7)])
    assert not lookup_only.cost.draft.fitted and lookup_only.cost.verify.fitted
    assert BlockSizeController(4, "off", lookup_block=8).choose_lookup(1, 1) == 1
    assert BlockSizeController(4, 3, lookup_block=8).choose_lookup(1, 3) == 8
    assert BlockSizeController(1, "auto", lookup_block=8).choose_lookup(1, 1) == 1  # no drafter: no lookup


def test_lookup_block_weighs_the_match_rate_against_padding_every_row():
    """Rarely matched rows: worth a long lookup block at batch 1, not at batch 16, where every
    unmatched row pays the padded width in the verify pass."""
    ctl = BlockSizeController(4, "auto", lookup_block=8)
    for n in (1, 8, 16, 64, 128):  # a SmolLM2-on-CPU-like verify cost, a + b n
        for _ in range(20):
            ctl.cost.observe(1, n, None, 0.05 + 0.003 * n)
    for _ in range(200):
        ctl.lookup.observe([7], [7])  # whatever lookup drafts is accepted
    ctl.match = [100.0, 1000.0]  # ... but only one row in ten has a match
    assert ctl.choose_lookup(1, 1) == 8
    assert ctl.choose_lookup(16, 1) == 1
    ctl.match = [900.0, 1000.0]
    assert ctl.choose_lookup(16, 1) > 1


# ---------------------------------------------------------------------- protocol
LIMITS = Limits("m", max_tokens_limit=64, default_max_tokens=16)
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body,param,status", [
    ({}, "messages", 400),
    ({"messages": []}, "messages", 400),
    ({"messages": "hi"}, "messages", 400),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", 400),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", 400),
    ({"messages": MSG, "model": "other"}, "model", 404),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens", 400),
    ({"messages": MSG, "max_tokens": -5}, "max_tokens", 400),
    ({"messages": MSG, "max_tokens": 65}, "max_tokens", 400),
    ({"messages": MSG, "max_tokens": "10"}, "max_tokens", 400),
    ({"messages": MSG, "temperature": -0.1}, "temperature", 400),
    ({"messages": MSG, "temperature": "hot"}, "temperature", 400),
    ({"messages": MSG, "top_p": 0}, "top_p", 400),
    ({"messages": MSG, "top_p": 1.5}, "top_p", 400),
    ({"messages": MSG, "stream": "yes"}, "stream", 400),
    ({"messages": MSG, "n": 2}, "n", 400),
    ({"messages": MSG, "stop": [1]}, "stop", 400),
])
def test_chat_validation_errors(body, param, status):
    with pytest.raises(APIError) as e:
        parse_chat(body, LIMITS)
    assert e.value.status == status and e.value.param == param
    err = e.value.body()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"


def test_valid_requests_parse():
    job = parse_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                      "temperature": 0, "max_tokens": 5, "stop": "x", "stream": True,
                      "stream_options": {"include_usage": True}}, LIMITS)
    assert job.messages == [{"role": "user", "content": "a"}] and job.max_tokens == 5 and job.stop == ["x"]
    assert job.temperature == 0.0 and job.stream and job.include_usage
    assert parse_chat({"messages": MSG}, LIMITS).max_tokens == 16
    comp = parse_completion({"prompt": [[1, 2, 3]], "max_completion_tokens": 3}, LIMITS)
    assert comp.prompt == [1, 2, 3] and comp.max_tokens == 3
    for bad in ({"prompt": ""}, {"prompt": 5}, {"prompt": ["a", "b"]}, {}, {"prompt": "x", "echo": True}):
        with pytest.raises(APIError):
            parse_completion(bad, LIMITS)
    for raw in (b"{not json", b"[1, 2]", b"\xff"):
        with pytest.raises(APIError) as e:
            parse_json(raw)
        assert e.value.status == 400


# OpenAI fields we accept but do not implement: ill-typed -> 400 naming the field and what was expected
@pytest.mark.parametrize("name,value,expected", [
    ("seed", "abc", "an integer"),
    ("seed", True, "an integer"),
    ("logit_bias", "x", "token-id strings"),
    ("logit_bias", {"abc": 1}, "token-id strings"),
    ("logit_bias", {"42": 101}, "[-100, 100]"),
    ("presence_penalty", "1", "a number"),
    ("frequency_penalty", [0], "a number"),
    ("user", 7, "a string"),
    ("n", "2", "an integer"),
    ("logprobs", "yes", "a boolean"),
    ("top_logprobs", 1.5, "an integer"),
    ("response_format", "json", "an object"),
    ("tools", {"type": "function"}, "an array of objects"),
    ("tool_choice", 3, "a string or an object"),
    ("parallel_tool_calls", "true", "a boolean"),
    ("stream_options", "", "an object"),
    ("metadata", {"k": 1}, "an object mapping strings to strings"),
    ("service_tier", 1, "a string"),
    ("store", "no", "a boolean"),
])
def test_chat_ill_typed_unimplemented_fields(name, value, expected):
    with pytest.raises(APIError) as e:
        parse_chat({"messages": MSG, name: value}, LIMITS)
    assert (e.value.status, e.value.param, e.value.code) == (400, name, "invalid_type")
    assert expected in e.value.message


@pytest.mark.parametrize("name,value,code", [
    ("logit_bias", {"42": 5}, "unsupported_value"),
    ("presence_penalty", 0.5, "unsupported_value"),
    ("frequency_penalty", -1, "unsupported_value"),
    ("presence_penalty", 2.5, "decimal_above_max_value"),
    ("n", 2, "unsupported_value"),
    ("n", 0, "integer_below_min_value"),
    ("logprobs", True, "unsupported_value"),
    ("top_logprobs", 3, "unsupported_value"),
    ("top_logprobs", 21, "integer_above_max_value"),
    ("response_format", {"type": "json_object"}, "unsupported_value"),
    ("tools", [{"type": "function", "function": {"name": "f"}}], "unsupported_value"),
    ("tool_choice", "required", "unsupported_value"),
])
def test_chat_unhonourable_values_are_refused(name, value, code):
    with pytest.raises(APIError) as e:
        parse_chat({"messages": MSG, name: value}, LIMITS)
    assert (e.value.status, e.value.param, e.value.code) == (400, name, code)
    assert name in e.value.message


def test_store_is_honoured_not_refused():
    """OpenAI's "store" reaches the replica: False keeps the request out of traffic capture; True
    (and unset) let capture take it where it is on, and change nothing where it is off."""
    assert [parse_chat({"messages": MSG, **({"store": v} if v is not None else {})}, LIMITS).store
            for v in (True, False, None)] == [True, False, None]


def test_logit_bias_refusal_says_why():
    with pytest.raises(APIError) as e:
        parse_completion({"prompt": "x", "logit_bias": {"42": -100}}, LIMITS)
    assert e.value.param == "logit_bias" and "not supported by this server" in e.value.message


NEUTRAL = {"seed": 12345, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "n": 1,
           "user": "u-1", "logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"}, "tools": [],
           "tool_choice": "none", "parallel_tool_calls": True, "metadata": {"k": "v"}, "store": False,
           "service_tier": "auto", "stream_options": None}


def test_neutral_values_are_accepted():
    job = parse_chat({"messages": MSG, "temperature": 0.5, **NEUTRAL}, LIMITS)
    assert job.temperature == 0.5 and job.messages == [{"role": "user", "content": "hi"}]
    assert parse_chat({"messages": MSG, **{k: None for k in NEUTRAL}}, LIMITS).max_tokens == 16
    common = {k: NEUTRAL[k] for k in ("seed", "logit_bias", "presence_penalty", "frequency_penalty", "n", "user")}
    comp = parse_completion({"prompt": "x", "echo": False, "logprobs": False, "suffix": "", "best_of": 1, **common},
                            LIMITS)
    assert comp.prompt == "x"


@pytest.mark.parametrize("name,value,code", [
    ("seed", "abc", "invalid_type"),
    ("logit_bias", "x", "invalid_type"),
    ("echo", "no", "invalid_type"),
    ("echo", True, "unsupported_value"),
    ("logprobs", 2, "unsupported_value"),
    ("logprobs", 6, "integer_above_max_value"),
    ("suffix", "tail", "unsupported_value"),
    ("best_of", 3, "unsupported_value"),
])
def test_completion_unimplemented_fields(name, value, code):
    with pytest.raises(APIError) as e:
        parse_completion({"prompt": "x", name: value}, LIMITS)
    assert (e.value.status, e.value.param, e.value.code) == (400, name, code)


# ---------------------------------------------------------------------- worker
@pytest.fixture(scope="module")
def tiny():
    from specdec.target import load_target

    with private_dir("serve-units") as root:
        yield root, load_target(str(tiny_target_dir(root)))


def _drain(stream):
    async def run():
        toks = []
        while True:
            item = await stream.get()
            if item[0] == "tokens":
                toks += item[1]
            else:
                return toks, item
    return run()


def test_plan_admissions_bounds_padded_prefill_and_keeps_order():
    from serve_app.worker import plan_admissions

    # the oldest always goes, even over budget; the padded cost is rows x longest
    assert plan_admissions([5000, 10, 10], room=4, budget=2048) == [0]
    assert plan_admissions([400, 30, 900, 50, 60], room=8, budget=2048) == [0, 1, 3, 4]
    # a long prompt does not pad short ones: it is skipped, and heads the next turn
    lengths = [100, 1500, 120, 90, 80]
    first = plan_admissions(lengths, room=8, budget=1024)
    assert first == [0, 2, 3, 4]
    assert plan_admissions([lengths[1]], room=8, budget=1024) == [0]
    # room caps the rows; an empty queue or no room admits nothing
    assert plan_admissions([10] * 10, room=3, budget=2048) == [0, 1, 2]
    assert plan_admissions([10] * 10, room=0, budget=2048) == []
    assert plan_admissions([], room=4, budget=2048) == []
    for _ in range(200):  # random queues: budget holds beyond the first row, order is kept
        lengths = [random.randint(1, 700) for _ in range(random.randint(1, 20))]
        room, budget = random.randint(1, 16), random.randint(1, 4096)
        picked = plan_admissions(lengths, room, budget)
        assert picked == sorted(picked) and len(picked) <= room and (picked[:1] == [0])
        if len(picked) > 1:
            assert max(lengths[i] for i in picked) * len(picked) <= budget


def test_worker_batches_concurrent_requests_exactly(tiny):
    from specdec.checkpoint import load_drafter
    from specdec.engine import Request
    from serve_app.worker import EngineWorker

    root, target = tiny
    drafter = load_drafter(make_drafter(target, root / "d-exact"), target=target)
    prompts = [target.encode_chat([{"role": "user", "content": "tell me more " * (i + 1)}]) for i in range(6)]
    want = [ar_tokens(target, p, 20) for p in prompts]

    async def main(mode, budget):
        worker = EngineWorker(target, drafter, "1", mode=mode, max_batch_size=4, max_prefill_tokens=budget)
        try:
            streams = [worker.submit(Request(p, max_new_tokens=20)) for p in prompts]
            outs = await asyncio.gather(*[_drain(s) for s in streams])
            return outs, [s.max_rows for s in streams]
        finally:
            worker.stop()

    # budget 1: one prompt prefilled per engine turn, joining rows that are already decoding
    for mode, budget in (("auto", 4096), (4, 4096), ("off", 1)):
        outs, rows = asyncio.run(main(mode, budget))
        assert [o[0] for o in outs] == want, mode
        assert all(o[1][:2] == ("done", "length") for o in outs)
        assert max(rows) > 1 and max(rows) <= 4  # shared verify passes, capped at max_batch_size


def test_worker_warms_its_engine_up_without_measuring_it(tiny):
    """Before the first request the drafter and the target have both run (the first passes'
    one-time costs are paid), yet the controller's cost model and the metrics saw nothing."""
    from specdec.checkpoint import load_drafter
    from serve_app.worker import EngineWorker

    root, target = tiny
    drafter = load_drafter(make_drafter(target, root / "d-warm"), target=target)
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in (drafter, target.model)]
    worker = EngineWorker(target, drafter, "1", mode="auto", max_batch_size=4)
    try:
        for h in hooks:
            h.remove()
        assert len(calls) >= 3  # a drafter pass and target passes ran
        cost = worker._gens[0].controller.cost
        assert cost.verify.s0 == 0 and cost.draft.s0 == 0  # no cycle timed
        snap = worker.metrics.snapshot()
        assert snap["generated_tokens_total"] == 0 and not snap["accepted_length"]["count"]
    finally:
        worker.stop()


def test_engine_logs_when_speculation_turns_off_and_on_at_most_once_per_interval(tiny, monkeypatch):
    """Why a replica stopped speculating is in its log: one line per verdict change (probes
    aside), flips inside ``SPECULATION_LOG_S`` counted in the next line."""
    import logging

    from specdec.checkpoint import load_drafter
    from serve_app import worker as W

    root, target = tiny
    gen = W._Generation(target, load_drafter(make_drafter(target, root / "d-log"), target=target), "3", "auto",
                        CostModel(), seed=0)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    W.log.addHandler(handler)
    clock = [100.0]
    monkeypatch.setattr(W.time, "monotonic", lambda: clock[0])
    try:
        gen.note(1, 4)  # first verdict: on
        gen.note(1, 4)  # unchanged: silent
        clock[0] += 1
        gen.note(8, 1)  # off within the interval: counted, not logged
        gen.note(8, 4)
        gen.note(8, 1)
        clock[0] += W.SPECULATION_LOG_S
        gen.note(8, 1)  # unchanged
        gen.note(2, 4)
    finally:
        W.log.removeHandler(handler)
    assert len(lines) == 2, lines
    assert lines[0].startswith("speculation on at 1 rows (drafter version 3): block 4")
    assert lines[1].startswith("speculation on at 2 rows") and "3 switches since the last line" in lines[1]


def test_worker_with_prompt_lookup_runs_the_hybrid_proposer_exactly(tiny):
    from specdec.checkpoint import load_drafter
    from specdec.engine import Request
    from specdec.proposers import HybridProposer
    from serve_app.worker import EngineWorker

    root, target = tiny
    drafter = load_drafter(make_drafter(target, root / "d-lookup"), target=target)
    prompts = [target.encode_chat([{"role": "user", "content": "say it again: " + "red blue " * (i + 2)}])
               for i in range(4)]
    want = [ar_tokens(target, p, 24) for p in prompts]

    async def main():
        worker = EngineWorker(target, drafter, "1", mode=8, max_batch_size=4, lookup_block=8)
        try:
            streams = [worker.submit(Request(p, max_new_tokens=24)) for p in prompts]
            outs = await asyncio.gather(*[_drain(s) for s in streams])
            return outs, worker._gens[0].proposer
        finally:
            worker.stop()

    outs, proposer = asyncio.run(main())
    assert [o[0] for o in outs] == want
    assert isinstance(proposer, HybridProposer) and proposer.draft_len == int(drafter.config.block_size) - 1
    assert proposer.tally["dflash"]  # (this random target never repeats itself: tests/test_lookup.py has both)


def test_worker_cancel_frees_the_row_and_swap_keeps_live_rows(tiny):
    from specdec.checkpoint import load_drafter
    from specdec.engine import Request
    from serve_app.worker import EngineWorker

    root, target = tiny
    d1 = load_drafter(make_drafter(target, root / "d1", seed=1), target=target)
    d2 = load_drafter(make_drafter(target, root / "d2", seed=2), target=target)
    prompt = target.encode_chat([{"role": "user", "content": "count"}])
    want = ar_tokens(target, prompt, 60)

    async def main():
        worker = EngineWorker(target, d1, "1", mode=4, max_batch_size=4)
        try:
            doomed = worker.submit(Request(prompt, max_new_tokens=1000))
            keeper = worker.submit(Request(prompt, max_new_tokens=60))
            first = await doomed.get()
            assert first[0] == "tokens"
            worker.cancel(doomed)
            worker.set_drafter(d2, "2")  # keeper finishes on drafter 1, newcomers use drafter 2
            late = worker.submit(Request(prompt, max_new_tokens=60))
            (_, done_doomed), (k_toks, _), (l_toks, _) = await asyncio.gather(
                _drain(doomed), _drain(keeper), _drain(late))
            assert done_doomed[:2] == ("done", "cancelled")
            assert k_toks == want and l_toks == want
            assert worker.drafter_version == "2" and worker.generations == 1  # old generation retired
            assert worker.load() == (0, 0)
            assert worker.metrics.snapshot()["requests_total"]["cancelled"] == 1
        finally:
            worker.stop()

    asyncio.run(main())


# ---------------------------------------------------------------------- registry + refusal
def test_registry_resolution_polling_and_target_identity_refusal(tiny, monkeypatch):
    from serve_app.backends import load_paired_drafter
    from serve_app.registry import DrafterNotFound, DrafterSource, parse_models_uri
    from specdec.checkpoint import DrafterMismatchError

    root, target = tiny
    monkeypatch.setenv("DFLASH_CACHE", str(root / "cache"))
    uri = f"sqlite:///{root / 'mlflow.db'}"
    v1 = register_drafter(uri, "dflash-unit", make_drafter(target, root / "r1", seed=1))
    src = DrafterSource("models:/dflash-unit@champion", tracking_uri=uri)
    got = src.fetch()
    assert got.version == v1 and (Path(got.path) / "model.safetensors").is_file()
    assert load_paired_drafter(got.path, target) is not None
    assert src.poll(v1) is None
    v2 = register_drafter(uri, "dflash-unit", make_drafter(target, root / "r2", seed=2, identity="f" * 64))
    moved = src.poll(v1)
    assert moved is not None and moved.version == v2
    with pytest.raises(DrafterMismatchError, match="target_identity"):
        load_paired_drafter(moved.path, target)
    assert parse_models_uri("models:/x/3") == ("x", None, "3")
    with pytest.raises(DrafterNotFound):
        DrafterSource("models:/dflash-unit@nope", tracking_uri=uri).current_version()
    with pytest.raises(ValueError):
        parse_models_uri("models:/")


def test_choose_drafter_is_the_one_rule_of_both_backends(tiny, monkeypatch):
    """drafter=auto -> @champion -> the packaged reference drafter of an embedded target ->
    none; an explicit reference that is missing is an error; the vllm backend's engine
    nodes get exactly the choice."""
    from serve_app.registry import REFERENCE_VERSION, DrafterNotFound, choose_drafter
    from serve_app.vllm_app import node_source
    from specdec.assets import reference_drafter_for

    root, target = tiny
    monkeypatch.setenv("DFLASH_CACHE", str(root / "cache"))
    uri = f"sqlite:///{root / 'choice.db'}"
    off = choose_drafter(load_config({"speculation": "off", "tracking_uri": uri}))
    assert off.kind == "none" and off.source is None and node_source(off) is None
    ref = choose_drafter(load_config({"model_name": "choice-ref", "tracking_uri": uri}))  # embedded target
    assert ref.kind == "path" and ref.version == REFERENCE_VERSION and ref.source.registry
    assert ref.path == str(reference_drafter_for(None).resolve()) and ref.fetch() == ref.path
    assert node_source(ref) == {"kind": "path", "path": ref.path}
    own = {"target": str(tiny_target_dir(root)), "model_name": "choice", "tracking_uri": uri}
    none = choose_drafter(load_config(own))  # a user's target: no reference drafter
    assert none.kind == "none" and none.source.source == "models:/dflash-choice@champion"
    assert "serving without speculation" in none.reason and none.fetch() is None
    with pytest.raises(DrafterNotFound):
        choose_drafter(load_config({**own, "drafter": "models:/dflash-choice@champion"}))
    v1 = register_drafter(uri, "dflash-choice", make_drafter(target, root / "choice-v1"))
    champ = choose_drafter(load_config(own))
    assert champ.kind == "registry" and champ.version == v1 and "version " + v1 in champ.reason
    assert node_source(champ) == {"kind": "registry", "tracking_uri": uri, "name": "dflash-choice", "version": v1,
                                  "uri": "models:/dflash-choice@champion"}
    assert (Path(champ.fetch()) / "model.safetensors").is_file()
    local = choose_drafter(load_config({**own, "drafter": str(root / "choice-v1")}))
    assert local.kind == "path" and local.version == "local" and node_source(local)["path"] == str(root / "choice-v1")


# ---------------------------------------------------------------------- vLLM backend config
def test_vllm_backend_config_is_a_valid_llm_config(tiny):
    from serve_app.autoscaling import autoscaling_config_dict
    from serve_app.vllm_app import vllm_llm_config

    root, target = tiny
    drafter_dir = make_drafter(target, root / "d-vllm")
    source = {"kind": "path", "path": str(drafter_dir)}
    cfg = load_config({"backend": "vllm", "max_replicas": 8, "accelerator_type": "H100", "device": "cuda",
                       "vllm_engine_kwargs": {"max_model_len": 4096}})
    d = vllm_llm_config(cfg, "/models/target", source)
    assert d["engine_kwargs"]["speculative_config"]["method"] == "dflash"
    # the drafter is resolved on the engine's node, by the callback, with the drafter's own B
    assert d["callback_config"]["callback_class"] == "serve_app.vllm_app:DrafterOnNode"
    assert d["callback_config"]["callback_kwargs"] == {"source": source, "embedded_target": True, "speculation": None}
    assert d["engine_kwargs"]["max_model_len"] == 4096 and d["engine_kwargs"]["dtype"] == "auto"
    assert d["model_loading_config"] == {"model_id": "smollm2-135m", "model_source": "/models/target"}
    assert d["accelerator_type"] == "H100" and "accelerator_config" not in d
    auto = d["deployment_config"]["autoscaling_config"]
    assert auto == autoscaling_config_dict(cfg)  # the hf backend's policy, tau_* included
    # our server class reads vLLM's counters from its own registry: vLLM's Prometheus logger on
    assert d["server_cls"] == "serve_app.vllm_server:DFlashLLMServer" and d["log_engine_metrics"] is False
    assert d["engine_kwargs"]["disable_log_stats"] is False
    assert d["experimental_configs"]["dflash"]["drafter"] == {"source": str(drafter_dir), "version": ""}
    assert d["deployment_config"]["max_queued_requests"] == 256  # honoured, not dropped
    # a hot swap starts the new engine replica before the old one stops, which drains
    assert d["deployment_config"]["max_surge_percent"] == 1
    assert d["deployment_config"]["graceful_shutdown_timeout_s"] == cfg.request_timeout_s
    stop_first = vllm_llm_config(load_config({"backend": "vllm", "vllm_rollout_surge": False}), "/t", source)
    assert stop_first["deployment_config"]["max_surge_percent"] == 0
    sched = [[1, 4, 3], [5, 64, 0]]
    scheduled = vllm_llm_config(load_config({"backend": "vllm", "vllm_engine_kwargs": {
        "speculative_config": {"num_speculative_tokens_per_batch_size": sched}}}), "/t", source)
    assert scheduled["engine_kwargs"]["speculative_config"] == {
        "method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": 1,
        "num_speculative_tokens_per_batch_size": sched}  # merged into ours, not replacing it
    fixed = vllm_llm_config(load_config({"backend": "vllm", "speculation": 4}), "/t", source)
    assert fixed["callback_config"]["callback_kwargs"]["speculation"] == 4
    assert fixed["engine_kwargs"]["speculative_config"]["num_speculative_tokens"] == 3
    cpu = vllm_llm_config(load_config({"backend": "vllm", "replica_resources": {"engine_node": 1}}), "/t", None)
    assert "speculative_config" not in cpu["engine_kwargs"] and cpu["engine_kwargs"]["enforce_eager"]
    assert cpu["accelerator_config"] == {"kind": "cpu"}
    assert cpu["placement_group_config"] == {"bundles": [{"CPU": 1.0, "engine_node": 1}]}
    # engine replicas share their node: unbound threads (vLLM's "auto" pins every engine of a node to
    # the same cores), unless the driver says otherwise
    with pytest.MonkeyPatch.context() as env:
        for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
            env.delenv(name, raising=False)
        built = lambda: vllm_llm_config(load_config({"backend": "vllm"}), "/t", None)  # noqa: E731
        assert built()["runtime_env"] == {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1",
                                                       "VLLM_CPU_OMP_THREADS_BIND": "nobind"}}
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")
        assert built()["runtime_env"]["env_vars"]["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    # Ray Serve LLM's own schema accepts it (resolving server_cls imports vLLM, starts nothing)
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    from serve_app.autoscaling import POLICY_PATH

    assert auto["policy"]["policy_function"] == POLICY_PATH
    parsed = LLMConfig(**d)
    assert parsed.engine_kwargs["speculative_config"]["method"] == "dflash"
    assert parsed.server_cls.__name__ == "DFlashLLMServer"


def test_vllm_plain_pool_beside_the_speculative_one(tiny):
    """vllm_plain_pool: a second LLMConfig of the same target without a drafter, under a
    model id the ingress routes to (and never lists); without a drafter, one pool."""
    from serve_app.vllm_app import engine_pools

    root, target = tiny
    source = {"kind": "path", "path": str(make_drafter(target, root / "d-pools"))}
    cfg = load_config({"backend": "vllm", "vllm_plain_pool": True, "speculative_max_inflight": 2})
    (spec, plain), pools = engine_pools(cfg, "/t", source)
    assert pools == {"public": "smollm2-135m", "max_speculating": 2}
    assert spec["model_loading_config"]["model_id"] == "smollm2-135m" and "speculative_config" in spec["engine_kwargs"]
    assert plain["model_loading_config"] == {"model_id": "smollm2-135m--plain", "model_source": "/t"}
    assert "speculative_config" not in plain["engine_kwargs"]
    assert plain.get("callback_config", {}).get("callback_kwargs", {}).get("source") is None  # no drafter
    # the same policy and limits; no surge: a hot swap restarts only the speculative engine
    assert plain["deployment_config"] == spec["deployment_config"] | {"max_surge_percent": 0}
    assert engine_pools(cfg, "/t", None) == ([plain | {"model_loading_config": spec["model_loading_config"]}], None)
    assert engine_pools(load_config({"backend": "vllm"}), "/t", source)[1] is None
    with pytest.raises(ValueError, match="speculative_max_inflight"):
        load_config({"backend": "vllm", "speculative_max_inflight": -1})
    # the plain pool's own bounds (it takes the overflow); the speculative pool keeps its own
    grown = load_config({"backend": "vllm", "vllm_plain_pool": True, "min_replicas": 1, "max_replicas": 1,
                         "initial_replicas": 1, "plain_max_replicas": 3})
    (spec, plain), _ = engine_pools(grown, "/t", source)
    assert (spec["deployment_config"]["autoscaling_config"]["min_replicas"],
            spec["deployment_config"]["autoscaling_config"]["max_replicas"]) == (1, 1)
    scaling = plain["deployment_config"]["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (1, 3) and "initial_replicas" not in scaling
    with pytest.raises(ValueError, match=r"plain_min_replicas \(3\) > plain_max_replicas \(2\)"):
        load_config({"backend": "vllm", "plain_min_replicas": 3})


def test_vllm_app_follows_a_registry_alias_only(tiny):
    """The hot-swap watcher is set up for a registry alias with registry_poll_s > 0, with the
    registry pinned; not for a pinned version, a directory, or registry_poll_s 0."""
    from serve_app.registry import DrafterChoice, DrafterSource
    from serve_app.vllm_app import registry_watch

    root, target = tiny
    alias = DrafterChoice(DrafterSource("models:/d@champion", "sqlite:///r.db"), "3", None, "test")
    cfg = load_config({"backend": "vllm", "drafter": "models:/d@champion", "registry_poll_s": 5})
    watch = registry_watch(cfg, alias, "s1")
    assert watch["source"] == "models:/d@champion" and watch["version"] == "3" and watch["poll_s"] == 5
    assert watch["salt"] == "s1"  # a rebuild keeps the versions of what it does not change
    assert watch["tracking_uri"] == watch["args"]["tracking_uri"] == "sqlite:///r.db"
    assert load_config(watch["args"]).drafter == "models:/d@champion"  # the app rebuilds from these
    assert registry_watch(load_config({"backend": "vllm", "registry_poll_s": 0}), alias, "s1") is None
    pinned = DrafterChoice(DrafterSource("models:/d/3", "sqlite:///r.db"), "3", None, "test")
    assert registry_watch(cfg, pinned, "s1") is None
    local = DrafterChoice(DrafterSource(str(root)), "local", str(root), "test")
    assert registry_watch(cfg, local, "s1") is None


def test_pinned_versions_restart_only_what_a_rebuild_changed():
    """Every deployment of a built app gets a version from the build salt (Serve would draw a
    random one per serve.run, restarting every replica on a redeploy): rebuilt with the same
    salt only the engine whose LLMConfig changed gets a new version; a new salt changes all."""
    from pydantic import BaseModel
    from ray import serve

    from serve_app.vllm_swap import pin_versions

    class Engine(BaseModel):
        drafter_version: str

    @serve.deployment
    class Server:
        def __init__(self, llm_config):
            pass

    @serve.deployment
    class Hub:
        pass

    @serve.deployment
    class Ingress:
        def __init__(self, llm_deployments, hub, watch):
            pass

    def build(spec_version: str, salt: str) -> dict[str, str]:
        engines = {m: Server.options(name=f"Server:{m}").bind(llm_config=Engine(drafter_version=v))
                   for m, v in (("spec", spec_version), ("plain", ""))}
        app = Ingress.bind(llm_deployments=engines, hub=Hub.bind(), watch={"version": spec_version})
        versions = pin_versions(app, salt)
        assert app._bound_deployment.version == versions["Ingress"]
        assert engines["spec"]._bound_deployment.version == versions["Server:spec"]
        return versions

    v1 = build("1", "salt")
    assert set(v1) == {"Server:spec", "Server:plain", "Hub", "Ingress"} and len(set(v1.values())) == 4
    assert build("1", "salt") == v1  # deterministic
    v2 = build("2", "salt")
    assert {name for name in v1 if v1[name] != v2[name]} == {"Server:spec"}
    fresh = build("1", "other salt")
    assert all(fresh[name] != v1[name] for name in v1)


def test_watcher_redeploys_its_own_app_but_leaves_a_config_owned_one(monkeypatch, caplog):
    """A moved alias: an app deployed from Python is deployed again under its own name and
    route prefix, rebuilt with the watcher's salt; an app a Serve config file owns (serve
    deploy, a RayService) is left to that config, said once in the log."""
    from types import SimpleNamespace as NS

    import ray.serve
    import ray.serve.context

    import serve_app.vllm_app as vllm_app
    from serve_app.vllm_swap import ChampionWatcher

    details = {"route_prefix": "/spec", "deployed_app_config": None}
    runs, builds = [], []
    client = NS(get_serve_details=lambda: {"applications": {"spec": details}})
    monkeypatch.setattr(ray.serve.context, "_get_global_client", lambda: client)
    monkeypatch.setattr(ray.serve, "get_replica_context", lambda: NS(app_name="spec"))
    monkeypatch.setattr(ray.serve, "run", lambda app, name, route_prefix: runs.append((app, name, route_prefix)))
    monkeypatch.setattr(vllm_app, "build_vllm_app", lambda cfg, salt: builds.append((cfg, salt)) or "APP")
    watcher = ChampionWatcher({"backend": "vllm", "drafter": "models:/d@champion"}, "models:/d@champion",
                              "sqlite:///r.db", "1", 5, "s1", vllm_app.rebuild_vllm_app)
    assert watcher.redeploy("2") and watcher.version == "2"
    assert runs == [("APP", "spec", "/spec")] and builds[0][1] == "s1" and builds[0][0].backend == "vllm"
    details["deployed_app_config"] = {"import_path": "serve_app:build_app"}
    with caplog.at_level("ERROR", logger="serve_app.vllm_swap"):
        assert not watcher.redeploy("3")
    assert watcher.version == "3" and len(runs) == 1  # not redeployed, and not said again next poll
    assert "deployed from a Serve config file" in caplog.text


def test_pool_router_speculates_up_to_the_bound_and_renames():
    """Requests speculate while fewer than the bound do; the rest decode plain until a
    speculating one ends; responses of the plain pool carry the public name in every shape
    the LLM server yields them."""
    from types import SimpleNamespace as NS

    from pydantic import BaseModel

    from serve_app.vllm_routing import PoolRouter, rename_model

    r = PoolRouter("m", 2)
    with r.serving(r.pick()), r.serving(r.pick()):
        assert r.inflight == {"m": 2, "m--plain": 0} and r.pick() == "m--plain"
        with r.serving(r.pick()):
            assert r.inflight == {"m": 2, "m--plain": 1}
    assert r.pick() == "m" and r.counts() == {"inflight": {"m": 0, "m--plain": 0}, "served": {"m": 2, "m--plain": 1}}
    with pytest.raises(RuntimeError), r.serving("m--plain"):
        raise RuntimeError("client went away")
    assert r.inflight["m--plain"] == 0  # a dropped response frees its slot
    assert PoolRouter("m", 0).pick() == "m--plain"

    class Resp(BaseModel):
        model: str
        text: str = "m--plain"

    old, new = "m--plain", "m"
    assert rename_model(Resp(model=old), old, new) == Resp(model=new)  # the content is left alone
    assert rename_model({"model": old, "x": 1}, old, new) == {"model": new, "x": 1}
    sse = 'data: {"id":"c","model":"m--plain","choices":[{"text":"m--plain"}]}\n\n'
    assert rename_model(sse, old, new) == 'data: {"id":"c","model":"m","choices":[{"text":"m--plain"}]}\n\n'
    assert rename_model([sse, {"model": old}], old, new)[1] == {"model": new}
    assert rename_model(NS(model="other"), old, new).model == "other"


@pytest.mark.parametrize("setting, value", [("max_tokens_limit", 64), ("request_timeout_s", 5.0),
                                            ("max_batch_size", 4), ("torch_threads", 2)])
def test_vllm_backend_refuses_settings_it_would_drop(setting, value):
    from serve_app.vllm_app import UnsupportedSetting, check_settings

    check_settings(load_config({"backend": "vllm"}))  # the defaults pass
    with pytest.raises(UnsupportedSetting, match=f"^{setting} is not supported by backend=vllm"):
        check_settings(load_config({"backend": "vllm", setting: value}))


def test_vllm_capture_reads_the_ids_vllm_returns_and_hides_them_unless_asked():
    """The vllm backend's capture: the engine replica asks vLLM for token ids on captured
    requests and reads them off the responses (whole, or SSE chunks: the prompt's ids in the
    first, each chunk's new answer ids); a client that did not ask gets its response without
    them; "store": false, several choices and errors are never captured; the capture
    settings reach both pools' replicas with the public model name."""
    import json as _json

    from pydantic import BaseModel, ConfigDict

    from serve_app.vllm_app import vllm_llm_config
    from serve_app.vllm_capture import CapturingServer, TokenTrail, wants_capture

    class Req(BaseModel):
        model_config = ConfigDict(extra="allow")
        n: int = 1
        temperature: float | None = 0.0
        top_p: float | None = None
        max_tokens: int | None = 8
        request_id: str = "r1"

    assert wants_capture(Req()) and wants_capture(Req(store=True))
    assert not wants_capture(Req(store=False)) and not wants_capture(Req(n=2))

    class Choice(BaseModel):
        index: int = 0
        finish_reason: str | None = None
        token_ids: list[int] | None = None

    class Resp(BaseModel):
        prompt_token_ids: list[int] | None = None
        choices: list[Choice]

    whole = Resp(prompt_token_ids=[1, 2, 3], choices=[Choice(finish_reason="stop", token_ids=[7, 8, 2])])
    trail = TokenTrail(keep=False)
    out = trail.read(whole)
    assert out.prompt_token_ids is None and out.choices[0].token_ids is None  # as if never asked
    rec = trail.record(Req(), "m", {"source": "models:/d@champion", "version": "3"})
    assert (rec["prompt_ids"], rec["answer_ids"], rec["finish_reason"]) == ([1, 2, 3], [7, 8, 2], "stop")
    assert (rec["model"], rec["drafter_version"], rec["max_tokens"], rec["accepted"]) == ("m", "3", 8, [])

    def sse(d):
        return "data: " + _json.dumps(d) + "\n\n"

    chunks = [[sse({"prompt_token_ids": [5, 6], "choices": [{"index": 0, "delta": {"role": "assistant"}}]})],
              [sse({"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [9]}]}),
               sse({"choices": [{"index": 0, "delta": {"content": "b"}, "token_ids": [10, 11],
                                 "finish_reason": "length"}]})], ["data: [DONE]\n\n"]]
    kept = TokenTrail(keep=True)
    assert [kept.read(c) for c in chunks] == chunks  # the client asked for the ids: untouched
    hidden = TokenTrail(keep=False)
    seen = [_json.loads(s[6:]) for c in chunks for s in hidden.read(c) if s != "data: [DONE]\n\n"]
    assert not any("prompt_token_ids" in d or any("token_ids" in ch for ch in d["choices"]) for d in seen)
    assert [d["choices"][0]["delta"] for d in seen] == [{"role": "assistant"}, {"content": "a"}, {"content": "b"}]
    for tr in (kept, hidden):
        r = tr.record(Req(), "m", {})
        assert (r["prompt_ids"], r["answer_ids"], r["finish_reason"]) == ([5, 6], [9, 10, 11], "length")
    failed = TokenTrail(keep=False)
    failed.read([sse({"error": {"message": "boom"}})])
    assert failed.record(Req(), "m", {}) is None
    assert TokenTrail(keep=False).record(Req(), "m", {}) is None  # nothing came back

    class Base:  # what LLMServer.chat gives: an async stream of responses
        async def chat(self, request, raw_request_info=None):
            async def stream():
                yield whole if request.return_token_ids else Resp(choices=[Choice(finish_reason="stop")])
            return stream()

    class Server(CapturingServer, Base):
        pass

    async def answer(server, request):
        return [x async for x in await server.chat(request)]

    class Offered:
        def __init__(self):
            self.records = []

        def offer(self, record):
            self.records.append(record)

    server = Server()
    server._start_capture(None, "m", "r", {})
    plain = Req(return_token_ids=None)
    asyncio.run(answer(server, plain))
    assert plain.return_token_ids is None  # capture off: the request goes through untouched
    server._capture = Offered()
    whole = Resp(prompt_token_ids=[1, 2], choices=[Choice(finish_reason="stop", token_ids=[4])])
    got = asyncio.run(answer(server, Req(return_token_ids=None)))
    assert got[0].prompt_token_ids is None and server._capture.records[0]["answer_ids"] == [4]
    asyncio.run(answer(server, Req(return_token_ids=None, store=False)))
    assert len(server._capture.records) == 1  # "store": false: not asked for ids, not captured

    cfg = load_config({"backend": "vllm", "capture": {"uri": "/tmp/captured", "rate": 0.5}})
    extra = vllm_llm_config(cfg, "/t", None)["experimental_configs"]["dflash"]
    assert extra["capture"]["uri"] == "/tmp/captured" and extra["capture"]["rate"] == 0.5
    assert extra["served_model"] == cfg.served_model_name
    assert vllm_llm_config(load_config({"backend": "vllm"}), "/t", None)["experimental_configs"]["dflash"]["capture"] \
        is None  # off by default


def test_vllm_replica_stats_from_vllm_counters():
    """vLLM's counters (the reader's shapes) give the hf names: tau = 1 + accepted/drafts
    over the window, the A+1 histogram from the per-position counts, tokens/s, ongoing."""
    from types import SimpleNamespace as NS

    from serve_app.autoscaling import METRIC_ONGOING, METRIC_TAU, METRIC_TPS
    from serve_app.metrics import render_prometheus, scrape_totals
    from serve_app.vllm_server import VLLMReplicaStats, read_counters

    def reading(drafts, per_pos, generated, running=0.0, waiting=0.0):
        spec = "vllm:spec_decode_"
        return read_counters([
            NS(name=spec + "num_drafts", labels={}, value=drafts),
            NS(name=spec + "num_draft_tokens", labels={}, value=3 * drafts),
            NS(name=spec + "num_accepted_tokens", labels={}, value=sum(per_pos)),
            NS(name=spec + "num_accepted_tokens_per_pos", labels={"engine": "0"}, values=per_pos),
            NS(name="vllm:generation_tokens", labels={}, value=generated),
            NS(name="vllm:num_requests_running", labels={}, value=running),
            NS(name="vllm:num_requests_waiting", labels={}, value=waiting),
            NS(name="vllm:request_success", labels={"finished_reason": "stop"}, value=2)])

    stats = VLLMReplicaStats(block_size=4, drafter={"source": "models:/d/1", "version": "1"}, window_s=10)
    assert stats.autoscaling() == {METRIC_ONGOING: 0.0, METRIC_TAU: 1.0, METRIC_TPS: 0.0}  # idle
    stats.update(reading(0, [0, 0, 0], 0), at=0.0)
    # 5 drafts accepting 0,0,1,1,2 tokens (per position: 3 at 0, 1 at 1, 0 at 2) -> tau 1.8
    stats.update(reading(5, [3, 1, 0], 9, running=2, waiting=1), at=3.0)
    assert stats.autoscaling() == {METRIC_ONGOING: 3.0, METRIC_TAU: 1.8, METRIC_TPS: 3.0}
    snap = stats.snapshot()
    assert snap["accepted_length"]["counts"][:3] == [2, 2, 1] and snap["accepted_length"]["count"] == 5
    assert stats.tau() == snap["tau"] == 1.8
    # the window slides: the old reading drops out, the recent rate stays
    stats.update(reading(5, [3, 1, 0], 9), at=20.0)
    stats.update(reading(5, [3, 1, 0], 9), at=31.0)
    assert stats.autoscaling()[METRIC_TAU] == 1.0 and stats.autoscaling()[METRIC_TPS] == 0.0
    text = render_prometheus({"r1": snap})
    totals = scrape_totals(text)
    assert totals["tau"] == 1.8 and totals["generated_tokens_total"] == 9 and totals["block_size"] == 4
    assert totals["accepted_draft_tokens_total"] == {"dflash": 4} and totals["draft_tokens_total"] == {"dflash": 15}
    assert 'dflash_accepted_tokens_per_position_total{replica="r1",position="1"} 1' in text
    assert "dflash_draft_seconds" not in text.replace("# HELP dflash_draft_seconds", "").replace(
        "# TYPE dflash_draft_seconds", "")  # not measured on this backend: not rendered as zeros
    assert totals["drafter_info"] == {"source": "models:/d/1", "version": "1"}
    # an engine without a drafter (drafter=none, or the plain pool): tokens, no drafts, block 1
    from serve_app.vllm_app import drafter_info

    plain = VLLMReplicaStats(block_size=1, drafter=drafter_info(None), window_s=10)
    plain.update(reading(0, [0, 0, 0], 0), at=0.0)
    plain.update(reading(0, [0, 0, 0], 12, running=1), at=2.0)
    assert plain.autoscaling() == {METRIC_ONGOING: 1.0, METRIC_TAU: 1.0, METRIC_TPS: 6.0}
    t = scrape_totals(render_prometheus({"p1": plain.snapshot()}))
    assert t["generated_tokens_total"] == 12 and t["block_size"] == 1
    assert t["draft_tokens_total"] == {"dflash": 0} and t.get("accepted_length_count", 0) == 0
    assert t["drafter_info"] == {"source": "", "version": ""}


def test_vllm_draft_schedule_from_the_cost_model():
    """The per-batch-size schedule for vLLM follows choose_block_size at every batch size:
    the full block while verify is cheap, off (0 drafted) once the batch fills; contiguous
    ranges from 1 that vLLM's own validator accepts."""
    from serve_app.adaptive import CostModel, choose_block_size
    from serve_app.vllm_schedule import draft_schedule

    cost = CostModel(draft_width=4)
    for rows in (1, 2, 4, 8, 16):
        for k in (1, 2, 3, 4):  # verify: 20 ms + 2 ms per token; the drafter: 1 ms per row
            cost.observe(rows, k, 0.001 * rows if k > 1 else None, 0.02 + 0.002 * rows * k)
    survival = [0.6, 0.4, 0.25]
    sched = draft_schedule(survival, cost, max_rows=16, max_block=4)
    assert sched[0][0] == 1 and sched[0][2] == 3 and sched[-1] == (sched[-1][0], 16, 0)  # full block alone, off when full
    assert all(b[0] == a[1] + 1 for a, b in zip(sched, sched[1:]))  # contiguous, merged
    for first, last, drafted in sched:
        for rows in range(first, last + 1):
            assert choose_block_size(survival, cost, rows, 4)[0] == drafted + 1
    assert draft_schedule([0.0, 0.0, 0.0], cost, max_rows=8, max_block=4) == [(1, 8, 0)]  # never pays
    vllm_utils = pytest.importorskip("vllm.v1.spec_decode.dynamic.utils")
    assert vllm_utils.validate_and_normalize_dynamic_sd_schedule([list(r) for r in sched]) == sched


def test_vllm_ingress_refuses_what_speculation_would_ignore():
    from types import SimpleNamespace as NS

    from serve_app.vllm_app import refusal

    assert refusal(NS(logit_bias={"5": 10}, min_p=0.0), speculative=True) == "logit_bias"
    assert refusal(NS(logit_bias=None, min_p=0.1), speculative=True) == "min_p"
    assert refusal(NS(logit_bias={}, min_p=0.0), speculative=True) is None
    assert refusal(NS(logit_bias={"5": 10}, min_p=0.1), speculative=False) is None  # plain vLLM honours both


# ---------------------------------------------------------------------- metrics + config
def test_prometheus_rendering_parses():
    from prometheus_client.parser import text_string_to_metric_families

    from serve_app.metrics import ReplicaMetrics, render_prometheus

    m = ReplicaMetrics(max_block=4)
    m.cycle(2, 4, [3, 0], 0.01, 0.05, 1.7)
    m.emitted(5)
    m.finished("stop")
    m.drafter = {"source": 'models:/x@"c"', "version": "3"}
    text = render_prometheus({"r1": m.snapshot()}, {("chat", 200): 2})
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("dflash_accepted_length", "dflash_draft_seconds", "dflash_verify_seconds", "dflash_tokens_per_second",
                 "dflash_queue_depth", "dflash_block_size", "dflash_tau", "dflash_http_requests"):
        assert name in fams, name
    acc = {s.labels.get("le"): s.value for s in fams["dflash_accepted_length"].samples if s.name.endswith("_bucket")}
    assert acc["1"] == 1 and acc["4"] == 2 and acc["+Inf"] == 2
    # per-source draft counters: the drafter's default, then a hybrid step of both sources
    m.cycle(3, 8, [7, 1, 0], 0.0, 0.06, 1.5, [("lookup", 7), ("dflash", 7), ("none", 0)])
    fams = {f.name: f for f in text_string_to_metric_families(render_prometheus({"r1": m.snapshot()}))}
    drafted = {s.labels["source"]: s.value for s in fams["dflash_draft_tokens"].samples}
    kept = {s.labels["source"]: s.value for s in fams["dflash_accepted_draft_tokens"].samples}
    assert drafted == {"dflash": 3 + 3 + 7, "lookup": 7} and kept == {"dflash": 3 + 0 + 1, "lookup": 7}



def test_scrape_totals_sums_what_render_prometheus_wrote_over_replicas():
    from serve_app.metrics import ReplicaMetrics, render_prometheus, scrape_totals

    a, b = ReplicaMetrics(max_block=4), ReplicaMetrics(max_block=4)
    a.cycle(2, 4, [3, 0], 0.01, 0.05, 1.7)
    a.emitted(5)
    b.cycle(1, 4, [1], 0.02, 0.04, 1.2, [("lookup", 3)])
    b.emitted(2)
    b.prefill(0.5)
    a.drafter = b.drafter = {"source": "models:/x@champion", "version": "3"}
    t = scrape_totals(render_prometheus({"r1": a.snapshot(), "r2": b.snapshot()}))
    assert t["generated_tokens_total"] == 7 and t["engine_cycles_total"] == 2 and t["replicas"] == 2
    assert t["accepted_length_sum"] == (4 + 1) + 2 and t["accepted_length_count"] == 3
    assert abs(t["draft_seconds_sum"] - 0.03) < 1e-9 and abs(t["verify_seconds_sum"] - 0.09) < 1e-9
    assert t["prefill_seconds_total"] == 0.5
    assert t["draft_tokens_total"] == {"dflash": 6, "lookup": 3} and t["accepted_draft_tokens_total"] == \
        {"dflash": 3, "lookup": 1}
    assert t["drafter_info"] == {"source": "models:/x@champion", "version": "3"}


def test_config_defaults_builder_args_and_yaml():
    cfg = load_config({})
    assert cfg.drafter_source == "models:/dflash-smollm2-135m@champion" and cfg.backend == "hf"
    assert cfg.max_replicas == 2 and cfg.replica_cpus == 1  # fits 2 cores
    cli = load_config({"speculation": "8", "max_replicas": "4", "drafter": "none"})
    assert cli.speculation == 8 and cli.max_replicas == 4 and cli.drafter is None and not cli.speculation_requested
    # the serving mode's values, and its old name refused naming the new one
    assert [load_config({"speculation": v}).speculation for v in ("auto", " OFF", "none", "1", 0, 2)] == \
        ["auto", "off", "off", "off", "off", 2]
    for bad in ("fast", 2.5, True):
        with pytest.raises(ValueError, match="speculation must be 'auto', 'off' or an integer >= 2"):
            load_config({"speculation": bad})
    with pytest.raises(ValueError, match=r"block_size was renamed to speculation \(auto\|off\|N\)"):
        load_config({"block_size": 8})
    # the auto drafter is what the training job registers for the same target (dflash-<slug>)
    from pipelines.train.config import parse_recipe

    hub = load_config({"target": "Qwen/Qwen3-8B"})
    recipe = parse_recipe({"features": {"output": "runs/f", "target": {"model": "Qwen/Qwen3-8B"}},
                           "train": {"run_name": "r", "storage_path": "runs/t"}})
    assert hub.served_model_name == "qwen3-8b"
    assert hub.drafter_source == f"models:/{recipe.model_name}@champion" == "models:/dflash-qwen3-8b@champion"
    assert load_config({"target": "Qwen/Qwen3-8B", "model_name": "Qwen/Qwen3-8B"}).served_model_name == "Qwen/Qwen3-8B"
    with pytest.raises(ValueError):
        load_config({"no_such_field": 1})
    with pytest.raises(ValueError):
        load_config({"min_replicas": 3, "max_replicas": 2})
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load((REPO / "serve_app" / "config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(doc)
    assert schema.http_options.host == "127.0.0.1"
    app = doc["applications"][0]
    assert app["import_path"] == "serve_app:build_app"
    assert isinstance(load_config(app["args"]), ServeConfig)


def test_build_app_composes_paired_replicas_with_the_custom_policy():
    from serve_app import build_app

    app = build_app({"max_replicas": 3, "replica_cpus": 2, "max_batch_size": 8})
    ingress = app._bound_deployment
    replica, hub = (a._bound_deployment for a in ingress.init_args[:2])
    assert (ingress.name, replica.name, hub.name) == ("OpenAIIngress", "DFlashReplica", "MetricsHub")
    auto = replica._deployment_config.autoscaling_config
    assert auto.max_replicas == 3 and auto.min_replicas == 1
    assert auto.policy.policy_function == "serve_app.autoscaling:AcceptanceAwarePolicy"
    assert replica.max_ongoing_requests == 16 and replica.ray_actor_options["num_cpus"] == 2
    assert ingress.ray_actor_options["num_cpus"] == 0


# ---------------------------------------------------------------------------- resources
def test_fit_places_the_minimum_then_grows_and_names_what_to_change():
    """Bundles are placed node by node: the app's minimum must fit (else an error naming the
    numbers and the settings), then autoscaling and a hot swap's surge replica are reported."""
    from serve_app.resources import DeploymentNeed, describe, fit

    engine = DeploymentNeed("Engine", ({"CPU": 1.0},), 1, 3, surge=True)
    ingress = DeploymentNeed("Ingress", ({},), 1, 1, surge=False)
    two = [{"CPU": 2.0}]
    r = fit([engine, ingress], two)
    assert r.fits and r.reachable == {"Engine": 2, "Ingress": 1} and r.surge_fits == {"Engine": True}
    error, warnings = describe(r, [engine, ingress], "replica_cpus")
    assert error is None and warnings == [
        "Engine: autoscaling can reach 2 of max_replicas=3 replicas on this cluster ({CPU: 2}, each replica {CPU: 1})"]
    big = DeploymentNeed("Engine", ({"CPU": 2.0},), 1, 1, surge=True)  # the old default: actor + bundle
    error, warnings = describe(fit([big, ingress], two), [big, ingress], "replica_cpus")
    assert error is None and warnings == ["Engine: a hot swap cannot start a new replica ({CPU: 2}) beside the old "
                                          "one on this cluster ({CPU: 2}) and will wait; set vllm_rollout_surge: "
                                          "false to stop the old one first"]
    pools = [DeploymentNeed(n, ({"CPU": 2.0},), 1, 1, surge=False) for n in ("Spec", "Plain")]
    error, _ = describe(fit(pools, two), pools, "replica_cpus or vllm_plain_pool")
    assert error == ("the app needs {CPU: 4} at its minimum (Spec 1 x {CPU: 2}; Plain 1 x {CPU: 2}) but the "
                     "cluster has {CPU: 2}: it would wait forever to be scheduled. Change replica_cpus or "
                     "vllm_plain_pool")
    # per node, not in total: a 2-CPU bundle does not fit on two 1-CPU nodes; a GPU needs a GPU node
    assert not fit([big], [{"CPU": 1.0}, {"CPU": 1.0}]).fits
    gpu = DeploymentNeed("Engine", ({"CPU": 1.0, "GPU": 1.0}, {"GPU": 1.0}), 1, 1, surge=False)
    assert fit([gpu], [{"CPU": 8.0}, {"CPU": 8.0, "GPU": 2.0}]).fits
    assert fit([gpu], [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}]).fits  # PACK may spread
    strict = DeploymentNeed("Engine", gpu.bundles, 1, 1, surge=False, strict=True)  # STRICT_PACK may not
    assert not fit([strict], [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}]).fits
    assert fit([strict], [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 2.0}]).fits


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_builders_check_the_app_against_the_cluster(tiny, monkeypatch, caplog, backend):
    """On a 2-CPU node the defaults fit (an engine replica reserves replica_cpus, Ray Serve LLM's
    replica actor nothing more; the ingress and the hub nothing) and reach max_replicas=2; an
    app that cannot fit at its minimum is refused before anything is deployed."""
    import logging

    from serve_app import build_app, resources

    if backend == "vllm":
        pytest.importorskip("vllm")
    monkeypatch.setattr(resources, "cluster_nodes", lambda: ([{"CPU": 2.0}], "a 2-CPU node"))
    root, target = tiny
    base = {"backend": backend, "target": str(tiny_target_dir(root))}
    # the handler on the logger itself: Ray's logging set-up may stop records propagating to root
    logger = logging.getLogger("serve_app.resources")
    logger.addHandler(caplog.handler)
    monkeypatch.setattr(logger, "level", logging.WARNING)
    app = build_app(base)
    assert not [r for r in caplog.records if r.name == "serve_app.resources"], caplog.text
    needs = {n.name: n for n in resources.deployment_needs(app)}
    engine = next(n for name, n in needs.items() if name.startswith(("DFlashReplica", "DFlashLLMServer")))
    assert engine.per_replica == {"CPU": 1.0} and (engine.min_replicas, engine.max_replicas) == (1, 2)
    assert all(n.per_replica == {} for n in needs.values() if n is not engine)  # ingress and hub
    with pytest.raises(resources.AppDoesNotFit, match=r"^the app needs \{CPU: 3\} at its minimum .* but the "
                                                      r"cluster has \{CPU: 2\}.* Change replica_cpus"):
        build_app(base | {"min_replicas": 3, "max_replicas": 3})
    build_app(base | {"replica_cpus": 1.5})
    logger.removeHandler(caplog.handler)
    assert "autoscaling can reach 1 of max_replicas=2" in caplog.text


def _documented_serve_runs() -> list[tuple[str, dict]]:
    """(where, builder args) of every ``serve run serve_app:...`` in README.md and docs/serving.md."""
    from test_docs import REPO, commands, split_doc

    found = []
    for path in (REPO / "README.md", REPO / "docs" / "serving.md"):
        for snippet in split_doc(path)[1]:
            for where, tokens in commands(snippet):
                if tokens[:2] == ["serve", "run"] and len(tokens) > 2 and tokens[2].startswith("serve_app:"):
                    found.append((where, dict(t.split("=", 1) for t in tokens[3:] if "=" in t)))
    return found


def test_documented_serve_run_commands_fit_a_2_cpu_node(monkeypatch):
    """Every documented ``serve run serve_app:...`` builds, and the app it deploys fits one 2-CPU
    node (a 2-GPU node for ``device=cuda``) with room for its second replica and a hot swap's:
    what the builder checks before serving. A placeholder target or drafter (a path that is not
    here, a registry model) becomes the embedded target and its reference drafter, which does not
    change what the app asks for."""
    from pathlib import Path

    from serve_app import build_app, resources

    runs = _documented_serve_runs()
    assert len(runs) >= 8 and any(a.get("backend") == "vllm" for _, a in runs), runs  # the parser finds them
    for where, args in runs:
        if args.get("backend") == "vllm":
            pytest.importorskip("vllm")
        if not Path(args.get("target", "/")).exists():
            args.pop("target", None)
        if args.get("drafter", "").startswith("models:/") or not Path(args.get("drafter", "/")).exists():
            args.pop("drafter", None)
        gpu = args.get("device") == "cuda"
        node = {"CPU": 8.0, "GPU": 2.0, f"accelerator_type:{args.get('accelerator_type')}": 1.0} if gpu else {"CPU": 2.0}
        monkeypatch.setattr(resources, "cluster_nodes", lambda node=node: ([node], "one documented node"))
        app = build_app(args)  # raises AppDoesNotFit if it would wait forever
        needs = resources.deployment_needs(app)
        _, warnings = resources.describe(resources.fit(needs, [node]), needs, "")
        if "max_replicas" not in args:  # at the defaults the second replica and a hot swap's fit too
            assert not warnings, (where, warnings)
