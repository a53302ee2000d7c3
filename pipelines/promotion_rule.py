"""The promotion rule, the one rule that moves ``@champion`` (:func:`decide_sets`; :func:`decide`
is a set of one), isolated from the registry and the measurement so it can be tested
exhaustively (tests/test_promote.py):

1. the challenger must be exact (greedy output identical to ``ar`` on every prompt);
2. no champion yet: the bar is the target alone (AR): the challenger becomes champion only
   if its measured speedup is ``>= 1 + margin``, so promotion never makes serving slower
   than no drafter at all;
3. otherwise the challenger's ``metric`` (``speedup`` by default, or ``tau``) must beat the
   champion's, measured in the same run, by the relative ``margin``:
   ``challenger >= champion * (1 + margin)`` (default margin 0.02 = 2%).

With several prompt sets: exact on every set; with a champion, beat it by the margin on at least
one set AND lose no more than ``tolerance`` (relative, default 5%) on any set; with no champion,
beat the target alone by the margin on every set. The reasons' wording is here too: it is what
users read of the rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipelines.evaluate import Evaluation
from pipelines.registry import CHAMPION

METRICS = ("speedup", "tau")
DEFAULT_METRIC = "speedup"
DEFAULT_MARGIN = 0.02  # relative: the challenger must be >= 2% better than the champion
DEFAULT_TOLERANCE = 0.05  # several prompt sets: the most the challenger may lose on any of them (relative)
ONE_SET = "prompts"  # the set's name in the record of a single-set decision (decide)


class PromoteError(RuntimeError):
    """A usage problem (exit code 2)."""


@dataclass
class Decision:
    """The rule's verdict: promote or not, why, and each prompt set's numbers."""
    promote: bool
    reason: str
    metric: str
    margin: float
    tolerance: float | None = None  # several prompt sets only
    sets: dict = field(default_factory=dict)  # prompt set -> {challenger, champion, gain, result}


def check_rule(metric: str, margin: float, tolerance: float = 0.0) -> None:
    """The rule's settings, checked where they enter (``PromoteError`` names the option)."""
    if metric not in METRICS:
        raise PromoteError(f"--metric must be one of {', '.join(METRICS)}, got {metric!r}")
    if margin < 0:
        raise PromoteError(f"--margin must be >= 0, got {margin}")
    if not 0 <= tolerance < 1:
        raise PromoteError(f"--tolerance must be in [0, 1), got {tolerance}")


def decide(challenger: Evaluation, champion: Evaluation | None, metric: str = DEFAULT_METRIC,
           margin: float = DEFAULT_MARGIN) -> Decision:
    """The promotion rule on one prompt set: :func:`decide_sets` on a set of one."""
    return decide_sets({ONE_SET: (challenger, champion)}, metric, margin)


def decide_sets(results: dict[str, tuple[Evaluation, Evaluation | None]], metric: str = DEFAULT_METRIC,
                margin: float = DEFAULT_MARGIN, tolerance: float = DEFAULT_TOLERANCE) -> Decision:
    """The promotion rule (see the module docstring) on ``{set: (challenger, champion or
    None)}``, each pair measured in one run: exact on every set; with no champion, faster
    than the target alone by the margin on every set; else better than the champion by the
    margin on one set and worse by more than ``tolerance`` on none (a single set: better).
    Pure, so it is tested directly."""
    check_rule(metric, margin, tolerance)
    if not results:
        raise PromoteError("no prompt set was evaluated")
    many = len(results) > 1
    sets = {}
    for name, (ch, champ) in results.items():
        x = _set_numbers(ch, champ, metric)
        sets[name] = {**x, "result": _set_result(x, margin, tolerance), "exact": ch.exact}
    d = lambda ok, why: Decision(ok, why, metric, margin, tolerance if many else None, sets)  # noqa: E731
    v = next(iter(results.values()))[0].version
    inexact = [n for n, (ch, _) in results.items() if not ch.exact]
    if inexact:
        return d(False, _inexact_reason(v, inexact[0], results[inexact[0]][0], many))
    champs = {c.version if c is not None else None for _, c in results.values()}
    if champs == {None}:  # the bar is the target alone, on every set: serving must not get slower
        slow = [n for n, x in sets.items() if x["result"] != "better"]
        return d(not slow, _vs_target_reason(v, results, slow, margin, many))
    if len(champs) != 1 or None in champs:
        raise PromoteError(f"prompt sets were measured against different champions: {sorted(map(str, champs))}")
    c = champs.pop()
    if c == v:
        return d(False, f"v{v} is already @{CHAMPION}")
    wins = [n for n, x in sets.items() if x["result"] == "better"]
    losses = [n for n, x in sets.items() if x["result"] == "worse"]
    inexact_champ = [n for n, (_, champ) in results.items() if not champ.exact]
    return d(bool(wins) and not losses,
             _vs_champion_reason(v, c, sets, wins, losses, inexact_champ, metric, margin, tolerance))


def _set_numbers(ch: Evaluation, champ: Evaluation | None, metric: str) -> dict:
    """One prompt set's numbers for the decision record: vs the champion, else vs the target alone."""
    if champ is None:
        return {"challenger": ch.speedup, "champion": None, "vs": "ar", "metric": "speedup", "gain": ch.speedup - 1}
    new, old = ch.metric(metric), champ.metric(metric)
    gain = (new / old - 1) if old else float("inf")
    return {"challenger": new, "champion": old, "vs": f"v{champ.version}", "metric": metric, "gain": gain}


def _set_result(x: dict, margin: float, tolerance: float) -> str:
    """How one set counts in the rule: better by the margin, within the tolerance, or worse
    (against the target alone only better counts)."""
    bar = 1.0 if x["champion"] is None else x["champion"]
    if x["challenger"] >= bar * (1 + margin):
        return "better"
    if x["champion"] is None or x["challenger"] < bar * (1 - tolerance):
        return "worse"
    return "within"


def fmt_or_dash(x) -> str:
    """A number for a reason or a table: 3 decimals, ``-`` when not measured."""
    return "-" if x is None else f"{x:.3f}"


def _inexact_reason(v: str, name: str, ch: Evaluation, many: bool) -> str:
    where = f" (first mismatch at prompt {ch.first_mismatch[0]}, token {ch.first_mismatch[1]})" \
        if ch.first_mismatch else ""
    on = f" on {name}" if many else ""
    return (f"v{v} is not exact{on}: its greedy output differs from the target alone{where}; "
            "an inexact drafter is never promoted")


def _vs_target_reason(v: str, results: dict, slow: list[str], margin: float, many: bool) -> str:
    need = 1 + margin
    if not many:
        ch = next(iter(results.values()))[0]
        cmp = (f"speedup {ch.speedup:.3f}x vs the target alone (no @{CHAMPION} yet; margin {margin:.0%} "
               f"needs >= {need:.3f}x), tau {fmt_or_dash(ch.tau)}")
        if not slow:
            return f"v{v} is exact and faster than the target alone: {cmp}"
        return f"v{v} is exact but not faster than the target alone: {cmp}"
    desc = "; ".join(f"{n} {ch.speedup:.3f}x (tau {fmt_or_dash(ch.tau)})" for n, (ch, _) in results.items())
    if not slow:
        return (f"v{v} is exact and faster than the target alone on every prompt set: {desc} (no "
                f"@{CHAMPION} yet; margin {margin:.0%} needs >= {need:.3f}x)")
    return (f"v{v} is exact but not faster than the target alone on {', '.join(slow)}: {desc} (no "
            f"@{CHAMPION} yet; margin {margin:.0%} needs >= {need:.3f}x on every set)")


def _vs_champion_reason(v: str, c: str, sets: dict, wins: list[str], losses: list[str], inexact_champ: list[str],
                        metric: str, margin: float, tolerance: float) -> str:
    unit = "x" if metric == "speedup" else ""
    if len(sets) == 1:
        x = next(iter(sets.values()))
        need = x["champion"] * (1 + margin)
        cmp = (f"{metric} {x['challenger']:.3f}{unit} vs champion v{c}'s {x['champion']:.3f}{unit} "
               f"({x['gain']:+.1%}; margin {margin:.0%} needs >= {need:.3f}{unit})")
        if inexact_champ:
            cmp += f"; note: champion v{c} measured inexact in this run"
        return f"v{v} is exact and better: {cmp}" if wins else f"v{v} is exact but not better by the margin: {cmp}"

    def show(n, with_loss=False):
        x = sets[n]
        tail = f", {x['gain']:+.1%} > {tolerance:.0%}" if with_loss else f", {x['gain']:+.1%}"
        return f"{n} ({metric} {x['challenger']:.3f}{unit} vs {x['champion']:.3f}{unit}{tail})"

    note = f"; note: champion v{c} measured inexact on {', '.join(inexact_champ)}" if inexact_champ else ""
    if wins and not losses:
        rest = [n for n in sets if n not in wins]
        within = f"; within {tolerance:.0%} on {', '.join(show(n) for n in rest)}" if rest else ""
        return f"v{v} is exact and beats v{c} on {', '.join(show(n) for n in wins)}{within}{note}"
    if wins:
        return (f"v{v} beats v{c} on {', '.join(show(n) for n in wins)} but loses on "
                f"{', '.join(show(n, True) for n in losses)}{note}")
    lost = f"; loses more than {tolerance:.0%} on {', '.join(losses)}" if losses else ""
    return (f"v{v} is exact but not better by the margin on any prompt set (margin {margin:.0%}): "
            f"{', '.join(show(n) for n in sets)}{lost}{note}")
