"""Evaluate a drafter version against the current champion, promote it, roll back, list
(library side of ``jobs/promote_drafter.py``; no Ray needed, runs anywhere the registry
and the target can be reached).

Registry layout (MLflow 3 aliases, no stages): every trained drafter is a version of
``dflash-<target slug>``; ``@champion`` is what serving follows (``models:/<name>@champion``),
``@previous`` is the champion it replaced (what ``rollback`` restores).

One evaluation = one side-by-side measurement with the real engine in ONE process:
``ar`` (the target alone), the champion's drafter and the challenger's drafter, interleaved
prompt by prompt (the order rotates), greedy, exactly ``max_new_tokens`` per prompt, so
machine noise hits every method alike. Per drafter: exactness (greedy token identity with
``ar`` on every prompt), tau (mean tokens committed per cycle) and the measured speedup
(tokens/s over ar's tokens/s). The evaluation is an MLflow run (experiment
``<model>-promotion``; metrics, ``eval/benchmark.json`` in the engine benchmark's schema,
``eval/benchmark.png``, ``eval/decision.json``) tagged with the model versions; each
measured version gets the summary as ``eval.*`` tags, the challenger the decision as
``promotion.*`` tags.

Decision rule (:func:`decide`):

1. the challenger must be exact (greedy output identical to ``ar`` on every prompt);
2. no champion yet: the bar is the target alone (AR): the challenger becomes champion only
   if its measured speedup is ``>= 1 + margin``, so promotion never makes serving slower
   than no drafter at all; a refused first version stays registered, without an alias;
3. otherwise the challenger's ``metric`` (``speedup`` by default, or ``tau``) must beat the
   champion's, measured in the same run, by the relative ``margin``:
   ``challenger >= champion * (1 + margin)`` (default margin 0.02 = 2%).

Alias moves are all-or-nothing as far as the user can see: the registry is checked and
everything is read before anything is written; then ``@previous`` <- old champion, then
``@champion`` <- challenger; if the second write fails the first is undone. Serving only
reads ``@champion``, so there is no moment where it points at a version that was not
decided on.

Lineage: a version must carry ``target_identity`` (the target's weights fingerprint,
written by training, see pipelines/registry.py ``LINEAGE_KEYS``). The model's target is
pinned by the registered-model tag ``target_identity`` (set at the first promotion) or the
champion's tag; a version for another target is refused with an error naming
``target_identity`` before anything is measured, and the drafter checkpoint itself is
checked again when loaded (``specdec.checkpoint.load_drafter(target=...)``).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipelines import registry

log = logging.getLogger(__name__)

CHAMPION, PREVIOUS = "champion", "previous"
METRICS = ("speedup", "tau")
DEFAULT_METRIC = "speedup"
DEFAULT_MARGIN = 0.02  # relative: the challenger must be >= 2% better than the champion
EVAL_TAG_PREFIX = "eval."
DECISION_TAG_PREFIX = "promotion."


# ============================================================================ errors
class PromoteError(RuntimeError):
    """A usage or registry problem (exit code 2)."""


class RegistryUnreachable(PromoteError):
    """The tracking/registry server does not answer; nothing was changed."""


class Refused(RuntimeError):
    """A decision not to promote (or not to roll back), with the reason (exit code 1)."""


class TargetMismatch(Refused):
    """A version whose lineage names another target; the message names ``target_identity``."""


class RefusedWithOutcome(Refused):
    """A refusal after a completed evaluation; ``outcome`` carries the numbers."""

    def __init__(self, reason: str, outcome: "Outcome"):
        super().__init__(reason)
        self.outcome = outcome


# ============================================================================ registry access
def check_reachable(tracking_uri: str, timeout_s: float = 5.0) -> None:
    """Raise ``RegistryUnreachable`` unless the registry answers. HTTP servers are asked
    for ``/health`` once, with a short timeout (MLflow's own client would retry for
    minutes); local stores (sqlite, file) need their directory to exist."""
    if tracking_uri.startswith(("http://", "https://")):
        url = tracking_uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                resp.read(64)
        except urllib.error.HTTPError as e:
            if e.code >= 500:  # a proxy in front of a dead server
                raise RegistryUnreachable(f"registry at {tracking_uri} unreachable: HTTP {e.code} from {url}") from None
            # 4xx (auth, no /health route): the server is there; API calls will say more
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            raise RegistryUnreachable(f"registry at {tracking_uri} unreachable: {reason}") from None
        return
    for prefix in ("sqlite:///", "file://"):
        if tracking_uri.startswith(prefix):
            path = Path(tracking_uri[len(prefix):])
            where = path.parent if prefix == "sqlite:///" else path
            if not where.exists():
                raise RegistryUnreachable(f"registry at {tracking_uri} unreachable: {where} does not exist")
            if prefix == "sqlite:///" and not path.exists():
                raise RegistryUnreachable(f"registry at {tracking_uri} unreachable: no database at {path} "
                                          "(train and register a drafter first, or pass --tracking-uri)")


def _registry_call(tracking_uri: str, what: str, fn):
    """Run one registry call; connection problems become ``RegistryUnreachable``, other
    MLflow errors ``PromoteError`` (both say which registry and what was being done)."""
    from mlflow.exceptions import MlflowException

    try:
        return fn()
    except MlflowException as e:
        msg = str(e.message if hasattr(e, "message") else e)
        if any(s in msg for s in ("Max retries exceeded", "Connection refused", "ConnectionError",
                                  "Failed to establish", "timed out")):
            raise RegistryUnreachable(f"registry at {tracking_uri} unreachable while {what}: "
                                      f"{msg.splitlines()[0]}") from None
        raise PromoteError(f"registry at {tracking_uri}: {what} failed: {msg.splitlines()[0]}") from None
    except OSError as e:  # requests' ConnectionError is an OSError
        raise RegistryUnreachable(f"registry at {tracking_uri} unreachable while {what}: {e}") from None


@dataclass
class ModelState:
    """What the registry holds for one model, read once before any decision."""

    name: str
    aliases: dict[str, str]  # alias -> version
    versions: dict[str, object]  # version -> ModelVersion (tags, run_id, source, ...)
    tags: dict[str, str]

    @property
    def champion(self) -> str | None:
        return self.aliases.get(CHAMPION)

    @property
    def previous(self) -> str | None:
        return self.aliases.get(PREVIOUS)

    def aliases_of(self, version: str) -> list[str]:
        return sorted(a for a, v in self.aliases.items() if v == version)

    def latest(self) -> str | None:
        return max(self.versions, key=int) if self.versions else None


def read_model(tracking_uri: str, name: str) -> ModelState:
    """Aliases, versions and tags of registered model ``name`` (PromoteError if absent)."""
    from mlflow.exceptions import MlflowException

    c = registry.client(tracking_uri)

    def get():
        try:
            return c.get_registered_model(name)
        except MlflowException as e:
            if "RESOURCE_DOES_NOT_EXIST" in str(e.error_code) or "not found" in str(e).lower():
                return None
            raise

    rm = _registry_call(tracking_uri, f"reading model {name}", get)
    if rm is None:
        raise PromoteError(f"registry at {tracking_uri} has no model {name!r} (train and register a drafter "
                           "first: jobs/train_drafter.py; or check --model / --target)")
    versions = _registry_call(tracking_uri, f"listing versions of {name}",
                              lambda: list(c.search_model_versions(f"name='{name}'")))
    return ModelState(name=name, aliases={a: str(v) for a, v in (rm.aliases or {}).items()},
                      versions={str(mv.version): mv for mv in versions}, tags=dict(rm.tags or {}))


def resolve_version(state: ModelState, spec: str | None) -> str:
    """``latest`` (default), a version number, or an alias (``champion``, ``@previous``)."""
    spec = (spec or "latest").strip()
    if spec == "latest":
        v = state.latest()
        if v is None:
            raise PromoteError(f"model {state.name!r} has no versions")
        return v
    alias = spec.removeprefix("@")
    if alias in state.aliases:
        return state.aliases[alias]
    if spec.removeprefix("v").isdigit() and spec.removeprefix("v") in state.versions:
        return spec.removeprefix("v")
    have = ", ".join(sorted(state.versions, key=int)) or "none"
    raise PromoteError(f"model {state.name!r} has no version or alias {spec!r} (versions: {have}; "
                       f"aliases: {', '.join(f'@{a}' for a in sorted(state.aliases)) or 'none'})")


def set_aliases(tracking_uri: str, name: str, moves: list[tuple[str, str]], before: dict[str, str | None]) -> None:
    """Apply alias moves in order; if one fails, undo the ones already made (restore each
    alias to ``before[alias]``, deleting it where it did not exist) and raise
    ``PromoteError`` saying what state the aliases are in."""
    c = registry.client(tracking_uri)
    done: list[str] = []
    for alias, version in moves:
        try:
            _registry_call(tracking_uri, f"setting @{alias} -> {version}",
                           lambda: c.set_registered_model_alias(name, alias, str(version)))
        except PromoteError as e:
            failed_undo = []
            for a in reversed(done):
                old = before.get(a)
                try:
                    if old is None:
                        c.delete_registered_model_alias(name, a)
                    else:
                        c.set_registered_model_alias(name, a, str(old))
                except Exception as undo_error:  # noqa: BLE001 - report below
                    failed_undo.append(f"@{a} (should be {old or 'unset'}: {undo_error})")
            state = ("aliases restored: " + ", ".join(f"@{a}={before.get(a) or 'unset'}" for a in done)
                     if done and not failed_undo else "no alias was changed" if not done else
                     "COULD NOT RESTORE " + "; ".join(failed_undo) + " - fix by hand with set_registered_model_alias")
            raise type(e)(f"{e}; {state}") from None
        done.append(alias)


# ============================================================================ lineage
def _short(identity: str | None) -> str:
    return f"{identity[:12]}.." if identity else "-"


def reference_identity(state: ModelState) -> tuple[str | None, str]:
    """The target identity this model is for, and where that came from."""
    if state.tags.get("target_identity"):
        return state.tags["target_identity"], f"model {state.name} (tag target_identity)"
    if state.champion and state.champion in state.versions:
        tid = state.versions[state.champion].tags.get("target_identity")
        if tid:
            return tid, f"@{CHAMPION} v{state.champion}"
    return None, ""


def check_lineage(state: ModelState, version: str) -> str:
    """The version's target identity; refuses versions without one or for another target."""
    mv = state.versions[version]
    tid = mv.tags.get("target_identity")
    if not tid:
        raise TargetMismatch(f"{state.name} v{version} has no target_identity tag (no lineage): cannot tell which "
                             "target it was trained for; register it with lineage tags (pipelines.registry."
                             "lineage_tags) before promoting it")
    ref, where = reference_identity(state)
    if ref and ref != tid:
        raise TargetMismatch(
            f"{state.name} v{version} was trained for target_identity {_short(tid)} "
            f"(target_model {mv.tags.get('target_model', '?')}) but {where} is for target_identity {_short(ref)} "
            f"({state.tags.get('target_model') or _champion_tag(state, 'target_model') or '?'}): target_identity "
            "differs, refusing to promote a drafter of another target")
    return tid


def _champion_tag(state: ModelState, key: str) -> str | None:
    if state.champion and state.champion in state.versions:
        return state.versions[state.champion].tags.get(key)
    return None


def check_target(target, expected_identity: str, what: str, target_ref: str | None, dtype: str) -> None:
    if target.identity != expected_identity:
        raise TargetMismatch(
            f"{what} was trained for target_identity {_short(expected_identity)} but the target "
            f"{target_ref or 'smollm2-135m (embedded default)'} loaded as {dtype} has target_identity "
            f"{_short(target.identity)}: target_identity differs (another model, other weights, or another "
            "--target-dtype than training used)")


# ============================================================================ measurement
@dataclass
class Candidate:
    """A drafter under evaluation."""

    label: str  # method name in the report, e.g. "dflash:v3"
    role: str  # "champion" | "challenger"
    version: str
    drafter: object
    block_size: int


@dataclass
class _Acc:
    wall: float = 0.0
    tokens: int = 0
    cycles: int = 0
    draft: float | None = None
    verify: float | None = None
    accepted: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)


def measure(target, candidates: list[Candidate], prompts: list[list[int]], prompt_ids: list[str],
            max_new_tokens: int, prompts_source: str, batch_size: int = 1, seed: int = 0,
            warmup_tokens: int = 8) -> dict:
    """``ar`` and every candidate on the same prompts in this process, interleaved batch by
    batch (the order rotates), greedy, exactly ``max_new_tokens`` tokens per prompt.
    Returns a report in the engine benchmark's schema (``specdec.bench``): ``config``,
    ``results`` (one per method: tokens_per_s, speedup_vs_ar, tau_mean, tau_hist, draft_s,
    verify_s, overhead_s), ``exactness`` (greedy identity with ar per method) and
    ``cost_terms`` (tau vs r_d + r_v + r_o), plus ``versions`` (label -> version, role)."""
    from specdec.bench import machine_info, run_engine
    from specdec.engine import DFlashProposer
    from specdec.sampling import GREEDY

    stop = frozenset()  # ignore EOS: every method generates exactly max_new_tokens
    methods = ["ar"] + [c.label for c in candidates]
    by_label = {c.label: c for c in candidates}

    def one(method: str, batch: list[list[int]], n: int, s: int):
        if method == "ar":
            return run_engine(target, batch, n, GREEDY, None, 16, s, stop)[1]
        c = by_label[method]
        return run_engine(target, batch, n, GREEDY, DFlashProposer(c.drafter, target), c.block_size, s, stop)[1]

    warm = min(warmup_tokens, max_new_tokens)
    for m in methods:  # allocator, kernels, lazy init
        one(m, prompts[:batch_size], warm, seed)
    acc = {m: _Acc() for m in methods}
    batches = [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]
    for b, batch in enumerate(batches):
        r = b % len(methods)
        for m in methods[r:] + methods[:r]:
            run = one(m, batch, max_new_tokens, seed + 1000 * b)
            a = acc[m]
            a.wall += run.wall_s
            a.tokens += sum(len(t) for t in run.tokens)
            a.outputs += run.tokens
            a.cycles += run.cycles
            if m != "ar":
                a.draft = (a.draft or 0.0) + run.draft_s
                a.verify = (a.verify or 0.0) + run.verify_s
            a.accepted += run.accepted

    ar = acc["ar"]
    ar_tps = ar.tokens / ar.wall if ar.wall else float("nan")
    results, equal, first_bad, cost = [], {}, {}, {}
    L = ar.wall / ar.cycles if ar.cycles else None
    if L:
        cost["L_ar_s"] = L
    for m in methods:
        a = acc[m]
        tps = a.tokens / a.wall if a.wall else 0.0
        spec = m != "ar"
        hist = Counter(x + 1 for x in a.accepted) if spec and a.accepted else None
        tau = (sum(a.accepted) / len(a.accepted) + 1) if hist else None
        c = by_label.get(m)
        results.append({
            "method": m, "version": c.version if c else None, "role": c.role if c else "reference",
            "block_size": c.block_size if c else None, "tokens_per_s": float(tps),
            "speedup_vs_ar": float(tps / ar_tps) if ar_tps else float("nan"), "tau_mean": tau,
            "tau_hist": {str(k): int(hist[k]) for k in sorted(hist)} if hist else None,
            "draft_s": a.draft if spec else None, "verify_s": a.verify if spec else None,
            "overhead_s": (a.wall - a.draft - a.verify) if spec and a.draft is not None else None,
        })
        if spec:
            bad = [(i, next((j for j, (x, y) in enumerate(zip(o, r)) if x != y), min(len(o), len(r))))
                   for i, (o, r) in enumerate(zip(a.outputs, ar.outputs)) if o != r]
            equal[m] = not bad and len(a.outputs) == len(ar.outputs)
            first_bad[m] = list(bad[0]) if bad else None
            if L and a.cycles and tau is not None:
                r_d, r_v = a.draft / a.cycles / L, a.verify / a.cycles / L
                r_o = (a.wall - a.draft - a.verify) / a.cycles / L
                cost[m] = {"tau": tau, "r_d": r_d, "r_v": r_v, "r_o": r_o, "cycles": a.cycles,
                           "predicted_speedup": tau / (r_d + r_v + r_o)}
    config = {
        "target_id": target.model_id, "target_identity": target.identity, "prompts": prompts_source,
        "num_prompts": len(prompts), "num_prompts_used": len(prompts), "prompt_ids": prompt_ids,
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts), "max_new_tokens": max_new_tokens,
        "batch_size": batch_size, "temperature": 0.0, "seed": seed, "methods": methods,
        "eos": "ignored (exactly max_new_tokens per prompt)",
        "order": "interleaved: per batch every method in turn, order rotating from batch to batch",
        "overhead_definition": "wall - draft - verify (prefill, acceptance, bookkeeping)",
        "machine": machine_info(), "notes": [],
    }
    return {"config": config, "results": results,
            "exactness": {"reference": "ar", "applicable": True, "equal": equal, "first_mismatch": first_bad},
            "cost_terms": cost,
            "versions": {c.label: {"version": c.version, "role": c.role} for c in candidates}}


# ============================================================================ evaluation
@dataclass
class Evaluation:
    """One version's numbers from one side-by-side run."""

    version: str
    role: str
    exact: bool
    tau: float | None
    speedup: float
    tokens_per_s: float
    ar_tokens_per_s: float
    first_mismatch: list[int] | None = None  # [prompt index, token index]
    run_id: str | None = None

    def metric(self, name: str) -> float:
        value = {"speedup": self.speedup, "tau": self.tau}[name]
        return float("nan") if value is None else float(value)


def evaluations_from_report(report: dict) -> dict[str, Evaluation]:
    """role -> Evaluation, read from a ``measure`` report."""
    ar = next(r for r in report["results"] if r["method"] == "ar")
    out = {}
    for r in report["results"]:
        if r["method"] == "ar":
            continue
        out[r["role"]] = Evaluation(
            version=r["version"], role=r["role"], exact=bool(report["exactness"]["equal"][r["method"]]),
            tau=r["tau_mean"], speedup=r["speedup_vs_ar"], tokens_per_s=r["tokens_per_s"],
            ar_tokens_per_s=ar["tokens_per_s"], first_mismatch=report["exactness"]["first_mismatch"][r["method"]])
    return out


@dataclass
class Decision:
    promote: bool
    reason: str
    metric: str
    margin: float


def decide(challenger: Evaluation, champion: Evaluation | None, metric: str = DEFAULT_METRIC,
           margin: float = DEFAULT_MARGIN) -> Decision:
    """The promotion rule (see the module docstring); pure, so it is tested directly."""
    if metric not in METRICS:
        raise PromoteError(f"--metric must be one of {', '.join(METRICS)}, got {metric!r}")
    if margin < 0:
        raise PromoteError(f"--margin must be >= 0, got {margin}")
    d = lambda ok, why: Decision(ok, why, metric, margin)  # noqa: E731
    if not challenger.exact:
        where = (f" (first mismatch at prompt {challenger.first_mismatch[0]}, token {challenger.first_mismatch[1]})"
                 if challenger.first_mismatch else "")
        return d(False, f"v{challenger.version} is not exact: its greedy output differs from the target alone{where}; "
                        "an inexact drafter is never promoted")
    if champion is None:  # the bar is the target alone: serving must not get slower
        need = 1 + margin
        cmp = (f"speedup {challenger.speedup:.3f}x vs the target alone (no @{CHAMPION} yet; margin {margin:.0%} "
               f"needs >= {need:.3f}x), tau {_fmt(challenger.tau)}")
        if challenger.speedup >= need:
            return d(True, f"v{challenger.version} is exact and faster than the target alone: {cmp}")
        return d(False, f"v{challenger.version} is exact but not faster than the target alone: {cmp}")
    if champion.version == challenger.version:
        return d(False, f"v{challenger.version} is already @{CHAMPION}")
    new, old = challenger.metric(metric), champion.metric(metric)
    need = old * (1 + margin)
    unit = "x" if metric == "speedup" else ""
    gain = (new / old - 1) if old else float("inf")
    cmp = (f"{metric} {new:.3f}{unit} vs champion v{champion.version}'s {old:.3f}{unit} "
           f"({gain:+.1%}; margin {margin:.0%} needs >= {need:.3f}{unit})")
    if not champion.exact:
        cmp += f"; note: champion v{champion.version} measured inexact in this run"
    if new >= need:
        return d(True, f"v{challenger.version} is exact and better: {cmp}")
    return d(False, f"v{challenger.version} is exact but not better by the margin: {cmp}")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


# ============================================================================ the job
@dataclass
class PromoteConfig:
    tracking_uri: str | None = None
    model: str | None = None  # None: dflash-<slug of target>
    target: str | None = None  # None: the model's lineage (target_model tag), else the embedded default
    target_dtype: str = "float32"
    challenger: str = "latest"
    prompts: str = "sharegpt"  # sharegpt (holdout split) | humaneval | a path
    num_prompts: int = 8
    max_new_tokens: int = 64
    block_size: int | None = None  # None: each drafter's own block size
    batch_size: int = 1
    margin: float = DEFAULT_MARGIN
    metric: str = DEFAULT_METRIC
    dry_run: bool = False
    experiment: str | None = None  # None: <model>-promotion
    seed: int = 0
    out: str | None = None  # also keep benchmark.json/png in this directory

    def __post_init__(self):
        if self.metric not in METRICS:
            raise PromoteError(f"--metric must be one of {', '.join(METRICS)}, got {self.metric!r}")
        if self.margin < 0:
            raise PromoteError(f"--margin must be >= 0, got {self.margin}")
        for name in ("num_prompts", "max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise PromoteError(f"--{name.replace('_', '-')} must be >= 1")
        if self.block_size is not None and self.block_size < 2:
            raise PromoteError("--block-size must be >= 2")
        if self.target_dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise PromoteError(f"--target-dtype: unknown dtype {self.target_dtype!r}")

    @property
    def model_name(self) -> str:
        return model_name(self.model, self.target)


def model_name(model: str | None, target: str | None) -> str:
    """``--model`` as given, else ``dflash-<slug>`` of ``--target`` exactly as training names it."""
    if model:
        return model
    from specdec.target import target_slug

    return f"dflash-{target_slug(target)}"


@dataclass
class Outcome:
    model: str
    tracking_uri: str
    challenger: str
    champion_before: str | None
    previous_before: str | None
    decision: Decision
    evaluations: dict[str, Evaluation]
    run_id: str | None
    report: dict
    promoted: bool
    dry_run: bool
    aliases_after: dict[str, str]
    experiment: str = ""

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("report")
        return d


def _download(tracking_uri: str, name: str, version: str, dst: Path) -> Path:
    import mlflow

    dst.mkdir(parents=True, exist_ok=True)
    # resolve the version's source through OUR client: mlflow's "models:/" download resolves
    # the name against the process-wide registry URI, ignoring registry_uri (MLflow 3.17)
    source = _registry_call(tracking_uri, f"resolving {name} v{version}", lambda: registry.client(
        tracking_uri).get_model_version_download_uri(name, version))
    _registry_call(tracking_uri, f"downloading {name} v{version} from {source}",
                   lambda: mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(dst),
                                                               tracking_uri=tracking_uri))
    for cand in [dst, *sorted(p.parent for p in dst.rglob("config.json"))]:
        if (cand / "config.json").is_file() and (cand / "model.safetensors").is_file():
            return cand
    raise PromoteError(f"{name} v{version}: its artifact ({dst}) holds no drafter (config.json + model.safetensors)")


def _load_target(cfg: PromoteConfig, ref: str | None):
    from specdec.target import load_target

    if ref and (ref.startswith((".", "/", "~")) or os.sep in ref) and not Path(ref).expanduser().exists():
        raise PromoteError(f"target not found: {ref} (from {'--target' if cfg.target else 'the lineage tag target_model'}"
                           "; pass --target PATH)")
    try:
        return load_target(ref, dtype=cfg.target_dtype)
    except (OSError, ValueError) as e:
        raise PromoteError(f"cannot load target {ref!r}: {str(e).splitlines()[0]}") from None


def evaluate(cfg: PromoteConfig, state: ModelState, challenger: str, champion: str | None, workdir: Path):
    """Check lineage, load the target and both drafters, measure side by side.
    Returns (report, target)."""
    from specdec.checkpoint import DrafterMismatchError, load_drafter
    from specdec.bench import BenchError, load_prompt_ids

    name = state.name
    tid = check_lineage(state, challenger)
    if champion:
        check_lineage(state, champion)
    ref = cfg.target or state.tags.get("target_model") or _champion_tag(state, "target_model") \
        or state.versions[challenger].tags.get("target_model")
    target = _load_target(cfg, ref)
    check_target(target, tid, f"{name} v{challenger}", ref, cfg.target_dtype)

    candidates = []
    for role, version in (("champion", champion), ("challenger", challenger)):
        if version is None:
            continue
        path = _download(cfg.tracking_uri, name, version, workdir / f"v{version}")
        try:
            drafter = load_drafter(path, target=target)
        except DrafterMismatchError as e:
            raise TargetMismatch(f"{name} v{version} does not fit the target {ref or 'smollm2-135m'}: {e}") from None
        except (FileNotFoundError, ValueError) as e:
            raise PromoteError(f"{name} v{version}: cannot load its drafter: {e}") from None
        candidates.append(Candidate(f"dflash:v{version}", role, version, drafter,
                                    cfg.block_size or drafter.config.block_size))
    try:
        prompt_ids, prompts = load_prompt_ids(target, cfg.prompts, cfg.num_prompts)
    except BenchError as e:
        raise PromoteError(str(e)) from None
    log.info("measuring ar + %s on %d prompts x %d tokens", ", ".join(c.label for c in candidates),
             len(prompts), cfg.max_new_tokens)
    report = measure(target, candidates, prompts, prompt_ids, cfg.max_new_tokens, cfg.prompts,
                     batch_size=cfg.batch_size, seed=cfg.seed)
    return report, target


def log_evaluation(cfg: PromoteConfig, name: str, report: dict, evals: dict[str, Evaluation],
                   decision: Decision, workdir: Path) -> str:
    """The MLflow run (metrics, benchmark JSON + PNG, decision) and the version tags."""
    from mlflow.entities import Metric, Param

    from specdec.bench import write_report

    uri = cfg.tracking_uri
    ch = evals["challenger"]
    champ = evals.get("champion")
    run_name = f"eval-v{ch.version}" + (f"-vs-v{champ.version}" if champ else "-first")
    tags = {"dflash.kind": "promotion-eval", "dflash.model_name": name, "dflash.challenger_version": ch.version,
            "dflash.champion_version": champ.version if champ else "", "dflash.model_version": f"{name}/{ch.version}",
            "dflash.target_identity": report["config"]["target_identity"], "dflash.decision":
            "promote" if decision.promote else "refuse", "dflash.reason": decision.reason[:5000],
            "mlflow.note.content": f"{'PROMOTE' if decision.promote else 'REFUSE'}: {decision.reason}"}
    experiment = cfg.experiment or f"{name}-promotion"
    run_id = _registry_call(uri, "creating the evaluation run", lambda: registry.start_run(
        uri, experiment, run_name, tags=tags))
    c = registry.client(uri)
    now = int(time.time() * 1000)
    metrics = [Metric("ar.tokens_per_s", ch.ar_tokens_per_s, now, 0)]
    for role, e in evals.items():
        vals = {"tau": e.tau, "speedup": e.speedup, "tokens_per_s": e.tokens_per_s, "exact": float(e.exact)}
        metrics += [Metric(f"{role}.{k}", float(v), now, 0) for k, v in vals.items() if v is not None]
        if role == "challenger":  # the version this run evaluates: plain names too
            metrics += [Metric(k, float(v), now, 0) for k, v in vals.items() if v is not None]
    params = {"prompts": cfg.prompts, "num_prompts": report["config"]["num_prompts_used"],
              "max_new_tokens": cfg.max_new_tokens, "metric": cfg.metric, "margin": cfg.margin,
              "batch_size": cfg.batch_size, "target": report["config"]["target_id"],
              "challenger_version": ch.version, "champion_version": champ.version if champ else "none",
              "block_sizes": json.dumps({r["method"]: r["block_size"] for r in report["results"] if r["block_size"]})}
    _registry_call(uri, "logging the evaluation", lambda: c.log_batch(
        run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in params.items()]))
    out = workdir / "eval"
    write_report(report, out / "benchmark.json")  # + benchmark.png
    (out / "decision.json").write_text(json.dumps(
        {"decision": asdict(decision), "evaluations": {k: asdict(v) for k, v in evals.items()}}, indent=2))
    _registry_call(uri, "uploading the benchmark JSON and plot", lambda: c.log_artifacts(run_id, str(out), "eval"))
    if cfg.out:
        import shutil

        shutil.copytree(out, cfg.out, dirs_exist_ok=True)
    for role, e in evals.items():
        other = evals.get("challenger" if role == "champion" else "champion")
        # one HTTP call per tag (MLflow has no batch call for version tags): keep the set small;
        # the run holds everything else
        vtags = {"tau": _fmt(e.tau), "speedup": f"{e.speedup:.4f}", "tokens_per_s": f"{e.tokens_per_s:.3f}",
                 "exact": str(e.exact).lower(), "run_id": run_id, "prompts": cfg.prompts,
                 "num_prompts": str(report["config"]["num_prompts_used"]), "max_new_tokens": str(cfg.max_new_tokens),
                 "vs": f"v{other.version}" if other else "ar"}
        for k, v in vtags.items():
            _registry_call(uri, f"tagging v{e.version}", lambda k=k, v=v, e=e: c.set_model_version_tag(
                name, e.version, EVAL_TAG_PREFIX + k, v))
    c.set_terminated(run_id, "FINISHED")
    ch.run_id = run_id
    if champ:
        champ.run_id = run_id
    return run_id


def _tag_decision(uri: str, name: str, version: str, decision: Decision, result: str) -> None:
    c = registry.client(uri)
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    tags = {"decision": result, "reason": decision.reason[:5000], "time": when}
    for k, v in tags.items():
        _registry_call(uri, f"tagging v{version}", lambda k=k, v=v: c.set_model_version_tag(
            name, version, DECISION_TAG_PREFIX + k, v))


def promote(cfg: PromoteConfig) -> Outcome:
    """Evaluate ``cfg.challenger`` against ``@champion`` and move the aliases if it wins.
    Raises ``Refused`` (with the reason) when it does not, ``PromoteError`` /
    ``RegistryUnreachable`` for usage and registry problems; aliases change only when
    this returns with ``promoted=True``."""
    cfg.tracking_uri = registry.resolve_tracking_uri(cfg.tracking_uri)
    uri, name = cfg.tracking_uri, cfg.model_name
    check_reachable(uri)
    state = read_model(uri, name)
    challenger = resolve_version(state, cfg.challenger)
    champion = state.champion
    if champion == challenger:
        raise Refused(f"{name} v{challenger} is already @{CHAMPION}; nothing to do")
    if champion is not None and champion not in state.versions:
        raise PromoteError(f"@{CHAMPION} of {name} points at v{champion}, which does not exist")

    with tempfile.TemporaryDirectory(prefix="dflash-promote-") as tmp:
        try:
            report, target = evaluate(cfg, state, challenger, champion, Path(tmp))
        except TargetMismatch as e:  # recorded on the version, so that --list shows why
            _best_effort(lambda: _tag_decision(uri, name, challenger, Decision(False, str(e), cfg.metric, cfg.margin),
                                               "refused"))
            raise
        evals = evaluations_from_report(report)
        decision = decide(evals["challenger"], evals.get("champion"), cfg.metric, cfg.margin)
        run_id = log_evaluation(cfg, name, report, evals, decision, Path(tmp))

    promoted = False
    if decision.promote and not cfg.dry_run:
        now = read_model(uri, name)  # nobody moved the aliases while we measured?
        if now.champion != state.champion or now.previous != state.previous:
            raise Refused(f"aliases of {name} changed during the evaluation (@{CHAMPION} v{state.champion} -> "
                          f"v{now.champion}, @{PREVIOUS} v{state.previous} -> v{now.previous}); run again")
        moves = ([(PREVIOUS, champion)] if champion else []) + [(CHAMPION, challenger)]
        set_aliases(uri, name, moves, {PREVIOUS: state.previous, CHAMPION: state.champion})
        promoted = True
        _best_effort(lambda: _pin_target(uri, name, state, target, challenger))
    result = ("promoted" if promoted else "would-promote (dry run)" if decision.promote else "refused")
    _best_effort(lambda: _tag_decision(uri, name, challenger, decision, result))
    after = dict(state.aliases)
    if promoted:
        after.update(({PREVIOUS: champion} if champion else {}) | {CHAMPION: challenger})
    outcome = Outcome(model=name, tracking_uri=uri, challenger=challenger, champion_before=champion,
                      previous_before=state.previous, decision=decision, evaluations=evals, run_id=run_id,
                      report=report, promoted=promoted, dry_run=cfg.dry_run, aliases_after=after,
                      experiment=cfg.experiment or f"{name}-promotion")
    if not decision.promote:
        raise RefusedWithOutcome(decision.reason, outcome)
    return outcome


def _pin_target(uri: str, name: str, state: ModelState, target, version: str) -> None:
    """The first promotion pins the model to its target (registered-model tags)."""
    if state.tags.get("target_identity"):
        return
    c = registry.client(uri)
    c.set_registered_model_tag(name, "target_identity", target.identity)
    tm = state.versions[version].tags.get("target_model")
    if tm:
        c.set_registered_model_tag(name, "target_model", tm)


def _best_effort(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the aliases are already right; a missing tag is not worth failing for
        log.warning("registry bookkeeping failed (aliases are unaffected): %s", e)
        return None


# ============================================================================ rollback, list
@dataclass
class Rollback:
    model: str
    champion_before: str
    champion_after: str
    previous_after: str


def rollback(tracking_uri: str | None, name: str) -> Rollback:
    """``@champion`` <- ``@previous`` and ``@previous`` <- the demoted champion (so a second
    rollback undoes the first). All-or-nothing like promotion."""
    uri = registry.resolve_tracking_uri(tracking_uri)
    check_reachable(uri)
    state = read_model(uri, name)
    champion, previous = state.champion, state.previous
    if previous is None:
        raise Refused(f"{name} has no @{PREVIOUS}: nothing to roll back to"
                      + (f" (@{CHAMPION} is v{champion})" if champion else ""))
    if previous not in state.versions:
        raise PromoteError(f"@{PREVIOUS} of {name} points at v{previous}, which does not exist")
    if champion == previous:
        raise Refused(f"@{CHAMPION} and @{PREVIOUS} of {name} are both v{champion}: nothing to roll back")
    moves = [(CHAMPION, previous)] + ([(PREVIOUS, champion)] if champion else [])
    set_aliases(uri, name, moves, {CHAMPION: champion, PREVIOUS: previous})
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    c = registry.client(uri)
    if champion:
        _best_effort(lambda: c.set_model_version_tag(name, champion, DECISION_TAG_PREFIX + "rolled_back_at", when))
    _best_effort(lambda: c.set_model_version_tag(name, previous, DECISION_TAG_PREFIX + "restored_at", when))
    return Rollback(name, champion or "-", previous, champion or "-")


LIST_COLUMNS = ("version", "aliases", "created", "target", "run", "tau", "speedup", "exact", "vs", "decision")


def list_versions(tracking_uri: str | None, name: str) -> list[dict]:
    """One row per version (newest first): aliases, lineage, last evaluation, decision."""
    uri = registry.resolve_tracking_uri(tracking_uri)
    check_reachable(uri)
    state = read_model(uri, name)
    rows = []
    for v in sorted(state.versions, key=int, reverse=True):
        mv = state.versions[v]
        t = mv.tags
        created = _dt.datetime.fromtimestamp(mv.creation_timestamp / 1000, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
        rows.append({
            "version": v, "aliases": ",".join(f"@{a}" for a in state.aliases_of(v)) or "-", "created": created,
            "target": _short(t.get("target_identity")).rstrip("."),
            "run": t.get("run_name") or (mv.run_id or "-")[:12],
            "tau": t.get("eval.tau", "-"), "speedup": t.get("eval.speedup", "-"), "exact": t.get("eval.exact", "-"),
            "vs": t.get("eval.vs", "-"), "decision": t.get("promotion.decision", "-"),
            "lineage": {k: t[k] for k in registry.LINEAGE_KEYS if k in t},
            "eval": {k.removeprefix(EVAL_TAG_PREFIX): val for k, val in t.items() if k.startswith(EVAL_TAG_PREFIX)},
            "promotion": {k.removeprefix(DECISION_TAG_PREFIX): val for k, val in t.items()
                          if k.startswith(DECISION_TAG_PREFIX)},
            "run_id": mv.run_id, "source": mv.source,
        })
    return rows


def format_table(rows: list[dict], columns=LIST_COLUMNS) -> str:
    cells = [[str(r[c]) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    return "\n".join([line(columns)] + [line(r) for r in cells])


def format_evaluation(outcome: Outcome) -> str:
    """The side-by-side table and the decision, for the terminal."""
    r = outcome.report
    cfg = r["config"]
    lines = [f"{outcome.model} at {outcome.tracking_uri}: challenger v{outcome.challenger} vs "
             + (f"@{CHAMPION} v{outcome.champion_before}" if outcome.champion_before else "no champion")
             + f" | {cfg['num_prompts_used']} prompts from {cfg['prompts']}, {cfg['max_new_tokens']} new tokens each, "
             "greedy, one interleaved run",
             f"{'method':<14}{'role':<12}{'block':>6}{'tok/s':>10}{'speedup':>9}{'tau':>7}  exact"]
    for x in r["results"]:
        exact = "-" if x["method"] == "ar" else str(r["exactness"]["equal"][x["method"]]).lower()
        lines.append(f"{x['method']:<14}{x['role']:<12}{x['block_size'] or '-':>6}{x['tokens_per_s']:>10.2f}"
                     f"{x['speedup_vs_ar']:>8.3f}x{_fmt(x['tau_mean']):>7}  {exact}")
    for m, c in r["cost_terms"].items():
        if m != "L_ar_s":
            lines.append(f"cost terms {m}: tau {c['tau']:.2f} vs r_d+r_v+r_o = {c['r_d']:.2f}+{c['r_v']:.2f}+"
                         f"{c['r_o']:.2f} -> predicted {c['predicted_speedup']:.2f}x")
    d = outcome.decision
    verdict = ("PROMOTED" if outcome.promoted else "WOULD PROMOTE (dry run, aliases untouched)" if d.promote
               else "REFUSED")
    lines.append(f"decision ({d.metric}, margin {d.margin:.0%}): {verdict}: {d.reason}")
    if outcome.promoted:
        lines.append(f"aliases: @{CHAMPION} -> v{outcome.challenger}"
                     + (f", @{PREVIOUS} -> v{outcome.champion_before}" if outcome.champion_before else ""))
    lines.append(f"evaluation run: {outcome.run_id} (experiment {outcome.experiment})")
    return "\n".join(lines)


# ============================================================================ the packaged reference drafter
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
    for role, path in (("champion", current), ("challenger", Path(candidate))):
        if path is not None:
            d = load_drafter(path, target=target)
            candidates.append(Candidate(f"dflash:{'reference' if role == 'champion' else 'candidate'}", role,
                                        "reference" if role == "champion" else "candidate", d,
                                        block_size or d.config.block_size))
    prompt_ids, ps = load_prompt_ids(target, prompts, num_prompts)
    report = measure(target, candidates, ps, prompt_ids, max_new_tokens, prompts)
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
