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

Lineage checks and the measurement itself are ``pipelines.evaluate``'s (the engine
benchmark's harness); registry reads, alias moves and error mapping are
``pipelines.registry``'s. This module holds the decision rule and the promote / rollback /
list orchestration.
"""

from __future__ import annotations

import datetime as _dt
import logging
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from pipelines import registry
from pipelines.evaluate import (EVAL_TAG_PREFIX, EvalSettings, Evaluation, EvaluationError,  # noqa: F401
                                TargetMismatch, evaluate_versions, evaluations_from_report, log_evaluation,
                                short_identity)
from pipelines.registry import CHAMPION, PREVIOUS, ModelState, read_model, resolve_version, set_aliases

log = logging.getLogger(__name__)
METRICS = ("speedup", "tau")
DEFAULT_METRIC = "speedup"
DEFAULT_MARGIN = 0.02  # relative: the challenger must be >= 2% better than the champion
DECISION_TAG_PREFIX = "promotion."


# ============================================================================ errors
class PromoteError(RuntimeError):
    """A usage problem (exit code 2)."""


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
        if self.block_size is not None:
            from specdec.drafter import check_block_size

            try:
                check_block_size(self.block_size, "--block-size")
            except ValueError as e:
                raise PromoteError(str(e)) from None
        if self.target_dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise PromoteError(f"--target-dtype: unknown dtype {self.target_dtype!r}")

    @property
    def model_name(self) -> str:
        return model_name(self.model, self.target)

    @property
    def settings(self) -> EvalSettings:
        return EvalSettings(self.target, self.target_dtype, self.prompts, self.num_prompts, self.max_new_tokens,
                            self.block_size, self.batch_size, self.seed)


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

    with tempfile.TemporaryDirectory(prefix="dflash-promote-") as tmp:
        try:
            report, target = evaluate_versions(uri, state, challenger, champion, cfg.settings, Path(tmp))
        except TargetMismatch as e:  # recorded on the version, so that --list shows why
            refusal = Decision(False, str(e), cfg.metric, cfg.margin)
            _best_effort(lambda: _tag_decision(uri, name, challenger, refusal, "refused"))
            raise
        evals = evaluations_from_report(report)
        decision = decide(evals["challenger"], evals.get("champion"), cfg.metric, cfg.margin)
        run_id = log_evaluation(uri, name, report, evals, cfg.settings, asdict(decision), Path(tmp),
                                experiment, cfg.out)

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
                      experiment=experiment)
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


LIST_COLUMNS = ("version", "aliases", "created", "target", "run", "tau", "speedup", "exact", "vs", "decision")


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
