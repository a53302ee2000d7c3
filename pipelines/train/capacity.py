"""Capacity plan of a training recipe: per-GPU memory, step time and data volume, from the
recipe and the target's HF config alone (no weights, no GPU, seconds).

Memory is the sum of what a training step holds at its peak (the start of backward):
frozen target tensors, the drafter's weights, gradients and optimizer state (sharded by
ZeRO stage), the batch's features, the saved activations of every draft layer, the
attention workspace of the chosen kernel and the draft head's logits. The per-token
tensor counts below follow the code (``specdec/drafter.py``, ``specdec/objective.py``);
``tests/test_capacity.py`` measures a CPU step at reduced shapes against them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from specdec.objective import HEAD_CHUNK_ROWS

GIB = 1024**3
TARGET_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "targets"

#: accelerators a plan can be made for: memory (GiB) and dense bf16 peak (TFLOPS)
GPUS = {"h100-80gb": (80, 989.0), "h200": (141, 989.0), "a100-80gb": (80, 312.0), "a100-40gb": (40, 312.0),
        "l40s": (48, 362.0), "b200": (180, 2250.0)}
MFU = 0.4  # model FLOPs utilisation assumed for step time (stated in every plan)
STORED_BUDGET_TB = 20.0  # above this many TB of features, storing them is not the default answer


@dataclass(frozen=True)
class TargetShape:
    """What the plan needs of the target, read from its HF ``config.json``."""
    hidden: int
    layers: int
    vocab: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    params: int
    tied: bool
    source: str

    @classmethod
    def from_hf(cls, cfg: dict, source: str) -> "TargetShape":
        h, n_layers, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
        heads = cfg["num_attention_heads"]
        kv = cfg.get("num_key_value_heads") or heads
        hd = cfg.get("head_dim") or h // heads
        inter = cfg["intermediate_size"]
        tied = bool(cfg.get("tie_word_embeddings", False))
        per_layer = h * (heads * hd) * 2 + h * (kv * hd) * 2 + 3 * h * inter + 2 * h
        if cfg.get("model_type") == "qwen3":
            per_layer += 2 * hd  # q_norm, k_norm
        params = n_layers * per_layer + v * h * (1 if tied else 2) + h
        return cls(h, n_layers, v, inter, heads, kv, hd, params, tied, source)


def target_shape(model: str) -> TargetShape:
    """The target's shape from ``<model>/config.json``; where that directory is not on this
    machine (planning on a laptop for a cluster), from ``configs/targets/<name>.json``."""
    from specdec.target import resolve_target_path

    here = Path(resolve_target_path(model)) / "config.json"
    shipped = TARGET_CONFIGS / f"{Path(str(model)).name}.json"
    for path in (here, shipped):
        if path.is_file():
            name = str(path.relative_to(TARGET_CONFIGS.parents[1]) if path.is_relative_to(TARGET_CONFIGS) else path)
            return TargetShape.from_hf(json.loads(path.read_text()), name)
    raise FileNotFoundError(f"features.target.model: no config.json at {here} nor a shipped shape at {shipped}")


@dataclass
class Plan:
    """A plan's numbers; ``memory`` in bytes per GPU by item, ``notes`` say what was assumed."""
    recipe: str
    gpu: str
    gpu_gib: float
    mode: str
    world: int
    memory: dict[str, float] = field(default_factory=dict)
    step: dict[str, float] = field(default_factory=dict)
    data: dict[str, float] = field(default_factory=dict)
    recommend: str = ""
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def total_gib(self) -> float:
        return sum(self.memory.values()) / GIB

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_gib": self.total_gib}


@dataclass(frozen=True)
class StepShape:
    """The tensors of one training step on one worker."""
    batch: int
    seq: int  # tokens per sequence (train.max_length)
    anchors: int
    block: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    features: int  # target layers fed to fc
    target_hidden: int
    draft_vocab: int
    act_bytes: int  # activation dtype (2: bf16 autocast, 4: fp32)
    feature_bytes: int  # stored feature dtype
    attention: str  # "dense" | "flex"

    @property
    def queries(self) -> int:  # block tokens per sequence
        return self.anchors * self.block

    @property
    def keys(self) -> int:  # context slots + block slots a query row spans
        return self.seq + self.queries

    @property
    def drafter_params(self) -> int:
        h, qd, kvd = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = 2 * h * qd + 2 * h * kvd + 3 * h * self.intermediate + 2 * h + 2 * self.head_dim
        return self.features * self.target_hidden * h + self.layers * per_layer + 2 * h


def activation_bytes(s: StepShape) -> dict[str, float]:
    """Bytes held at the peak of a step by the batch's tensors (per worker)."""
    e, b = s.act_bytes, s.batch
    qd, kvd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    q_tok, c_tok = b * s.queries, b * s.seq
    labelled = b * s.anchors * (s.block - 1)
    out = {"features": c_tok * s.features * s.target_hidden * (s.feature_bytes + e)}  # stored + cast for fc
    # context: fc output and its norm once; per layer k (proj, norm, rope) and v, then the
    # concatenation with the block's k/v and, with GQA, its repeat to every head
    ctx_layer = c_tok * kvd * 3 + b * s.keys * kvd * 2 + (b * s.keys * qd * 2 if s.kv_heads != s.heads else 0)
    out["context"] = e * (2 * c_tok * s.hidden + s.layers * ctx_layer)
    # block tokens, per layer: norms, residuals and projections (6 x H), q (proj, norm, rope,
    # output, reshape: 5 x qd), block k/v (3 x kvd), the MLP's gate, up, silu and product (4 x I)
    per_tok = 5 * s.hidden + 3 * qd + 2 * kvd + 4 * s.intermediate
    out["block_layers"] = e * q_tok * per_tok * s.layers + e * q_tok * s.hidden * 2  # + embeddings, final norm
    out["attention"] = attention_workspace(s)
    # draft head: logits, their float log-softmax and its gradient, for at most
    # HEAD_CHUNK_ROWS rows at a time (recomputed chunks), plus the gathered hidden rows
    out["head_logits"] = min(labelled, HEAD_CHUNK_ROWS) * s.draft_vocab * (e + 4 + 4) + labelled * s.hidden * e
    return out


def attention_workspace(s: StepShape) -> float:
    """What attention keeps beyond its inputs and outputs: a log-sum-exp row per query and
    layer (fused SDPA kernels and compiled flex alike never materialise the scores), plus
    the mask: dense, a (B, Q, T+Q) boolean built once; flex, the block mask's indices.
    (Uncompiled flex would materialise fp32 scores, B x heads x Q x (T+Q) per layer: the
    reason ``specdec/drafter.py`` compiles it.)"""
    b = s.batch
    lse = s.layers * b * s.heads * s.queries * 4
    if s.attention == "dense":
        return lse + b * s.queries * s.keys
    return lse + b * math.ceil(s.queries / 128) * math.ceil(s.keys / 128) * 4 * 2


DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "bfloat16": 2, "bf16": 2, "int8": 1}
PAPER_SAMPLES = 800_000  # the paper's training set, the default size of a plan without prompts.limit
RUNTIME_GIB = 1.5  # CUDA context, kernels and allocator slack per GPU (not a tensor the code makes)


@dataclass(frozen=True)
class PlanOptions:
    """What the recipe does not say about the cluster it will run on."""
    gpu: str = "h100-80gb"
    samples: int | None = None  # training sequences (null: prompts.limit, else the paper's 800K)
    tokens_per_sample: int | None = None  # null: half of train.max_length
    cpus_per_gpu: float = 8.0  # CPUs a node has for each of its GPUs
    stored_budget_tb: float = STORED_BUDGET_TB


def step_shape(recipe, target: TargetShape, on_gpu: bool) -> StepShape:
    """The step of ``recipe`` on one worker, in the kernel and dtype its worker will pick."""
    t, d = recipe.train, recipe.drafter
    bf16 = t.precision == "bf16" or (t.precision == "auto" and on_gpu)
    attention = t.attention if t.attention != "auto" else ("flex" if on_gpu else "dense")
    feature_bytes = 0 if t.online else DTYPE_BYTES[recipe.features.storage.dtype]
    return StepShape(batch=t.batch_size, seq=t.max_length, anchors=t.num_anchors + t.context_anchors,
                     block=d.block_size, layers=d.num_layers, hidden=target.hidden,
                     intermediate=d.intermediate_size or target.intermediate, heads=target.heads,
                     kv_heads=target.kv_heads, head_dim=target.head_dim,
                     features=len(d.layer_ids or recipe.features.layer_ids or []) or recipe.features.num_layers,
                     target_hidden=target.hidden, draft_vocab=d.draft_vocab_size or target.vocab,
                     act_bytes=2 if bf16 else 4, feature_bytes=feature_bytes, attention=attention)


def state_bytes(recipe, s: StepShape, world: int) -> dict[str, float]:
    """Weights, gradients and optimizer state per worker: DDP keeps fp32 weights, grads and
    AdamW moments on every worker; DeepSpeed bf16 keeps bf16 weights and grads (ZeRO-2
    shards the grads, ZeRO-3 the weights too) and shards fp32 master weights + moments."""
    p, t = s.drafter_params, recipe.train
    if t.strategy == "ddp":
        return {"drafter_weights": 4 * p, "gradients": 4 * p, "optimizer": 8 * p}
    w = s.act_bytes
    return {"drafter_weights": w * p / (world if t.zero_stage == 3 else 1), "gradients": w * p / world,
            "optimizer": 12 * p / world, "comm_buckets": 2 * 5e7 * w}


def frozen_target_bytes(recipe, target: TargetShape, s: StepShape) -> dict[str, float]:
    """The target tensors a worker holds: all of it online, else its embedding and LM head
    (the drafter's frozen input and output), plus a reduced head's own copy."""
    b = DTYPE_BYTES[recipe.features.target.dtype]
    out = {"target": b * (target.params if recipe.train.online else target.vocab * target.hidden * (1 if target.tied else 2))}
    if s.draft_vocab != target.vocab:
        out["draft_head"] = b * s.draft_vocab * target.hidden
    if recipe.train.online:  # no-grad forward: a layer's hidden and MLP activations at a time
        out["target_forward"] = b * s.batch * s.seq * (4 * target.hidden + 2 * target.intermediate)
    return out


def plan_memory(recipe, target: TargetShape, s: StepShape, world: int) -> dict[str, float]:
    """Bytes per GPU by item: frozen target, drafter state, the step's activations, runtime."""
    return {**frozen_target_bytes(recipe, target, s), **state_bytes(recipe, s, world), **activation_bytes(s),
            "runtime": RUNTIME_GIB * GIB}


def step_flops(s: StepShape, target: TargetShape, online: bool) -> dict[str, float]:
    """Forward + backward FLOPs of one step per worker (backward = 2 x forward for the
    trained drafter; the frozen head and the target's pass are forward only)."""
    qd, kvd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    q_tok, c_tok = s.batch * s.queries, s.batch * s.seq
    layer = 2 * s.hidden * qd * 2 + 2 * s.hidden * kvd * 2 + 3 * 2 * s.hidden * s.intermediate
    attn = 4 * q_tok * (s.seq / 2 + s.block) * qd  # a block sees, on average, half the context
    drafter = 3 * (q_tok * layer + s.layers * attn + c_tok * (2 * s.features * s.target_hidden * s.hidden
                                                             + s.layers * 4 * s.hidden * kvd))
    head = 2 * 2 * s.batch * s.anchors * (s.block - 1) * s.hidden * s.draft_vocab  # forward + input grad
    out = {"drafter": drafter, "head": head}
    if online:
        out["target"] = 2 * target.params * c_tok
    return out


def data_volume(recipe, target: TargetShape, s: StepShape, opts: PlanOptions) -> dict[str, float]:
    """Stored-mode feature bytes vs online-mode target FLOPs for one pass over the data."""
    from pipelines.features.format import FeatureLayout

    samples = opts.samples or recipe.features.prompts.limit or PAPER_SAMPLES
    tokens = opts.tokens_per_sample or recipe.train.max_length // 2
    storage = recipe.features.storage  # the shards' own planning figure (teacher log-probs included)
    per_token = FeatureLayout(storage.dtype, tuple(range(s.features)), target.hidden,
                              storage.teacher_topk).nominal_bytes_per_token
    return {"samples": samples, "tokens_per_sample": tokens, "feature_bytes_per_token": per_token,
            "feature_bytes": samples * tokens * per_token, "target_flops_per_epoch": 2 * target.params * samples * tokens,
            "steps_per_epoch": math.ceil(samples / (recipe.train.batch_size * recipe.train.min_workers))}


def make_plan(recipe, opts: PlanOptions = PlanOptions(), target: TargetShape | None = None) -> Plan:
    """The capacity plan of ``recipe`` on ``opts.gpu`` (see the module docstring)."""
    if opts.gpu not in GPUS:
        raise ValueError(f"--gpu: one of {', '.join(GPUS)}, got {opts.gpu!r}")
    gib, tflops = GPUS[opts.gpu]
    t = recipe.train
    target = target or target_shape(recipe.features.target.model)
    s = step_shape(recipe, target, on_gpu=t.use_gpu)
    world = t.min_workers
    plan = Plan(recipe=recipe.source, gpu=opts.gpu, gpu_gib=gib, world=world,
                mode="online" if t.online else "streamed" if t.streamed else "stored")
    plan.memory = plan_memory(recipe, target, s, world)
    flops = step_flops(s, target, t.online)
    plan.step = {**{f"{k}_tflop": v / 1e12 for k, v in flops.items()}, "assumed_tflops": tflops * MFU,
                 "seconds": sum(flops.values()) / (tflops * MFU * 1e12),
                 "block_tokens": s.batch * s.queries}
    plan.step["block_tokens_per_s"] = plan.step["block_tokens"] / plan.step["seconds"]
    plan.data = data_volume(recipe, target, s, opts) | stream_sizing(plan, target, s, tflops)
    plan.notes = [f"target shape from {target.source}: {target.params / 1e9:.2f}B parameters",
                  f"drafter: {s.drafter_params / 1e6:.0f}M parameters, {s.layers} layers, B={s.block}, "
                  f"{s.attention} attention, {'bf16' if s.act_bytes == 2 else 'fp32'} activations",
                  f"step time at {MFU:.0%} of {tflops:.0f} TFLOPS; data: {plan.data['samples']:,} samples x "
                  f"{plan.data['tokens_per_sample']:,} tokens"]
    plan.recommend, why = recommend(plan, recipe, target, s, opts)
    plan.notes.append(why)
    if "streamed" in (plan.mode, plan.recommend):
        plan.notes.append(f"streamed: {plan.data['stream_actors']} target actors (a GPU each, "
                          f"{plan.data['stream_actor_tokens_per_s']:,.0f} tokens/s) feed {world} trainers "
                          f"({plan.data['stream_tokens_per_s']:,.0f} tokens/s): train.stream.actors")
    plan.warnings = warnings(plan, recipe, opts)
    return plan


def stream_sizing(plan: Plan, target: TargetShape, s: StepShape, tflops: float) -> dict[str, float]:
    """Streamed features: the target tokens per second the trainers consume at the planned
    step time, what one target actor on a GPU of the same kind produces (a forward pass at
    the same MFU), and the actors that keep the trainers fed."""
    need = plan.world * s.batch * s.seq / plan.step["seconds"]
    per_actor = tflops * MFU * 1e12 / (2 * target.params)
    return {"stream_tokens_per_s": need, "stream_actor_tokens_per_s": per_actor,
            "stream_actors": math.ceil(need / per_actor)}


def recommend(plan: Plan, recipe, target: TargetShape, s: StepShape, opts: PlanOptions) -> tuple[str, str]:
    """stored / online / streamed, and why: storing is cheapest while the features fit the
    storage budget (the target runs once, every epoch re-reads); past it, online features
    if the whole target fits beside the training state, else streamed target actors."""
    tb = plan.data["feature_bytes"] / 1e12
    if tb <= opts.stored_budget_tb:
        return "stored", f"stored: {tb:.1f} TB of features <= the {opts.stored_budget_tb:g} TB budget"
    online_extra = DTYPE_BYTES[recipe.features.target.dtype] * target.params if not recipe.train.online else 0
    online_gib = plan.total_gib + online_extra / GIB
    if online_gib <= 0.9 * plan.gpu_gib:
        return "online", (f"online: {tb:.0f} TB of features is past the {opts.stored_budget_tb:g} TB budget and the "
                          f"target fits beside the drafter ({online_gib:.0f} of {plan.gpu_gib} GiB)")
    return "streamed", (f"streamed: {tb:.0f} TB of features is past the budget and the target does not fit beside "
                        f"the drafter ({online_gib:.0f} of {plan.gpu_gib} GiB); target actors on their own GPUs")


def warnings(plan: Plan, recipe, opts: PlanOptions) -> list[str]:
    """What will fail or starve before it runs."""
    t, out = recipe.train, []
    if plan.total_gib > plan.gpu_gib:
        out.append(f"does not fit: {plan.total_gib:.1f} GiB per GPU > {plan.gpu_gib} GiB ({opts.gpu})")
    elif plan.total_gib > 0.9 * plan.gpu_gib:
        out.append(f"tight: {plan.total_gib:.1f} GiB of {plan.gpu_gib} GiB leaves < 10% for fragmentation")
    if t.streamed and t.stream.actors < plan.data["stream_actors"]:
        n = t.stream.actors
        out.append(f"train.stream.actors: {n} target actor{'s produce' if n != 1 else ' produces'} "
                   f"~{n * plan.data['stream_actor_tokens_per_s']:,.0f} tokens/s, the {plan.world} trainers consume "
                   f"{plan.data['stream_tokens_per_s']:,.0f}: they will wait; set it to {plan.data['stream_actors']}")
    if t.use_gpu and t.cpus_per_worker > opts.cpus_per_gpu - 2:
        out.append(f"train.cpus_per_worker {t.cpus_per_worker:g} leaves < 2 of a node's {opts.cpus_per_gpu:g} CPUs per "
                   f"GPU to Ray Data's feature reads, which then run elsewhere and cross the network; "
                   f"set it to {max(1, opts.cpus_per_gpu - 2):g}")
    return out


def format_plan(plan: Plan) -> str:
    """The plan as the table ``jobs/train_drafter.py --plan`` prints."""
    rows = [f"capacity plan: {plan.recipe} on {plan.gpu} ({plan.gpu_gib} GiB), {plan.world} workers, "
            f"{plan.mode} features", "", f"{'per GPU':<22}{'GiB':>10}"]
    rows += [f"  {k:<20}{v / GIB:>10.2f}" for k, v in plan.memory.items()]
    rows += [f"  {'total':<20}{plan.total_gib:>10.2f}   of {plan.gpu_gib} GiB "
             f"({plan.total_gib / plan.gpu_gib:.0%})", ""]
    st, d = plan.step, plan.data
    rows += [f"step: {st['seconds']:.2f} s at {st['assumed_tflops']:.0f} TFLOPS "
             f"({', '.join(f'{k[:-6]} {v:.1f}' for k, v in st.items() if k.endswith('_tflop'))} TFLOP), "
             f"{st['block_tokens_per_s']:,.0f} block tokens/s per GPU",
             f"data: stored features {d['feature_bytes'] / 1e12:.2f} TB ({d['feature_bytes_per_token'] / 1e3:.1f} KB/token) "
             f"vs online target {d['target_flops_per_epoch'] / 1e18:.1f} EFLOP per epoch "
             f"({d['target_flops_per_epoch'] / (st['assumed_tflops'] * 1e12) / 3600:,.0f} GPU-hours); "
             f"{d['steps_per_epoch']:,} steps per epoch", f"recommended: {plan.recommend}", ""]
    rows += [f"note: {n}" for n in plan.notes] + [f"WARNING: {w}" for w in plan.warnings]
    return "\n".join(rows)
