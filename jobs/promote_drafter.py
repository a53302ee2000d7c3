"""Evaluate a drafter version against @champion and promote it; roll back; list (logic:
pipelines/promote.py).

    python jobs/promote_drafter.py --model dflash-smollm2-135m --list
    python jobs/promote_drafter.py --model dflash-smollm2-135m --challenger latest --prompts sharegpt \\
        --num-prompts 8 --max-new-tokens 64
    python jobs/promote_drafter.py --model dflash-smollm2-135m --rollback
    python jobs/promote_drafter.py --register specdec/drafters/smollm2-135m   # the first champion
    ray job submit --working-dir . -- python jobs/promote_drafter.py --target smollm2-135m --challenger 3

One run measures the target alone (ar), the champion's drafter and the challenger's drafter
side by side, interleaved, with the real engine: exactness (greedy token identity with ar
on every prompt), tau and speedup vs ar. The challenger is promoted (@champion moves to it,
@previous keeps the old champion) only when it is exact and its --metric beats the
champion's by --margin (relative); with no champion yet the bar is the target alone
(speedup >= 1 + margin), so a promotion never makes serving slower than AR. With several
--prompts sets (sharegpt,longctx; the default for a context=long challenger) it must beat
the champion by --margin on at least one set and lose no more than --tolerance on any.
Exit codes: 0 promoted / would promote (--dry-run) / listed / rolled back; 1 refused (the
reason is printed); 2 usage or registry errors.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the (uploaded) working dir's packages
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download at run time
# MLflow's client retries a dead server for minutes by default; a job should fail within seconds
FAST_FAIL_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from pipelines.promotion_rule import DEFAULT_MARGIN, DEFAULT_METRIC, DEFAULT_TOLERANCE, METRICS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--list", action="store_true", help="show versions, aliases, lineage and evaluation tags")
    what.add_argument("--rollback", action="store_true",
                      help="@champion <- @previous, @previous <- the demoted champion")
    what.add_argument("--register", metavar="DIR", default=None,
                      help="register this drafter directory (e.g. the packaged reference drafter "
                           "specdec/drafters/smollm2-135m) as a new version, then evaluate it as the challenger; "
                           "a directory already registered (same weights) is not registered twice")
    ap.add_argument("--model", default=None, help="registered model (default: dflash-<slug of --target>, "
                                                  "the name training registers)")
    ap.add_argument("--target", default=None,
                    help="target dir / .gguf / id to evaluate with (default: the model's lineage tag "
                         "target_model, else the embedded SmolLM2-135M-Instruct); also names the model")
    ap.add_argument("--target-dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"],
                    help="dtype to load the target in (its identity must match training's)")
    ap.add_argument("--challenger", default="latest", help="version number, 'latest' or an alias (default: latest)")
    ap.add_argument("--prompts", default=None,
                    help="held-out prompts: sharegpt (holdout split) | humaneval | longctx | path (.jsonl, .json, "
                         ".parquet), captured:<capture uri> (held-out served traffic, see --captured-holdout), or "
                         "several separated by commas (sharegpt,longctx), each measured side by side "
                         "(default: sharegpt; sharegpt,longctx for a challenger tagged context=long)")
    ap.add_argument("--captured-holdout", type=float, default=0.05,
                    help="captured:<uri> sets: the share of captured prompts held out from training, by hash (the "
                         "feature runs' features.prompts.holdout_fraction; default 0.05)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=None, help="draft block size (default: each drafter's own)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--lookup-block", type=int, default=0,
                    help="judge each drafter with prompt lookup beside it, drafting up to this many tokens, as "
                         "serving runs it (serving's lookup_block, 8 by default there); 0: the drafter alone")
    ap.add_argument("--metric", default=DEFAULT_METRIC, choices=METRICS,
                    help=f"what the challenger must improve (default: {DEFAULT_METRIC})")
    ap.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                    help=f"relative improvement required over the champion (default: {DEFAULT_MARGIN} = "
                         f"{DEFAULT_MARGIN * 100:g}%%)")
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                    help="several prompt sets: the challenger must beat the champion by --margin on at least one "
                         "and lose no more than this (relative) on any (default: "
                         f"{DEFAULT_TOLERANCE} = {DEFAULT_TOLERANCE * 100:g}%%)")
    ap.add_argument("--dry-run", action="store_true", help="evaluate and log, decide, but move no alias")
    ap.add_argument("--tracking-uri", default=None,
                    help="MLflow tracking/registry URI (default: $MLFLOW_TRACKING_URI, else the embedded sqlite)")
    ap.add_argument("--experiment", default=None, help="MLflow experiment of evaluation runs "
                                                      "(default: <model>-promotion)")
    ap.add_argument("--out", default=None, help="also keep benchmark.json / .png / decision.json in this directory")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:  # argparse: 0 for --help, 2 for bad flags
        return int(e.code or 0)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    from pipelines import promote as P

    try:
        name = P.model_name(args.model, args.target)
        if args.list:
            rows = P.list_versions(args.tracking_uri, name)
            if args.json:
                print(json.dumps(rows, indent=1))
            else:
                print(f"{name}: {len(rows)} version(s)")
                print(format_table(rows))
            return 0
        if args.rollback:
            rb = P.rollback(args.tracking_uri, name)
            print(f"rolled back {name}: @champion v{rb.champion_before} -> v{rb.champion_after}; "
                  f"@previous -> v{rb.previous_after}")
            return 0

        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        challenger = args.challenger
        if args.register:
            uri, challenger, new = P.register_directory(args.tracking_uri, name, args.register)
            print(f"{'registered' if new else 'already registered:'} {args.register} as {name} v{challenger} "
                  f"({uri})", flush=True)
        import transformers

        transformers.utils.logging.disable_progress_bar()
        cfg = P.PromoteConfig(
            tracking_uri=args.tracking_uri, model=name, target=args.target, target_dtype=args.target_dtype,
            challenger=challenger, prompts=args.prompts, num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens, block_size=args.block_size, batch_size=args.batch_size,
            lookup_block=args.lookup_block, captured_holdout=args.captured_holdout,
            margin=args.margin, metric=args.metric, tolerance=args.tolerance, dry_run=args.dry_run, experiment=args.experiment,
            seed=args.seed, out=args.out)
        try:
            outcome = P.promote(cfg)
        except P.RefusedWithOutcome as r:
            _show(r.outcome, args.json)
            return 1
        _show(outcome, args.json)
        return 0
    except P.REFUSALS as e:
        print(f"refused: {e}", file=sys.stderr)
        return 1
    except P.ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _show(outcome, as_json: bool) -> None:
    if as_json:
        print(json.dumps(outcome.as_dict(), indent=1, default=str))
    else:
        print(format_evaluation(outcome))
    if not outcome.decision.promote:
        print(f"refused: {outcome.decision.reason}", file=sys.stderr)


# ---------------------------------------------------------------------------- terminal output
LIST_COLUMNS = ("version", "aliases", "created", "target", "run", "context", "parent", "tau", "speedup", "exact",
                "vs", "decision")


def format_table(rows: list[dict], columns: tuple[str, ...] = LIST_COLUMNS) -> str:
    """``--list``: one aligned line per version (``pipelines.promote.list_versions`` rows)."""
    cells = [[str(r[c]) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    return "\n".join([line(columns)] + [line(r) for r in cells])


def format_evaluation(outcome) -> str:
    """The side-by-side table (one per prompt set) and the decision of a ``promote`` outcome."""
    from pipelines.registry import CHAMPION, PREVIOUS

    lines = []
    for r in (outcome.reports or {"": outcome.report}).values():
        lines += _report_lines(outcome, r)
    d = outcome.decision
    verdict = ("PROMOTED" if outcome.promoted else "WOULD PROMOTE (dry run, aliases untouched)" if d.promote
               else "REFUSED")
    rule = f"{d.metric}, margin {d.margin:.0%}" + (f", tolerance {d.tolerance:.0%}" if d.tolerance is not None else "")
    lines.append(f"decision ({rule}): {verdict}: {d.reason}")
    if outcome.promoted:
        lines.append(f"aliases: @{CHAMPION} -> v{outcome.challenger}"
                     + (f", @{PREVIOUS} -> v{outcome.champion_before}" if outcome.champion_before else ""))
    if len(outcome.run_ids) > 1:
        lines.append("evaluation runs: " + ", ".join(f"{k} {v}" for k, v in outcome.run_ids.items())
                     + f" (experiment {outcome.experiment})")
    else:
        lines.append(f"evaluation run: {outcome.run_id} (experiment {outcome.experiment})")
    return "\n".join(lines)


def _report_lines(outcome, r: dict) -> list[str]:
    """One prompt set's measurement: what was compared, a row per method, the cost terms."""
    from pipelines.registry import CHAMPION

    cfg = r["config"]
    lines = [f"{outcome.model} at {outcome.tracking_uri}: challenger v{outcome.challenger} vs "
             + (f"@{CHAMPION} v{outcome.champion_before}" if outcome.champion_before else "no champion")
             + f" | {cfg['num_prompts_used']} prompts from {cfg['prompts']}, {cfg['max_new_tokens']} new tokens "
             "each, greedy, one interleaved run",
             f"{'method':<14}{'role':<12}{'block':>6}{'tok/s':>10}{'speedup':>9}{'tau':>7}  exact"]
    for x in r["results"]:
        exact = "-" if x["method"] == "ar" else str(r["exactness"]["equal"][x["method"]]).lower()
        tau = "-" if x["tau_mean"] is None else f"{x['tau_mean']:.3f}"
        lines.append(f"{x['method']:<14}{x['role']:<12}{x['block_size'] or '-':>6}{x['tokens_per_s']:>10.2f}"
                     f"{x['speedup_vs_ar']:>8.3f}x{tau:>7}  {exact}")
    for m, c in r["cost_terms"].items():
        if m != "L_ar_s":
            lines.append(f"cost terms {m}: tau {c['tau']:.2f} vs r_d+r_v+r_o = {c['r_d']:.2f}+{c['r_v']:.2f}+"
                         f"{c['r_o']:.2f} -> predicted {c['predicted_speedup']:.2f}x")
    return lines


if __name__ == "__main__":
    for key, value in FAST_FAIL_ENV.items():
        os.environ.setdefault(key, value)
    sys.exit(main())
