"""Side-by-side evaluation of drafters against the target alone and against each other,
on the engine benchmark's harness (``specdec.bench.measure_methods``): the numbers a
promotion decides on are measured exactly as ``jobs/benchmark.py`` measures.

* :func:`measure` (target, candidates, prompts, ...) -> report in the benchmark's schema;
* :func:`evaluate_versions` (registry state, challenger, champion, ...) -> (report, target):
  lineage checks, the target, each version's drafter downloaded and checked, then measure;
* :func:`evaluations_from_report` -> role -> :class:`Evaluation`, what the decision reads.

Lineage: a version must carry ``target_identity`` (the target's weights fingerprint,
written by training, see ``pipelines.registry.LINEAGE_KEYS``). The model's target is
pinned by the registered-model tag ``target_identity`` (set at the first promotion) or the
champion's tag; a version for another target raises :class:`TargetMismatch` naming
``target_identity`` before anything is measured, and the drafter checkpoint itself is
checked again when loaded (``specdec.checkpoint.load_drafter(target=...)``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pipelines import registry
from pipelines.registry import CHAMPION, ModelState

log = logging.getLogger(__name__)

EVAL_TAG_PREFIX = "eval."  # version tags with the latest evaluation's summary


class EvaluationError(RuntimeError):
    """The evaluation cannot run (target or prompts not found, a drafter that does not load)."""


class TargetMismatch(RuntimeError):
    """A version whose lineage names another target; the message names ``target_identity``."""


# ============================================================================ lineage
def short_identity(identity: str | None) -> str:
    return f"{identity[:12]}.." if identity else "-"


def reference_identity(state: ModelState) -> tuple[str | None, str]:
    """The target identity this model is for, and where that came from."""
    if state.tags.get("target_identity"):
        return state.tags["target_identity"], f"model {state.name} (tag target_identity)"
    tid = champion_tag(state, "target_identity")
    return (tid, f"@{CHAMPION} v{state.champion}") if tid else (None, "")


def champion_tag(state: ModelState, key: str) -> str | None:
    if state.champion and state.champion in state.versions:
        return state.versions[state.champion].tags.get(key)
    return None


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
            f"{state.name} v{version} was trained for target_identity {short_identity(tid)} "
            f"(target_model {mv.tags.get('target_model', '?')}) but {where} is for target_identity "
            f"{short_identity(ref)} ({state.tags.get('target_model') or champion_tag(state, 'target_model') or '?'}): "
            "target_identity differs, refusing to promote a drafter of another target")
    return tid


def check_target(target, expected_identity: str, what: str, target_ref: str | None, dtype: str) -> None:
    if target.identity != expected_identity:
        raise TargetMismatch(
            f"{what} was trained for target_identity {short_identity(expected_identity)} but the target "
            f"{target_ref or 'smollm2-135m (embedded default)'} loaded as {dtype} has target_identity "
            f"{short_identity(target.identity)}: target_identity differs (another model, other weights, or another "
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


def measure(target, candidates: list[Candidate], prompts: list[list[int]], prompt_ids: list[str],
            max_new_tokens: int, prompts_source: str, batch_size: int = 1, seed: int = 0,
            warmup_tokens: int = 8, lookup_block: int = 0) -> dict:
    """``ar`` and every candidate on the same prompts in this process, interleaved batch by
    batch (the order rotates), greedy, exactly ``max_new_tokens`` tokens per prompt.
    Returns a report in the engine benchmark's schema (``specdec.bench``): ``config``,
    ``results`` (one per method, with each candidate's ``version``, ``role`` and
    ``block_size``), ``exactness`` and ``cost_terms``, plus ``versions``. ``lookup_block`` > 1
    measures each drafter with prompt lookup beside it, as serving runs it."""
    from specdec.bench import engine_method, machine_info, measure_methods, summarise
    from specdec.proposers import drafter_proposer, engine_width
    from specdec.sampling import GREEDY

    stop = frozenset()  # ignore EOS: every method generates exactly max_new_tokens
    methods = {"ar": engine_method(target, GREEDY, None, 16, stop)}
    for c in candidates:
        methods[c.label] = engine_method(
            target, GREEDY, lambda c=c: drafter_proposer(c.drafter, target, c.block_size, lookup_block),
            engine_width(c.block_size, lookup_block), stop)
    acc = measure_methods(methods, prompts, max_new_tokens, batch_size, seed, warmup_tokens)
    summary = summarise(acc, greedy=True)
    by_label = {c.label: c for c in candidates}
    for r in summary["results"]:
        c = by_label.get(r["method"])
        r.update(version=c.version if c else None, role=c.role if c else "reference",
                 block_size=c.block_size if c else None)
    config = {
        "target_id": target.model_id, "target_identity": target.identity, "prompts": prompts_source,
        "num_prompts": len(prompts), "num_prompts_used": len(prompts), "prompt_ids": prompt_ids,
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts), "max_new_tokens": max_new_tokens,
        "batch_size": batch_size, "temperature": 0.0, "seed": seed, "methods": list(methods),
        "eos": "ignored (exactly max_new_tokens per prompt)",
        "order": "interleaved: per batch every method in turn, order rotating from batch to batch",
        "overhead_definition": "wall - draft - verify (prefill, acceptance, bookkeeping)",
        "machine": machine_info(), "notes": [],
    }
    return {"config": config, **summary,
            "versions": {c.label: {"version": c.version, "role": c.role} for c in candidates}}


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


# ============================================================================ registry versions
@dataclass
class EvalSettings:
    """How versions are measured (``jobs/promote_drafter.py``'s flags)."""

    target: str | None = None  # None: the model's lineage (target_model tag), else the embedded default
    target_dtype: str = "float32"
    prompts: str = "sharegpt"
    num_prompts: int = 8
    max_new_tokens: int = 64
    block_size: int | None = None  # None: each drafter's own block size
    batch_size: int = 1
    seed: int = 0
    lookup_block: int = 0  # > 1: each drafter with prompt lookup beside it (serving's lookup_block)
    # captured:<uri> sets: the share of captured prompts held out from feature runs over them
    # (their features.prompts.holdout_fraction): only these are measured
    captured_holdout: float = 0.05
    captured_options: dict | None = None  # fsspec options for captured:<s3 uri> (else the AWS_* environment)


CAPTURED = "captured:"  # a prompt set of held-out served traffic: captured:<capture uri>


def load_prompt_set(target, source: str, n: int, captured_holdout: float = 0.05,
                    captured_options: dict | None = None) -> tuple[list[str], list[list[int]]]:
    """``n`` prompts of ``source`` as token ids: a prompt source (specdec.bench.load_prompt_ids),
    or ``captured:<uri>``, the served traffic captured there whose prompts fall in the held-out
    split at ``captured_holdout`` (a feature run over the same captures with that
    ``prompts.holdout_fraction`` and ``split: train`` never saw them), as the target saw them."""
    import itertools

    from specdec.bench import BenchError, load_prompt_ids

    if not source.startswith(CAPTURED):
        return load_prompt_ids(target, source, n)
    from pipelines.config import CapturedSection, ConfigError
    from pipelines.features.captured import iter_captured

    try:
        samples = list(itertools.islice(iter_captured(CapturedSection(uris=[source[len(CAPTURED):]]), "holdout",
                                                      captured_holdout, captured_options), n))
    except ConfigError as e:
        raise BenchError(f"cannot read prompts {source!r}: {e}") from None
    if not samples:
        raise BenchError(f"no held-out prompts in {source!r} (a {captured_holdout:g} share of the captured prompts "
                         "is held out; capture more traffic or raise --captured-holdout)")
    return [s.id for s in samples], [s.prompt_ids for s in samples]


def load_target_for(ref: str | None, dtype: str, from_flag: bool):
    """The target named by ``--target`` (``from_flag``) or the lineage; errors name which."""
    from specdec.bench import BenchError, load_target_checked

    try:
        return load_target_checked(ref, dtype)
    except BenchError as e:
        where = "--target" if from_flag else "the lineage tag target_model"
        raise EvaluationError(f"{e} (from {where}; pass --target PATH)") from None


def evaluate_versions(tracking_uri: str, state: ModelState, challenger: str, champion: str | None,
                      settings: EvalSettings, workdir: Path):
    """Check lineage, load the target and both drafters, measure side by side.
    Returns (report, target)."""
    reports, target = evaluate_versions_on(tracking_uri, state, challenger, champion, settings, workdir,
                                           [settings.prompts])
    return reports[settings.prompts], target


def evaluate_versions_on(tracking_uri: str, state: ModelState, challenger: str, champion: str | None,
                         settings: EvalSettings, workdir: Path, prompt_sets: list[str]):
    """:func:`evaluate_versions` on several prompt sets: the lineage is checked and the
    target and drafters loaded once, then one side-by-side :func:`measure` per set (each
    set's prompts are read before anything is measured). Returns ({set: report}, target)."""
    from specdec.bench import BenchError
    from specdec.checkpoint import DrafterMismatchError, load_drafter

    name = state.name
    tid = check_lineage(state, challenger)
    if champion:
        check_lineage(state, champion)
    ref = settings.target or state.tags.get("target_model") or champion_tag(state, "target_model") \
        or state.versions[challenger].tags.get("target_model")
    target = load_target_for(ref, settings.target_dtype, from_flag=bool(settings.target))
    check_target(target, tid, f"{name} v{challenger}", ref, settings.target_dtype)

    candidates = []
    for role, version in (("champion", champion), ("challenger", challenger)):
        if version is None:
            continue
        path = registry.download_version(tracking_uri, name, version, workdir / f"v{version}")
        try:
            drafter = load_drafter(path, target=target)
        except DrafterMismatchError as e:
            raise TargetMismatch(f"{name} v{version} does not fit the target {ref or 'smollm2-135m'}: {e}") from None
        except (FileNotFoundError, ValueError) as e:
            raise EvaluationError(f"{name} v{version}: cannot load its drafter: {e}") from None
        candidates.append(Candidate(f"dflash:v{version}", role, version, drafter,
                                    settings.block_size or drafter.config.block_size))
    loaded = {}
    for source in prompt_sets:
        try:
            loaded[source] = load_prompt_set(target, source, settings.num_prompts, settings.captured_holdout,
                                             settings.captured_options)
        except BenchError as e:
            raise EvaluationError(str(e)) from None
    reports = {}
    for source, (prompt_ids, prompts) in loaded.items():
        log.info("measuring ar + %s on %d prompts from %s x %d tokens", ", ".join(c.label for c in candidates),
                 len(prompts), source, settings.max_new_tokens)
        reports[source] = measure(target, candidates, prompts, prompt_ids, settings.max_new_tokens, source,
                                  batch_size=settings.batch_size, seed=settings.seed,
                                  lookup_block=settings.lookup_block)
    return reports, target


# ============================================================================ the record
def log_evaluation(tracking_uri: str, name: str, report: dict, evals: dict[str, Evaluation], settings: EvalSettings,
                   decision: dict, workdir: Path, experiment: str, out_dir: str | None = None,
                   label: str | None = None) -> str:
    """The evaluation's MLflow run (metrics, benchmark JSON + PNG, the ``decision`` taken on
    it: promote, reason, metric, margin) and each measured version's ``eval.*`` tags."""
    from mlflow.entities import Metric, Param

    from pipelines.report import write_report

    uri = tracking_uri
    ch = evals["challenger"]
    champ = evals.get("champion")
    run_name = f"eval-v{ch.version}" + (f"-vs-v{champ.version}" if champ else "-first") + (f"-{label}" if label else "")
    tags = {"dflash.kind": "promotion-eval", "dflash.model_name": name, "dflash.challenger_version": ch.version,
            "dflash.champion_version": champ.version if champ else "", "dflash.model_version": f"{name}/{ch.version}",
            "dflash.target_identity": report["config"]["target_identity"], "dflash.decision":
            "promote" if decision["promote"] else "refuse", "dflash.reason": decision["reason"][:5000],
            "mlflow.note.content": f"{'PROMOTE' if decision['promote'] else 'REFUSE'}: {decision['reason']}"}
    run_id = registry.call(uri, "creating the evaluation run", lambda: registry.start_run(
        uri, experiment, run_name, tags=tags))
    c = registry.client(uri)
    now = int(time.time() * 1000)
    metrics = [Metric("ar.tokens_per_s", ch.ar_tokens_per_s, now, 0)]
    for role, e in evals.items():
        vals = {"tau": e.tau, "speedup": e.speedup, "tokens_per_s": e.tokens_per_s, "exact": float(e.exact)}
        metrics += [Metric(f"{role}.{k}", float(v), now, 0) for k, v in vals.items() if v is not None]
        if role == "challenger":  # the version this run evaluates: plain names too
            metrics += [Metric(k, float(v), now, 0) for k, v in vals.items() if v is not None]
    params = {"prompts": settings.prompts, "num_prompts": report["config"]["num_prompts_used"],
              "max_new_tokens": settings.max_new_tokens, "metric": decision["metric"], "margin": decision["margin"],
              "batch_size": settings.batch_size, "target": report["config"]["target_id"],
              "challenger_version": ch.version, "champion_version": champ.version if champ else "none",
              "block_sizes": json.dumps({r["method"]: r["block_size"] for r in report["results"] if r["block_size"]})}
    registry.call(uri, "logging the evaluation", lambda: c.log_batch(
        run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in params.items()]))
    out = workdir / "eval"
    write_report(report, out / "benchmark.json")  # + benchmark.png
    (out / "decision.json").write_text(json.dumps(
        {"decision": decision, "evaluations": {k: asdict(v) for k, v in evals.items()}}, indent=2))
    registry.call(uri, "uploading the benchmark JSON and plot", lambda: c.log_artifacts(run_id, str(out), "eval"))
    if out_dir:
        import shutil

        shutil.copytree(out, out_dir, dirs_exist_ok=True)
    for role, e in evals.items():
        other = evals.get("challenger" if role == "champion" else "champion")
        # one HTTP call per tag (MLflow has no batch call for version tags): keep the set small;
        # the run holds everything else
        vtags = {"tau": "-" if e.tau is None else f"{e.tau:.3f}", "speedup": f"{e.speedup:.4f}", "tokens_per_s": f"{e.tokens_per_s:.3f}",
                 "exact": str(e.exact).lower(), "run_id": run_id, "prompts": settings.prompts,
                 "num_prompts": str(report["config"]["num_prompts_used"]),
                 "max_new_tokens": str(settings.max_new_tokens),
                 "vs": f"v{other.version}" if other else "ar"}
        registry.set_version_tags(uri, name, e.version, {EVAL_TAG_PREFIX + k: v for k, v in vtags.items()})
    c.set_terminated(run_id, "FINISHED")
    ch.run_id = run_id
    if champ:
        champ.run_id = run_id
    return run_id
