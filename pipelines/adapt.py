"""One pass of the traffic-adaptation loop (``jobs/adapt_drafter.py``): the traffic the serving
apps captured since the last pass becomes a feature run (``prompts.source: captured``, nothing
generated), a drafter is fine-tuned from ``@champion`` on it (with ``train.replay`` of the data
the champion was trained on, if the recipe gives one), and the promotion job judges it against
the champion on held-out captured traffic AND the standard prompt set, side by side. Serving
replicas that follow ``@champion`` then pick a promoted drafter up by themselves.

The recipe is a training recipe (``features:``, ``drafter:``, ``train:``, ``registry:``) with an
``adapt:`` section (:class:`AdaptSection`). Each pass is window ``k``:

* its feature run is ``<features.output>/window-<k>`` and its training run ``<train.run_name>-<k>``;
  training reads every window's run so far (traffic the champion may not have learnt when an
  earlier challenger was refused), starting from ``@champion`` when there is one;
* the state file ``<adapt.state>/state.json`` keeps the watermark (the end of the last window
  consumed) and the windows made. A pass writes the window it starts (``pending``: since, until)
  before any work and the stage it reaches after each one, so a crashed pass resumes the same
  window: the feature run and the training run resume, a registered version is not trained or
  registered again. The watermark moves only once the promotion decided.
* with fewer than ``adapt.min_prompts`` new prompts in the window, nothing is done and the pass
  says so; the watermark stays, so the traffic is counted again next time.
"""

from __future__ import annotations

import copy
import datetime
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from pipelines import registry, storage
from pipelines.config import (FRACTION, NON_NEGATIVE, POSITIVE, CapturedSection, ConfigError, apply_overrides, option,
                              parse_section, read_yaml)

log = logging.getLogger(__name__)
STATE_FILE = "state.json"


@dataclass
class AdaptSection:
    """``adapt:``: where the traffic is, where the loop keeps its state, and how it judges."""

    captures: list[str]  # the serving apps' capture.uri: directories or s3:// prefixes
    state: str  # a directory or s3:// prefix for state.json
    min_prompts: int = option(100, check=POSITIVE)  # fewer new prompts in a window: nothing to do
    # captured prompts held out (by hash) from every window's training: the promotion's traffic set
    holdout_fraction: float = option(0.05, check=(lambda v: 0 < v < 1, "in (0, 1)"))
    model: str | None = None  # only traffic served under this model name (null: every model)
    max_temperature: float | None = option(None, check=NON_NEGATIVE)  # 0: greedy answers only
    standard_prompts: str = "sharegpt"  # the set the challenger must not lose on (beyond tolerance)
    num_prompts: int = option(8, check=POSITIVE)
    max_new_tokens: int = option(64, check=POSITIVE)
    metric: str = "speedup"
    margin: float = option(0.02, check=NON_NEGATIVE)
    tolerance: float = option(0.05, check=FRACTION)

    def __post_init__(self):
        if not self.captures or any(not u.strip() for u in self.captures):
            raise ConfigError("adapt.captures: expected the serving apps' capture.uri (a non-empty list)")


@dataclass
class AdaptOutcome:
    """What a pass did: ``nothing`` (too little new traffic), ``promoted`` or ``refused``."""
    action: str
    message: str
    window: dict = field(default_factory=dict)
    state_uri: str = ""


def load_adapt_recipe(path: str, overrides: list[str] = ()) -> tuple[AdaptSection, dict]:
    """The ``adapt:`` section and the whole recipe mapping (checked as a training recipe)."""
    from pipelines.train.config import parse_recipe

    data = apply_overrides(read_yaml(path), list(overrides))
    if "adapt" not in data:
        raise ConfigError(f"adapt: section missing in {path}")
    section = parse_section(AdaptSection, data["adapt"], "adapt")
    parse_recipe(window_recipe(data, section, 1, None, "2000-01-01T00:00:00+00:00", []), str(path))  # errors now
    return section, data


def window_recipe(data: dict, section: AdaptSection, k: int, since: str | None, until: str,
                  earlier: list[str], champion: str | None = None) -> dict:
    """The training recipe of window ``k``: its own feature run over the captured traffic of the
    window (training split), trained together with the ``earlier`` windows' runs, from
    ``champion`` (a registry URI) unless the recipe names a parent."""
    d = copy.deepcopy(data)
    d.pop("adapt", None)
    features, train, drafter = d["features"], d.setdefault("train", {}), d.setdefault("drafter", {}) or {}
    output = storage.join(str(features["output"]).rstrip("/"), f"window-{k:04d}")
    features["output"] = output
    features["prompts"] = {**(features.get("prompts") or {}), "source": "captured", "split": "train",
                           "holdout_fraction": section.holdout_fraction,
                           "captured": {"uris": list(section.captures), "since": since, "until": until,
                                        "model": section.model, "max_temperature": section.max_temperature}}
    features["generation"] = {**(features.get("generation") or {}), "backend": "captured", "temperature": 0.0}
    train["run_name"] = f"{train.get('run_name', 'adapt')}-{k:04d}"
    train["features"] = [*earlier, output] if earlier else output
    if champion and not drafter.get("init_from"):
        drafter["init_from"] = champion
        d["drafter"] = drafter
    d.setdefault("registry", {})["register"] = True
    return d


def read_state(uri: str, options: dict | None = None) -> dict:
    fs, root = storage.filesystem(uri, options)
    path = storage.join(root, STATE_FILE)
    if not storage.exists(fs, path):
        return {"watermark": None, "windows": [], "pending": None}
    return storage.read_json(fs, path)


def write_state(uri: str, state: dict, options: dict | None = None) -> None:
    fs, root = storage.filesystem(uri, options)
    storage.write_json(fs, storage.join(root, STATE_FILE), state)  # whole or not at all


def new_prompts(section: AdaptSection, since: str | None, until: str, options: dict | None = None) -> int:
    """The prompts a window would train on (held-out ones not counted)."""
    from pipelines.features.captured import iter_captured

    captured = CapturedSection(uris=list(section.captures), since=since, until=until, model=section.model,
                               max_temperature=section.max_temperature)
    return sum(1 for _ in iter_captured(captured, "train", section.holdout_fraction, options))


def adapt_once(path: str, overrides: list[str] = (), now: datetime.datetime | None = None) -> AdaptOutcome:
    """One pass (see the module docstring); Ray must be initialised (features and training)."""
    section, data = load_adapt_recipe(path, overrides)
    options = (data["features"].get("storage") or {}).get("options") or {}
    state = read_state(section.state, options)
    window = state.get("pending")
    if window is None:
        until = (now or datetime.datetime.now(datetime.timezone.utc)).replace(microsecond=0).isoformat()
        since = state.get("watermark")
        count = new_prompts(section, since, until, options)
        if count < section.min_prompts:
            msg = (f"nothing to do: {count} new prompts captured since {since or 'the start'} (adapt.min_prompts "
                   f"{section.min_prompts}); the watermark stays at {since}")
            log.info(msg)
            return AdaptOutcome("nothing", msg, {"since": since, "until": until, "prompts": count}, section.state)
        window = {"k": len(state.get("windows", [])) + 1, "since": since, "until": until, "prompts": count}
        state["pending"] = window
        write_state(section.state, state, options)
    else:
        log.info("resuming window %d (%s .. %s)", window["k"], window["since"], window["until"])
    window = _run_window(section, data, state, window, options, path)
    return _conclude(section, state, window, options)


def _run_window(section: AdaptSection, data: dict, state: dict, window: dict, options: dict, path: str) -> dict:
    """Features, training and registration of ``window``, each stage recorded once done."""
    from pipelines.features import run_features
    from pipelines.train import fit
    from pipelines.train.config import parse_recipe

    earlier = [w["features_uri"] for w in state.get("windows", [])]
    if "version" not in window:
        recipe = parse_recipe(window_recipe(data, section, window["k"], window["since"], window["until"], earlier,
                                            window.get("init_from")), path)
        if recipe.drafter.init_from is None:  # the recipe names no parent: the champion, if there is one
            recipe.drafter.init_from = _champion_uri(recipe)
        window["init_from"] = recipe.drafter.init_from
        summary = run_features(recipe.features)
        window.update(features_uri=summary["uri"], samples=summary.get("num_samples"))
        _save_pending(section, state, window, options)
        result = fit(recipe)
        window.update(version=result.model_version, train_run=recipe.train.run_name, model=recipe.model_name,
                      tracking_uri=result.tracking_uri, holdout_tau=result.holdout_tau)
        _save_pending(section, state, window, options)
    return window


def _champion_uri(recipe) -> str | None:
    """``models:/<model>@champion`` when the recipe's model has a champion, else None."""
    uri = registry.resolve_tracking_uri(recipe.registry.tracking_uri)
    try:
        champion = registry.read_model(uri, recipe.model_name).champion
    except registry.RegistryError:
        champion = None
    return f"models:/{recipe.model_name}@{registry.CHAMPION}" if champion else None


def _save_pending(section: AdaptSection, state: dict, window: dict, options: dict) -> None:
    state["pending"] = window
    write_state(section.state, state, options)


def _conclude(section: AdaptSection, state: dict, window: dict, options: dict) -> AdaptOutcome:
    """Promotion of the window's version; then the watermark moves and the window is recorded."""
    from pipelines import promote as P

    cfg = P.PromoteConfig(tracking_uri=window["tracking_uri"], model=window["model"], challenger=window["version"],
                          prompts=[section.standard_prompts, *(f"captured:{u}" for u in section.captures)],
                          num_prompts=section.num_prompts, max_new_tokens=section.max_new_tokens,
                          metric=section.metric, margin=section.margin, tolerance=section.tolerance,
                          captured_holdout=section.holdout_fraction, captured_options=options)
    try:
        outcome = P.promote(cfg)
        decision = outcome.decision
    except P.RefusedWithOutcome as r:
        outcome, decision = r.outcome, r.outcome.decision
    except P.Refused as r:  # e.g. the version is @champion already (a rerun after the alias moved)
        outcome, decision = None, P.Decision(False, str(r), section.metric, section.margin)
    promoted = bool(outcome and outcome.promoted) or "already @champion" in decision.reason
    window.update(decision="promoted" if promoted else "refused", reason=decision.reason,
                  sets={k: {x: v.get(x) for x in ("challenger", "champion", "result")} for k, v in decision.sets.items()})
    state.setdefault("windows", []).append(window)
    state["watermark"], state["pending"] = window["until"], None
    write_state(section.state, state, options)
    action = "promoted" if promoted else "refused"
    msg = (f"window {window['k']} ({window['since'] or 'the start'} .. {window['until']}, {window.get('samples')} "
           f"samples): {window['model']} v{window['version']} {action}: {decision.reason}")
    return AdaptOutcome(action, msg, window, section.state)


def outcome_dict(outcome: AdaptOutcome) -> dict[str, Any]:
    return asdict(outcome)
