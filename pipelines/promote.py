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

The decision is :mod:`pipelines.promotion_rule`'s (the one rule, isolated and tested on its own):
exact, faster than the target alone with no champion yet, else better than the champion by
the margin. Several prompt sets (``prompts: "sharegpt,longctx"``; the default for a challenger
tagged ``context: long``) are measured one after the other with the same loaded drafters.

Alias moves are all-or-nothing as far as the user can see: the registry is checked and
everything is read before anything is written; then ``@previous`` <- old champion, then
``@champion`` <- challenger; if the second write fails the first is undone. Serving only
reads ``@champion``, so there is no moment where it points at a version that was not
decided on.

Lineage checks and the measurement itself are ``pipelines.evaluate``'s (the engine
benchmark's harness); registry reads, alias moves and error mapping are
``pipelines.registry``'s; the terminal output is ``jobs/promote_drafter.py``'s. This module
holds the promote / rollback / list orchestration.
"""

from __future__ import annotations

import datetime as _dt
import logging
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pipelines import registry
from pipelines.evaluate import (EVAL_TAG_PREFIX, EvalSettings, Evaluation, EvaluationError,  # noqa: F401
                                TargetMismatch, evaluate_versions, evaluate_versions_on, evaluations_from_report,
                                log_evaluation, short_identity)
from pipelines.promotion_rule import (DEFAULT_MARGIN, DEFAULT_METRIC, DEFAULT_TOLERANCE, Decision, PromoteError,
                                      check_rule, decide_sets, fmt_or_dash)
from pipelines.registry import CHAMPION, PREVIOUS, ModelState, read_model, resolve_version, set_aliases

log = logging.getLogger(__name__)
DEFAULT_PROMPTS = "sharegpt"
LONG_CONTEXT_PROMPTS = ("sharegpt", "longctx")  # a challenger tagged context: long is measured on both
DECISION_TAG_PREFIX = "promotion."


class Refused(RuntimeError):
    """A decision not to promote (or not to roll back), with the reason (exit code 1)."""


class RefusedWithOutcome(Refused):
    """A refusal after a completed evaluation; ``outcome`` carries the numbers."""

    def __init__(self, reason: str, outcome: "Outcome"):
        super().__init__(reason)
        self.outcome = outcome


#: what ``jobs/promote_drafter.py`` reports as errors (exit 2) and as refusals (exit 1)
ERRORS = (PromoteError, registry.RegistryError, EvaluationError)
REFUSALS = (Refused, TargetMismatch)


# ============================================================================ the job
@dataclass
class PromoteConfig:
    tracking_uri: str | None = None
    model: str | None = None  # None: dflash-<slug of target>
    target: str | None = None  # None: the model's lineage (target_model tag), else the embedded default
    target_dtype: str = "float32"
    challenger: str = "latest"
    # sharegpt (holdout split) | humaneval | longctx | a path, or several: "sharegpt,longctx" / a list;
    # None: sharegpt, and sharegpt + longctx for a challenger tagged context: long
    prompts: str | list[str] | None = None
    num_prompts: int = 8
    max_new_tokens: int = 64
    block_size: int | None = None  # None: each drafter's own block size
    batch_size: int = 1
    lookup_block: int = 0  # > 1: judge drafters with prompt lookup beside them, as serving runs them
    margin: float = DEFAULT_MARGIN
    metric: str = DEFAULT_METRIC
    tolerance: float = DEFAULT_TOLERANCE  # several prompt sets: the most the challenger may lose on any
    captured_holdout: float = 0.05  # captured:<uri> sets: the held-out share of the captured prompts
    captured_options: dict | None = None  # and their fsspec options (s3: else the AWS_* environment)
    dry_run: bool = False
    experiment: str | None = None  # None: <model>-promotion
    seed: int = 0
    out: str | None = None  # also keep benchmark.json/png in this directory

    def __post_init__(self):
        check_rule(self.metric, self.margin, self.tolerance)
        if self.prompts is not None:
            sets = self.prompts.split(",") if isinstance(self.prompts, str) else list(self.prompts)
            sets = [str(x).strip() for x in sets]
            if not sets or any(not x for x in sets) or len(set(sets)) != len(sets):
                raise PromoteError("--prompts: expected distinct prompt sets separated by commas, "
                                   f"got {self.prompts!r}")
            self.prompts = sets
        for name in ("num_prompts", "max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise PromoteError(f"--{name.replace('_', '-')} must be >= 1")
        if not 0 < self.captured_holdout < 1:
            raise PromoteError(f"--captured-holdout: expected a fraction in (0, 1), got {self.captured_holdout}")
        if self.lookup_block < 0:
            raise PromoteError(f"--lookup-block: expected an integer >= 0 (0 or 1: off), got {self.lookup_block}")
        if self.block_size is not None:
            from specdec.checkpoint_format import check_block_size

            try:
                check_block_size(self.block_size, "--block-size")
            except ValueError as e:
                raise PromoteError(str(e)) from None
        if self.target_dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise PromoteError(f"--target-dtype: unknown dtype {self.target_dtype!r}")

    @property
    def model_name(self) -> str:
        return model_name(self.model, self.target)

    def prompt_sets(self, challenger_tags: dict | None = None) -> list[str]:
        """The prompt sets to measure on: ``prompts`` as given, else ``sharegpt`` (and
        ``longctx`` too for a challenger tagged ``context: long``)."""
        if self.prompts is not None:
            return list(self.prompts)
        if (challenger_tags or {}).get("context") == "long":
            return list(LONG_CONTEXT_PROMPTS)
        return [DEFAULT_PROMPTS]

    @property
    def settings(self) -> EvalSettings:
        first = self.prompts[0] if self.prompts else DEFAULT_PROMPTS
        return EvalSettings(self.target, self.target_dtype, first, self.num_prompts, self.max_new_tokens,
                            self.block_size, self.batch_size, self.seed, self.lookup_block, self.captured_holdout,
                            self.captured_options)


def set_label(source: str) -> str:
    """A prompt set's short name: built-in names as they are, a file by its stem, captured
    traffic as ``captured``."""
    if source.startswith("captured:"):
        return "captured"
    return Path(source).stem if ("/" in source or "." in source) else source


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
    evaluations: dict[str, Evaluation]  # role -> numbers on the first prompt set
    run_id: str | None
    report: dict  # the first prompt set's
    promoted: bool
    dry_run: bool
    aliases_after: dict[str, str]
    experiment: str = ""
    by_set: dict[str, dict[str, Evaluation]] = field(default_factory=dict)  # prompt set -> role -> numbers
    reports: dict[str, dict] = field(default_factory=dict)  # prompt set -> report
    run_ids: dict[str, str] = field(default_factory=dict)  # prompt set -> evaluation run

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("report")
        d.pop("reports")
        return d


def _tag_decision(uri: str, name: str, version: str, decision: Decision, result: str) -> None:
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    tags = {"decision": result, "reason": decision.reason[:5000], "time": when}
    registry.set_version_tags(uri, name, version, {DECISION_TAG_PREFIX + k: v for k, v in tags.items()})


def promote(cfg: PromoteConfig) -> Outcome:
    """Evaluate ``cfg.challenger`` against ``@champion`` and move the aliases if it wins.
    Raises ``Refused`` (with the reason) when it does not, ``PromoteError`` /
    ``RegistryUnreachable`` for usage and registry problems; aliases change only when
    this returns with ``promoted=True``."""
    cfg.tracking_uri = registry.resolve_tracking_uri(cfg.tracking_uri)
    uri, name = cfg.tracking_uri, cfg.model_name
    experiment = cfg.experiment or f"{name}-promotion"
    registry.check_reachable(uri)
    state = read_model(uri, name)
    challenger = resolve_version(state, cfg.challenger)
    champion = state.champion
    if champion == challenger:
        raise Refused(f"{name} v{challenger} is already @{CHAMPION}; nothing to do")
    if champion is not None and champion not in state.versions:
        raise registry.RegistryError(f"@{CHAMPION} of {name} points at v{champion}, which does not exist")

    sources = cfg.prompt_sets(state.versions[challenger].tags)
    labels = [set_label(x) for x in sources]
    if len(set(labels)) != len(labels):
        labels = list(sources)
    with tempfile.TemporaryDirectory(prefix="dflash-promote-") as tmp:
        try:
            reports, target = evaluate_versions_on(uri, state, challenger, champion, cfg.settings, Path(tmp),
                                                   sources)
        except TargetMismatch as e:  # recorded on the version, so that --list shows why
            refusal = Decision(False, str(e), cfg.metric, cfg.margin)
            _best_effort(lambda: _tag_decision(uri, name, challenger, refusal, "refused"))
            raise
        by_set = {lab: evaluations_from_report(reports[src]) for lab, src in zip(labels, sources)}
        decision = decide_sets({lab: (e["challenger"], e.get("champion")) for lab, e in by_set.items()},
                               cfg.metric, cfg.margin, cfg.tolerance)
        run_ids = {}
        for lab, src in zip(labels, sources):  # one evaluation run per prompt set
            many = len(sources) > 1
            run_ids[lab] = log_evaluation(
                uri, name, reports[src], by_set[lab], replace(cfg.settings, prompts=src), asdict(decision),
                Path(tmp) / lab, experiment, (str(Path(cfg.out) / lab) if many else cfg.out) if cfg.out else None,
                label=lab if many else None)
        if len(sources) > 1:
            _best_effort(lambda: _tag_sets(uri, name, by_set))
        evals, report, run_id = by_set[labels[0]], reports[sources[0]], run_ids[labels[0]]

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
                      experiment=experiment, by_set=by_set, reports=dict(zip(labels, (reports[x] for x in sources))),
                      run_ids=run_ids)
    if not decision.promote:
        raise RefusedWithOutcome(decision.reason, outcome)
    return outcome


def _tag_sets(uri: str, name: str, by_set: dict[str, dict[str, Evaluation]]) -> None:
    """Each measured version's numbers on every prompt set (``eval.*`` tags hold the last set's)."""
    for role in ("challenger", "champion"):
        per = {lab: e[role] for lab, e in by_set.items() if role in e}
        if not per:
            continue
        version = next(iter(per.values())).version
        summary = "; ".join(f"{lab}: tau {fmt_or_dash(e.tau)}, speedup {e.speedup:.3f}x, exact {str(e.exact).lower()}"
                            for lab, e in per.items())
        registry.set_version_tags(uri, name, version, {EVAL_TAG_PREFIX + "sets": summary[:5000],
                                                       EVAL_TAG_PREFIX + "prompts": ",".join(per)})


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


def register_directory(tracking_uri: str | None, name: str, drafter_dir: str | Path) -> tuple[str, str, bool]:
    """Register a drafter directory (the packaged reference drafter, one trained elsewhere)
    as a version of ``name`` so that it can be evaluated and promoted like a trained one.
    Returns (tracking URI, version, registered now); the same weights twice give the
    version they already have. ``PromoteError`` when the directory is not a drafter."""
    uri = registry.resolve_tracking_uri(tracking_uri)
    db = registry.sqlite_file(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)  # a first registration creates the store
    else:
        registry.check_reachable(uri)
    try:
        version, new = registry.register_directory(uri, name, drafter_dir)
    except FileNotFoundError as e:
        raise PromoteError(f"--register: {e}") from None
    return uri, version, new


def rollback(tracking_uri: str | None, name: str) -> Rollback:
    """``@champion`` <- ``@previous`` and ``@previous`` <- the demoted champion (so a second
    rollback undoes the first). All-or-nothing like promotion."""
    uri = registry.resolve_tracking_uri(tracking_uri)
    registry.check_reachable(uri)
    state = read_model(uri, name)
    champion, previous = state.champion, state.previous
    if previous is None:
        raise Refused(f"{name} has no @{PREVIOUS}: nothing to roll back to"
                      + (f" (@{CHAMPION} is v{champion})" if champion else ""))
    if previous not in state.versions:
        raise registry.RegistryError(f"@{PREVIOUS} of {name} points at v{previous}, which does not exist")
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


def list_versions(tracking_uri: str | None, name: str) -> list[dict]:
    """One row per version (newest first): aliases, lineage, last evaluation, decision."""
    uri = registry.resolve_tracking_uri(tracking_uri)
    registry.check_reachable(uri)
    state = read_model(uri, name)
    rows = []
    for v in sorted(state.versions, key=int, reverse=True):
        mv = state.versions[v]
        t = mv.tags
        created = _dt.datetime.fromtimestamp(mv.creation_timestamp / 1000, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
        rows.append({
            "version": v, "aliases": ",".join(f"@{a}" for a in state.aliases_of(v)) or "-", "created": created,
            "target": short_identity(t.get("target_identity")).rstrip("."),
            "run": t.get("run_name") or (mv.run_id or "-")[:12],
            "context": t.get("context", "-"), "parent": f"v{t['parent_version']}" if t.get("parent_version") else "-",
            "tau": t.get("eval.tau", "-"), "speedup": t.get("eval.speedup", "-"), "exact": t.get("eval.exact", "-"),
            "vs": t.get("eval.vs", "-"), "decision": t.get("promotion.decision", "-"),
            "lineage": {k: t[k] for k in registry.LINEAGE_KEYS if k in t},
            "eval": {k.removeprefix(EVAL_TAG_PREFIX): val for k, val in t.items() if k.startswith(EVAL_TAG_PREFIX)},
            "promotion": {k.removeprefix(DECISION_TAG_PREFIX): val for k, val in t.items()
                          if k.startswith(DECISION_TAG_PREFIX)},
            "run_id": mv.run_id, "source": mv.source,
        })
    return rows
