"""The target adapter on tiny families and on the embedded SmolLM2."""

import pytest
import torch

from specdec import kvcache
from specdec.engine import Engine, Request
from specdec.proposers import DFlashProposer, OracleProposer
from specdec.checkpoint_format import choose_mask_token_id
from specdec.tiny import random_drafter

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_features_are_hf_hidden_states_and_embed_matches(tiny, family):
    t = tiny(family)
    ids = torch.tensor([[1, 5, 9, 33, 7]])
    ref = t.model(ids, output_hidden_states=True)
    out = t(ids, torch.arange(5)[None], layer_ids=[0, 2, 4])
    want = torch.cat([ref.hidden_states[i + 1] for i in (0, 2, 4)], -1)
    torch.testing.assert_close(out.features, want)
    torch.testing.assert_close(t.logits(out.hidden), ref.logits)
    # the drafter path embeds exactly as the target does (Gemma scales by sqrt(hidden))
    torch.testing.assert_close(t.embed(ids), ref.hidden_states[0])


def test_identity_changes_with_weights(tiny):
    from specdec.tiny import tiny_target

    from specdec.target import Target

    a, b = tiny_target("llama", seed=0), tiny_target("llama", seed=0)
    assert a.identity == b.identity
    # the same weights served in another dtype keep their identity
    assert Target(tiny_target("llama", seed=0).model.to(torch.bfloat16)).identity == a.identity
    with torch.no_grad():
        b.layers[3].mlp.up_proj.weight[0, 0] += 1.0
    b._identity = None
    assert a.identity != b.identity


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_saved_model_files_are_save_pretrained_s_byte_for_byte(tmp_path, family):
    """specdec.target.save_model_files (GGUF conversion, tiny targets) writes the files
    save_pretrained writes, tied embeddings stored once (gemma), without importing DeepSpeed
    (save_pretrained's unwrap step does, 7 s of CPU, wherever it is installed)."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from specdec.target import save_model_files
    from specdec.tiny import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, vocab_size=256), dtype=torch.float32)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    save_model_files(model, tmp_path / "ours")
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    if family != "llama":
        return
    code = ("import sys; from specdec.tiny import save_tiny_target; save_tiny_target(sys.argv[1], num_layers=1); "
            "print('deepspeed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tiny")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]


def test_smollm2_loads_from_the_embedded_package(smollm2):
    t = smollm2
    assert (t.num_layers, t.hidden_size, t.vocab_size) == (30, 576, 49152)
    assert 2 in t.stop_token_ids()  # <|im_end|>
    ids = t.encode_chat([{"role": "user", "content": "Hi"}])
    assert t.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    mask = choose_mask_token_id(t.tokenizer)
    assert mask not in t.stop_token_ids() and t.tokenizer.convert_ids_to_tokens(mask).startswith("<")
    assert len(t.identity) == 64


@pytest.mark.slow
def test_smollm2_speculative_greedy_equals_target_alone(smollm2):
    t = smollm2
    prompts = [t.encode_chat([{"role": "user", "content": c}]) for c in
               ("Write a haiku about the sea.", "List three prime numbers and explain why they are prime.")]
    n = 40
    hf = [t.model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
          for p in prompts]
    ar = [r.tokens for r in Engine(t).generate([Request(p, n) for p in prompts])]
    assert ar == hf
    drafter = random_drafter(t, block_size=16, layers=1, mask_token_id=choose_mask_token_id(t.tokenizer))
    spec = Engine(t, DFlashProposer(drafter.float(), t), width=16).generate([Request(p, n) for p in prompts])
    assert [r.tokens for r in spec] == hf
    orc = Engine(t, OracleProposer(), width=16).generate([Request(p, n, oracle=h) for p, h in zip(prompts, hf)])
    assert [r.tokens for r in orc] == hf
    assert all(r.stats.tau > 8 for r in orc)


def test_attention_mask_shapes():
    m = kvcache.attention_mask(torch.tensor([2, 4]), past=4, q_len=3, causal=True)
    assert m.shape == (2, 1, 3, 7)
    assert m[0, 0, 0].tolist() == [True, True, False, False, True, False, False]
    assert m[1, 0, 2].tolist() == [True] * 7
    b = kvcache.attention_mask(torch.tensor([1]), past=2, q_len=2, causal=False)
    assert b[0, 0, 0].tolist() == [True, False, True, True]
