"""Drafter promotion against a real `mlflow server` (sqlite backend, local artifact root,
127.0.0.1) started by this module: register versions with lineage, evaluate side by side
with the real engine, promote, refuse a worse / inexact / other-target challenger, roll
back, list; an unreachable registry is a clear error and leaves the aliases alone; a
failed alias write is undone. Also once on the embedded sqlite registry with artifacts
in s3:// (moto's S3 API on loopback).

Drafters on a tiny target whose greedy continuation cycles through 16 tokens
(specdec.tiny.save_cyclic_target): a random drafter (tau ~1.05) and a hand-built
"copy the anchor" drafter whose first draft token is always right (tau ~1.9, and faster),
so "better" is decided by a wide margin without training anything.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from pipelines import evaluate as E
from pipelines import promote as P
from pipelines import promotion_rule as rule
from pipelines import reference as R
from pipelines import registry
from specdec import tiny

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "jobs"))
import promote_drafter as job  # noqa: E402

MODEL = "dflash-cyclic"
BLOCK = 4
LAYERS = [1, 2]
PROMPT_ARGS = ["--num-prompts", "3", "--max-new-tokens", "16"]


# ---------------------------------------------------------------------------- helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_anchor_drafter(target):
    return tiny.copy_anchor_drafter(target, block_size=BLOCK, target_layer_ids=LAYERS)


def register(uri: str, name: str, drafter, target, target_dir: Path | str, run_name: str,
             identity: str | None = None) -> str:
    """What training does: the drafter dir with lineage as a run artifact, then a version
    tagged with the lineage (pipelines.registry)."""
    from specdec.checkpoint import save_drafter

    run_id = registry.start_run(uri, name, run_name)
    drafter.config.extra = {
        "target_model": str(target_dir), "target_identity": identity or target.identity,
        "features_uri": f"/data/features/{run_name}", "features_manifest_sha256": "f" * 64,
        "config_sha256": "c" * 64, "git_commit": "0" * 40, "run_name": run_name, "mlflow_run_id": run_id,
        "block_size": drafter.config.block_size, "num_layers": 1, "target_layer_ids": LAYERS,
    }
    with tempfile.TemporaryDirectory() as tmp:
        save_drafter(drafter, Path(tmp) / "drafter")
        source = registry.log_artifacts(uri, run_id, Path(tmp) / "drafter", "drafter")
    version = registry.register_drafter(uri, run_id, source, name, registry.lineage_tags(drafter.config.extra))
    registry.finish_run(uri, run_id)
    return version


def aliases(uri: str, name: str) -> dict[str, str]:
    return {a: str(v) for a, v in registry.client(uri).get_registered_model(name).aliases.items()}


def tags(uri: str, name: str, version: str) -> dict[str, str]:
    return registry.client(uri).get_model_version(name, version).tags


def run_job(capsys, *argv: str) -> tuple[int, str, str]:
    code = job.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def fake_measure(speedups: dict[str, float], exact: bool = True):
    """A stand-in for E.measure with given numbers (for alias-failure paths, no engine)."""
    def measure(target, candidates, prompts, prompt_ids, max_new_tokens, prompts_source, **kw):
        res = [{"method": "ar", "version": None, "role": "reference", "block_size": None, "tokens_per_s": 10.0,
                "speedup_vs_ar": 1.0, "tau_mean": None, "tau_hist": None, "draft_s": None, "verify_s": None,
                "overhead_s": None}]
        for c in candidates:
            s = speedups[c.version]
            res.append({"method": c.label, "version": c.version, "role": c.role, "block_size": c.block_size,
                        "tokens_per_s": 10.0 * s, "speedup_vs_ar": s, "tau_mean": 1.0 + s, "tau_hist": {"2": 3},
                        "draft_s": 0.1, "verify_s": 0.1, "overhead_s": 0.1})
        return {"config": {"target_id": target.model_id, "target_identity": target.identity, "prompts": prompts_source,
                           "num_prompts_used": len(prompts), "max_new_tokens": max_new_tokens, "batch_size": 1},
                "results": res, "cost_terms": {},
                "exactness": {"reference": "ar", "applicable": True, "equal": {c.label: exact for c in candidates},
                              "first_mismatch": {c.label: None if exact else [0, 3] for c in candidates}}}
    return measure


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("promote")


@pytest.fixture(scope="module")
def server(work):
    """A real `mlflow server` on loopback; its URL. Started first: it boots while the
    targets are built."""
    port = free_port()
    log = open(work / "mlflow.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{work}/mlflow.db",
         "--artifacts-destination", str(work / "art"), "--serve-artifacts", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=work,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # no job-runner process to boot
    url = f"http://127.0.0.1:{port}"
    yield url, proc
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its own worker processes
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    log.close()


@pytest.fixture(scope="module")
def prompts(work) -> str:
    path = work / "holdout.jsonl"
    rows = [{"id": f"h{i}", "prompt": q} for i, q in enumerate(["hi", "what is 3 + 4?", "name a cat", "sing"])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def uri(server, target, work):
    """The server's URL once it answers /health (targets were built meanwhile)."""
    url, proc = server
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return url
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"mlflow server did not start: {(work / 'mlflow.log').read_text()[-2000:]}")
        time.sleep(0.5)


# ---------------------------------------------------------------------------- decision rule
def ev(version, speedup=1.0, tau=1.5, exact=True, role="challenger"):
    return P.Evaluation(version=version, role=role, exact=exact, tau=tau, speedup=speedup, tokens_per_s=speedup * 10,
                        ar_tokens_per_s=10.0, first_mismatch=None if exact else [1, 5])


def test_decision_rule():
    champ = ev("1", speedup=1.00, tau=2.0, role="champion")
    d = rule.decide(ev("2", speedup=1.50, exact=False), champ)
    assert not d.promote and "not exact" in d.reason and "prompt 1, token 5" in d.reason
    assert not rule.decide(ev("2", exact=False), None).promote  # not even as the first champion
    # no champion yet: the bar is the target alone, so a drafter slower than AR never serves
    assert rule.decide(ev("2", speedup=1.03), None).promote
    d = rule.decide(ev("2", speedup=0.5), None)
    assert not d.promote and "not faster than the target alone" in d.reason and "0.500x" in d.reason
    assert not rule.decide(ev("2", speedup=1.01), None).promote  # within the margin
    assert rule.decide(ev("2", speedup=1.03), champ).promote  # +3% >= 2%
    d = rule.decide(ev("2", speedup=1.01), champ)
    assert not d.promote and "margin" in d.reason and "1.010x" in d.reason and "1.000x" in d.reason
    assert not rule.decide(ev("2", speedup=1.03), champ, margin=0.05).promote
    assert rule.decide(ev("2", speedup=0.9, tau=2.2), champ, metric="tau").promote  # tau +10%
    assert not rule.decide(ev("2", speedup=2.0, tau=2.0), champ, metric="tau").promote
    assert not rule.decide(ev("1"), ev("1", role="champion")).promote
    with pytest.raises(P.PromoteError, match="--metric"):
        rule.decide(ev("2"), champ, metric="latency")


def test_decision_rule_on_several_prompt_sets():
    """Exact everywhere; beat the champion by the margin on one set AND lose no more than
    the tolerance on any; no champion: beat the target alone on every set; one set is
    decide() exactly."""
    def sets(**numbers):  # set -> (challenger tau, champion tau or None)
        return {n: (ev("3", tau=c, speedup=c), None if o is None else ev("2", tau=o, speedup=o, role="champion"))
                for n, (c, o) in numbers.items()}

    d = rule.decide_sets(sets(longctx=(1.41, 1.22), sharegpt=(1.10, 1.23)), metric="tau")
    assert not d.promote
    assert d.reason == ("v3 beats v2 on longctx (tau 1.410 vs 1.220, +15.6%) but loses on sharegpt "
                        "(tau 1.100 vs 1.230, -10.6% > 5%)")
    assert d.sets["longctx"]["result"] == "better" and d.sets["sharegpt"]["result"] == "worse"
    d = rule.decide_sets(sets(longctx=(1.41, 1.22), sharegpt=(1.20, 1.23)), metric="tau")  # -2.4%: within 5%
    assert d.promote and "beats v2 on longctx" in d.reason and "within 5% on sharegpt (tau 1.200 vs 1.230" in d.reason
    assert d.tolerance == 0.05 and d.sets["sharegpt"]["result"] == "within"
    assert not rule.decide_sets(sets(longctx=(1.41, 1.22), sharegpt=(1.20, 1.23)), metric="tau", tolerance=0.02).promote
    assert rule.decide_sets(sets(a=(1.5, 1.0), b=(1.6, 1.0))).promote  # better on both (speedup by default)
    d = rule.decide_sets(sets(a=(1.01, 1.0), b=(1.0, 1.0)))  # within the tolerance everywhere, better nowhere
    assert not d.promote and "not better by the margin on any prompt set" in d.reason
    d = rule.decide_sets(sets(a=(1.01, 1.0), b=(0.5, 1.0)))
    assert not d.promote and "loses more than 5% on b" in d.reason
    assert rule.decide_sets(sets(a=(1.03, 1.0), b=(0.951, 1.0))).promote  # exactly at the edges
    assert not rule.decide_sets(sets(a=(1.03, 1.0), b=(0.949, 1.0))).promote
    # exact on every set
    bad = sets(a=(2.0, 1.0), b=(2.0, 1.0))
    bad["b"] = (ev("3", tau=2.0, speedup=2.0, exact=False), bad["b"][1])
    d = rule.decide_sets(bad)
    assert not d.promote and "not exact on b" in d.reason and "prompt 1, token 5" in d.reason
    # no champion: the target alone is the bar on every set
    assert rule.decide_sets(sets(a=(1.1, None), b=(1.05, None))).promote
    d = rule.decide_sets(sets(a=(1.5, None), b=(0.9, None)))
    assert not d.promote and "not faster than the target alone on b" in d.reason and d.sets["b"]["vs"] == "ar"
    with pytest.raises(P.PromoteError, match="different champions"):
        rule.decide_sets(sets(a=(1.5, 1.0), b=(1.5, None)))
    assert not rule.decide_sets({"a": (ev("2"), ev("2", role="champion")), "b": (ev("2"), ev("2", role="champion"))}
                             ).promote  # already the champion
    # one set: decide() exactly, with the set's numbers recorded
    one = rule.decide_sets(sets(a=(1.01, 1.0)))
    assert one.reason == rule.decide(ev("3", tau=1.01, speedup=1.01), ev("2", speedup=1.0, tau=1.0, role="champion")).reason
    assert one.tolerance is None and one.sets["a"]["gain"] == pytest.approx(0.01)
    for bad_args, pattern in (({"tolerance": 1.0}, "--tolerance"), ({"tolerance": -0.1}, "--tolerance"),
                              ({"metric": "latency"}, "--metric"), ({"margin": -1}, "--margin")):
        with pytest.raises(P.PromoteError, match=pattern):
            rule.decide_sets(sets(a=(1.5, 1.0), b=(1.5, 1.0)), **bad_args)
    with pytest.raises(P.PromoteError, match="no prompt set"):
        rule.decide_sets({})

    # which sets: as given; else sharegpt, plus longctx for a context: long challenger
    assert P.PromoteConfig().prompt_sets({}) == ["sharegpt"]
    assert P.PromoteConfig().prompt_sets({"context": "long"}) == ["sharegpt", "longctx"]
    assert P.PromoteConfig(prompts="humaneval").prompt_sets({"context": "long"}) == ["humaneval"]
    assert P.PromoteConfig(prompts=" sharegpt, longctx").prompt_sets({}) == ["sharegpt", "longctx"]
    with pytest.raises(P.PromoteError, match="--prompts"):
        P.PromoteConfig(prompts="sharegpt,,longctx")
    with pytest.raises(P.PromoteError, match="--tolerance"):
        P.PromoteConfig(tolerance=2)


def per_set_measure(numbers: dict[str, dict[str, float]]):
    """Like fake_measure, with numbers per prompt set (keyed by the file's stem)."""
    def measure(target, candidates, prompts, prompt_ids, max_new_tokens, prompts_source, **kw):
        return fake_measure(numbers[Path(prompts_source).stem])(target, candidates, prompts, prompt_ids,
                                                                max_new_tokens, prompts_source, **kw)
    return measure


def test_long_context_challenger_is_judged_on_every_prompt_set(work, target, target_dir, capsys, monkeypatch):
    """A context: long challenger measured on a short and a long prompt set (given numbers):
    better on the long one but 10% slower on the short one is refused naming both sets;
    within the tolerance it is promoted. --list shows its context and parent."""
    (work / "multi").mkdir(exist_ok=True)
    db = f"sqlite:///{work}/multi/mlflow.db"
    for stem in ("short", "long"):
        (work / "multi" / f"{stem}.jsonl").write_text("".join(
            json.dumps({"id": f"{stem}{i}", "prompt": q}) + "\n" for i, q in enumerate(["hi", "name a cat"])))
    sets_arg = f"{work}/multi/short.jsonl,{work}/multi/long.jsonl"
    v1 = register(db, MODEL, copy_anchor_drafter(target), target, target_dir, "short-champion")
    registry.client(db).set_registered_model_alias(MODEL, "champion", v1)
    v2 = register(db, MODEL, copy_anchor_drafter(target), target, target_dir, "long-a")
    v3 = register(db, MODEL, copy_anchor_drafter(target), target, target_dir, "long-b")
    for v in (v2, v3):
        registry.set_version_tags(db, MODEL, v, {"context": "long", "parent_version": v1})
    base = ["--tracking-uri", db, "--model", MODEL, "--prompts", sets_arg, "--num-prompts", "2",
            "--max-new-tokens", "8"]

    monkeypatch.setattr(E, "measure", per_set_measure({"short": {v1: 1.23, v2: 1.10}, "long": {v1: 1.22, v2: 1.41}}))
    code, out, err = run_job(capsys, *base, "--challenger", v2)
    assert code == 1, err
    assert f"v{v2} beats v{v1} on long (speedup 1.410x vs 1.220x, +15.6%) but loses on short (speedup 1.100x vs " \
           "1.230x, -10.6% > 5%)" in err, err
    assert out.count("prompts from") == 2 and "REFUSED" in out and "tolerance 5%" in out
    t = tags(db, MODEL, v2)
    assert t["promotion.decision"] == "refused" and t["eval.prompts"] == "short,long"
    assert "short: tau 2.100, speedup 1.100x" in t["eval.sets"] and "long: tau 2.410" in t["eval.sets"]
    runs = registry.client(db).search_runs([registry.client(db).get_experiment_by_name(f"{MODEL}-promotion")
                                            .experiment_id])
    assert sorted(r.info.run_name for r in runs) == [f"eval-v{v2}-vs-v{v1}-long", f"eval-v{v2}-vs-v{v1}-short"]
    assert aliases(db, MODEL) == {"champion": v1}

    monkeypatch.setattr(E, "measure", per_set_measure({"short": {v1: 1.23, v3: 1.20}, "long": {v1: 1.22, v3: 1.41}}))
    code, out, err = run_job(capsys, *base, "--challenger", v3)
    assert code == 0 and "PROMOTED" in out and "within 5% on short" in out, err
    assert aliases(db, MODEL) == {"champion": v3, "previous": v1}

    code, out, err = run_job(capsys, "--tracking-uri", db, "--model", MODEL, "--list")
    assert code == 0, err
    header, *rows = out.splitlines()[1:]
    assert "context" in header.split() and "parent" in header.split()
    lines = {ln.split()[0]: ln.split() for ln in rows}
    assert "long" in lines[v3] and f"v{v1}" in lines[v3] and "long" not in lines[v1]


def test_held_out_captured_traffic_is_a_prompt_set(work, target, target_dir, capsys, monkeypatch):
    """--prompts captured:<uri>: the served traffic captured there (serve_app/capture.py's files)
    whose prompts fall in the held-out split at --captured-holdout, measured as the target saw
    them (token ids), side by side like any set; none held out is a clear error."""
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines.features.captured import sample_id
    from serve_app.capture import CAPTURE_SCHEMA
    from specdec.prompts import is_holdout

    prompts = [target.encode_chat([{"role": "user", "content": "go " * (i % 9 + 1) + str(i)}]) for i in range(24)]
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = [{"request_id": f"r{i}", "time": now, "model": "cyclic", "drafter_source": "", "drafter_version": "",
             "prompt_ids": p, "answer_ids": [1, 2], "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 2,
             "finish_reason": "length", "accepted": []} for i, p in enumerate(prompts)]
    (work / "traffic" / "date=2026-12-07").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=CAPTURE_SCHEMA), work / "traffic" / "date=2026-12-07" / "a.parquet")
    held = {sample_id(p): p for p in prompts if is_holdout(sample_id(p), 0.25)}
    assert 2 <= len(held) <= 12

    db = f"sqlite:///{work}/captured-set/mlflow.db"
    v1 = register(db, MODEL, copy_anchor_drafter(target), target, target_dir, "traffic-a")
    seen = {}

    def measure(target, candidates, prompts, prompt_ids, *args, **kw):
        seen.update(zip(prompt_ids, prompts))
        return real(target, candidates, prompts, prompt_ids, *args, **kw)

    real = E.measure
    monkeypatch.setattr(E, "measure", measure)
    base = ["--tracking-uri", db, "--model", MODEL, "--prompts", f"captured:{work}/traffic", "--captured-holdout",
            "0.25", "--max-new-tokens", "16"]
    code, out, err = run_job(capsys, *base, "--num-prompts", "2", "--challenger", v1)
    # promoted or not is the rule's verdict on the speed this machine measured (the copy-anchor
    # drafter lost to the target alone on a loaded hour: 0.895x); what is tested is the set measured
    t = tags(db, MODEL, v1)
    assert t["eval.exact"] == "true" and float(t["eval.tau"]) > 1.5, (out, err)
    assert code == (0 if float(t["eval.speedup"]) >= 1.02 else 1) and ("PROMOTED" in out) == (code == 0), (out, err)
    assert len(seen) == 2 and all(held[i] == p for i, p in seen.items())  # held-out prompts, as served
    assert tags(db, MODEL, v1)["eval.prompts"] == f"captured:{work}/traffic"
    v2 = register(db, MODEL, copy_anchor_drafter(target), target, target_dir, "traffic-b")
    code, out, err = run_job(capsys, *base[:-4], "--captured-holdout", "1e-9", "--max-new-tokens", "16",
                             "--challenger", v2, "--dry-run")
    assert code == 2 and "no held-out prompts in 'captured:" in err, (out, err)


def test_register_a_drafter_directory_as_the_first_champion(work, target, target_dir, capsys, monkeypatch):
    """--register DIR (how the packaged reference drafter becomes the first champion): a new
    store is created, the directory becomes v1 with its lineage and weights hash, and is
    judged against the target alone; the same weights again register nothing."""
    from specdec.checkpoint import save_drafter

    d = copy_anchor_drafter(target)
    d.config.extra = {"target_model": str(target_dir), "target_identity": target.identity, "run_name": "elsewhere",
                      "block_size": BLOCK}
    src = save_drafter(d, work / "outside" / "drafter")
    db = f"sqlite:///{work}/fresh-store/mlflow.db"  # its directory does not exist yet
    base = ["--tracking-uri", db, "--model", MODEL, *PROMPT_ARGS]

    monkeypatch.setattr(E, "measure", fake_measure({"1": 1.30}))
    code, out, err = run_job(capsys, *base, "--register", str(src))
    assert code == 0, err
    assert f"registered {src} as {MODEL} v1" in out and "PROMOTED" in out and "target alone" in out
    assert aliases(db, MODEL) == {"champion": "1"}
    t = tags(db, MODEL, "1")
    assert t["run_name"] == "elsewhere" and t["target_identity"] == target.identity
    assert t["registered_from"] == str(src.resolve()) and len(t["weights_sha256"]) == 64

    code, out, err = run_job(capsys, *base, "--register", str(src))
    assert code == 1 and f"already registered: {src} as {MODEL} v1" in out and "already @champion" in err
    assert len(registry.client(db).search_model_versions(f"name = '{MODEL}'")) == 1

    (work / "outside" / "empty").mkdir()
    code, out, err = run_job(capsys, *base, "--register", str(work / "outside" / "empty"))
    assert code == 2 and "--register:" in err and "not a drafter directory" in err


# ---------------------------------------------------------------------------- the flow
@pytest.fixture(scope="module")
def flow_versions(uri, target, target_dir):
    from specdec.tiny import random_drafter

    v1 = register(uri, MODEL, random_drafter(target, block_size=BLOCK, layers=1, seed=1, mask_token_id=16,
                                             target_layer_ids=LAYERS), target, target_dir, "random-a")
    v2 = register(uri, MODEL, copy_anchor_drafter(target), target, target_dir, "copy-anchor")
    v3 = register(uri, MODEL, random_drafter(target, block_size=BLOCK, layers=1, seed=2, mask_token_id=16,
                                             target_layer_ids=LAYERS), target, target_dir, "random-b")
    # trained for another target (lineage says so): refused on its tags, before any download
    v4 = register(uri, MODEL, random_drafter(target, block_size=BLOCK, layers=1, seed=3, mask_token_id=16,
                                             target_layer_ids=LAYERS), target, "/models/other-target",
                  "other-target", identity="e" * 64)
    return v1, v2, v3, v4


def test_promote_refuse_rollback_list(uri, flow_versions, prompts, target, capsys, monkeypatch):
    v1, v2, v3, v4 = flow_versions
    base = ["--tracking-uri", uri, "--model", MODEL, "--prompts", prompts, *PROMPT_ARGS]

    # no champion yet: the bar is the target alone; a random drafter is exact but slower
    # than AR, so it stays registered without an alias
    code, out, err = run_job(capsys, *base, "--challenger", v1)
    assert code == 1 and "not faster than the target alone" in err, err
    assert aliases(uri, MODEL) == {}
    t1 = tags(uri, MODEL, v1)
    assert t1["eval.exact"] == "true" and t1["eval.vs"] == "ar" and t1["promotion.decision"] == "refused"
    assert float(t1["eval.speedup"]) < 1.0

    # a drafter that beats the target alone becomes the first champion (at B=2 its first
    # draft token, always right, makes tau 2 at the cost of a 2-token verify: a clear win
    # even on a tiny target whose steps are all overhead)
    # (the numbers of this one step are given: on a tiny target a drafter's pass costs about
    # what a target step does, so a real speedup over AR is timing noise; the pure rule is
    # tested in test_decision_rule, the real measurement in the steps before and after)
    with monkeypatch.context() as m:
        m.setattr(E, "measure", fake_measure({v2: 1.5}))
        code, out, err = run_job(capsys, *base, "--challenger", v2)
    assert code == 0, err
    assert "PROMOTED" in out and f"dflash:v{v2}" in out and "faster than the target alone" in out
    assert aliases(uri, MODEL) == {"champion": v2}
    assert registry.client(uri).get_registered_model(MODEL).tags["target_identity"] == target.identity  # pinned
    t2 = tags(uri, MODEL, v2)
    assert t2["eval.exact"] == "true" and t2["eval.vs"] == "ar" and t2["promotion.decision"] == "promoted"
    assert float(t2["eval.tau"]) > 1.6 > float(t1["eval.tau"])
    assert float(t2["eval.speedup"]) > 1.02

    # a challenger measured against the champion in the same run (ar, v2 and v1): refused
    code, out, err = run_job(capsys, *base, "--challenger", v1)
    assert code == 1 and "not better by the margin" in err and f"v{v2}" in err, err
    assert f"dflash:v{v1}" in out and f"dflash:v{v2}" in out
    assert aliases(uri, MODEL) == {"champion": v2}
    registry.client(uri).set_registered_model_alias(MODEL, "previous", v1)  # a history to roll back to

    # the evaluation is an MLflow run linked to the version: metrics, benchmark JSON + plot
    c = registry.client(uri)
    t1 = tags(uri, MODEL, v1)
    run = c.get_run(t1["eval.run_id"])
    assert run.data.tags["dflash.model_version"] == f"{MODEL}/{v1}" and run.data.tags["dflash.champion_version"] == v2
    assert run.data.metrics["exact"] == 1.0 and run.data.metrics["tau"] == pytest.approx(float(t1["eval.tau"]), abs=1e-3)
    assert {"speedup", "tokens_per_s", "champion.speedup", "ar.tokens_per_s"} <= set(run.data.metrics)
    assert {a.path for a in c.list_artifacts(run.info.run_id, "eval")} == {
        "eval/benchmark.json", "eval/benchmark.png", "eval/decision.json"}
    with tempfile.TemporaryDirectory() as tmp:
        bench = json.loads(Path(c.download_artifacts(run.info.run_id, "eval/benchmark.json", tmp)).read_text())
    assert [r["method"] for r in bench["results"]] == ["ar", f"dflash:v{v2}", f"dflash:v{v1}"]
    assert bench["exactness"]["equal"] == {f"dflash:v{v1}": True, f"dflash:v{v2}": True}
    assert bench["config"]["num_prompts_used"] == 3 and bench["config"]["target_identity"] == target.identity

    # a worse challenger: refused with the reason, aliases untouched
    code, out, err = run_job(capsys, *base, "--challenger", v3)
    assert code == 1
    assert "refused:" in err and "not better by the margin" in err and f"v{v2}" in err
    assert aliases(uri, MODEL) == {"champion": v2, "previous": v1}
    assert tags(uri, MODEL, v3)["promotion.decision"] == "refused"

    # a drafter of another target: refused before anything is measured, naming target_identity
    code, out, err = run_job(capsys, *base, "--challenger", v4)
    assert code == 1 and "target_identity eeeeeeeeeeee" in err and target.identity[:12] in err, err
    assert "eval.run_id" not in tags(uri, MODEL, v4) and tags(uri, MODEL, v4)["promotion.decision"] == "refused"
    assert aliases(uri, MODEL) == {"champion": v2, "previous": v1}

    # roll back: @champion <- @previous (and back again)
    code, out, err = run_job(capsys, "--tracking-uri", uri, "--model", MODEL, "--rollback")
    assert code == 0 and f"v{v2} -> v{v1}" in out
    assert aliases(uri, MODEL) == {"champion": v1, "previous": v2}

    # list: versions, aliases, lineage, evaluation tags
    code, out, err = run_job(capsys, "--tracking-uri", uri, "--model", MODEL, "--list")
    assert code == 0, err
    lines = {ln.split()[0]: ln for ln in out.splitlines()[2:]}
    assert set(lines) == {v1, v2, v3, v4}
    assert "@champion" in lines[v1] and "@previous" in lines[v2] and "promoted" in lines[v2]
    assert target.identity[:12] in lines[v2] and "copy-anchor" in lines[v2]
    assert tags(uri, MODEL, v2)["eval.tau"] in lines[v2]  # its latest measurement (as champion vs v3)
    assert "refused" in lines[v3] and "eeeeeeeeeeee" in lines[v4]
    code, out, _ = run_job(capsys, "--tracking-uri", uri, "--model", MODEL, "--list", "--json")
    rows = {r["version"]: r for r in json.loads(out)}
    assert rows[v2]["lineage"]["config_sha256"] == "c" * 64 and rows[v2]["lineage"]["git_commit"] == "0" * 40
    assert rows[v2]["eval"]["run_id"] == tags(uri, MODEL, v2)["eval.run_id"]  # re-measured as champion vs v3
    assert rows[v3]["eval"]["vs"] == f"v{v2}" and rows[v3]["promotion"]["decision"] == "refused"


def test_unreachable_registry_is_a_clear_error_and_changes_nothing(uri, flow_versions, prompts, capsys):
    before = aliases(uri, MODEL)
    dead = f"http://127.0.0.1:{free_port()}"
    for extra in (["--challenger", flow_versions[1]], ["--rollback"], ["--list"]):
        t0 = time.monotonic()
        code, out, err = run_job(capsys, "--tracking-uri", dead, "--model", MODEL, "--prompts", prompts,
                                 *PROMPT_ARGS, *extra)
        assert code == 2 and f"registry at {dead} unreachable" in err, err
        assert time.monotonic() - t0 < 30  # no minutes of retries
    assert aliases(uri, MODEL) == before


def test_cli_script(uri, flow_versions, capsys):
    """The job as users (and `ray job submit`) run it: a separate process."""
    script = str(REPO / "jobs" / "promote_drafter.py")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    r = subprocess.run([sys.executable, script, "--model", MODEL, "--list"], capture_output=True, text=True,
                       env=env, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert f"{MODEL}: 4 version(s)" in r.stdout and "@champion" in r.stdout
    assert run_job(capsys, "--help")[0] == 0
    assert run_job(capsys, "--list", "--rollback")[0] == 2  # usage error
    code, out, err = run_job(capsys, "--tracking-uri", uri, "--model", MODEL, "--num-prompts", "0")
    assert code == 2 and "--num-prompts must be >= 1" in err
    code, out, err = run_job(capsys, "--tracking-uri", uri, "--model", "dflash-nope", "--list")
    assert code == 2 and "no model 'dflash-nope'" in err
    code, out, err = run_job(capsys, "--tracking-uri", uri, "--model", MODEL, "--challenger", "99")
    assert code == 2 and "no version or alias '99'" in err


# ---------------------------------------------------------------------------- failure paths
@pytest.fixture(scope="module")
def fail_versions(uri, target, target_dir):
    from specdec.tiny import random_drafter

    mk = lambda seed: random_drafter(target, block_size=BLOCK, layers=1, seed=seed, mask_token_id=16,  # noqa: E731
                                     target_layer_ids=LAYERS)
    return [register(uri, "dflash-fail", mk(s), target, target_dir, f"r{s}") for s in (4, 5)]


def test_inexact_challenger_is_refused(uri, fail_versions, prompts, monkeypatch, capsys):
    """The engine is exact for any drafter, so exactness is flipped in the real measurement."""
    real = E.measure

    def inexact(*a, **kw):
        report = real(*a, **kw)
        for m in report["exactness"]["equal"]:
            report["exactness"]["equal"][m] = False
            report["exactness"]["first_mismatch"][m] = [2, 7]
        return report

    monkeypatch.setattr(E, "measure", inexact)
    code, out, err = run_job(capsys, "--tracking-uri", uri, "--model", "dflash-fail", "--challenger", fail_versions[0],
                             "--prompts", prompts, *PROMPT_ARGS)
    assert code == 1 and "not exact" in err and "prompt 2, token 7" in err
    assert aliases(uri, "dflash-fail") == {}
    t = tags(uri, "dflash-fail", fail_versions[0])
    assert t["eval.exact"] == "false" and t["promotion.decision"] == "refused"


def test_dry_run_and_undone_alias_write(uri, fail_versions, prompts, monkeypatch, capsys):
    """A dry run moves nothing. The registry fails between the two alias writes
    (@previous set, @champion not): @previous is undone, nothing half-moved is left, and
    the error says so."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    v1, v2 = fail_versions
    registry.client(uri).set_registered_model_alias("dflash-fail", "champion", v1)
    before = aliases(uri, "dflash-fail")
    assert before == {"champion": v1}
    monkeypatch.setattr(E, "measure", fake_measure({v1: 1.0, v2: 2.0}))

    # a dry run decides and logs but moves nothing
    code, out, err = run_job(capsys, "--tracking-uri", uri, "--model", "dflash-fail", "--challenger", v2,
                             "--prompts", prompts, *PROMPT_ARGS, "--dry-run")
    assert code == 0 and "WOULD PROMOTE" in out, err
    assert aliases(uri, "dflash-fail") == before
    assert tags(uri, "dflash-fail", v2)["promotion.decision"] == "would-promote (dry run)"
    real_set = MlflowClient.set_registered_model_alias

    def flaky(self, name, alias, version):
        if alias == "champion" and str(version) == v2:
            raise MlflowException("API request to endpoint /api/2.0/mlflow/registered-models/alias failed with "
                                  "exception HTTPConnectionPool: Max retries exceeded (Connection refused)")
        return real_set(self, name, alias, version)

    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", flaky)
    code, out, err = run_job(capsys, "--tracking-uri", uri, "--model", "dflash-fail", "--challenger", v2,
                             "--prompts", prompts, *PROMPT_ARGS)
    assert code == 2 and "unreachable while setting @champion" in err, err
    assert "aliases restored: @previous=unset" in err, err
    assert aliases(uri, "dflash-fail") == before  # @previous (briefly v1) was deleted again


# ---------------------------------------------------------------------------- embedded registry, S3 artifacts
def test_embedded_sqlite_registry_with_s3_artifacts(work, target, target_dir, prompts, capsys, monkeypatch):
    """The default store (a sqlite file, found through $MLFLOW_TRACKING_URI) with the
    drafters and the evaluation artifacts in s3:// (an S3 API server on loopback)."""
    import boto3
    from moto.server import ThreadedMotoServer

    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    s3.start()
    try:
        host, port = s3.get_host_and_port()
        for k, v in {"MLFLOW_S3_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
                     "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(k, v)
        boto3.client("s3", endpoint_url=f"http://{host}:{port}").create_bucket(Bucket="mlflow")
        (work / "embedded").mkdir(exist_ok=True)
        db = f"sqlite:///{work}/embedded/mlflow.db"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", db)
        c = registry.client(db)
        for exp in (MODEL, f"{MODEL}-promotion"):  # training's and promotion's experiments, on S3
            c.create_experiment(exp, artifact_location=f"s3://mlflow/{exp}")
        v1 = register(db, MODEL, copy_anchor_drafter(target), target, target_dir, "embedded")
        assert c.get_model_version(MODEL, v1).source.startswith("s3://mlflow/")

        # the S3 download stays real; the numbers are given (a first champion must beat AR,
        # which on a tiny target is timing noise)
        monkeypatch.setattr(E, "measure", fake_measure({v1: 1.5}))
        code, out, err = run_job(capsys, "--model", MODEL, "--prompts", prompts, *PROMPT_ARGS, "--metric", "tau")
        assert code == 0, err
        assert aliases(db, MODEL) == {"champion": v1}
        run = c.get_run(tags(db, MODEL, v1)["eval.run_id"])
        assert run.info.artifact_uri.startswith("s3://mlflow/")
        assert {a.path for a in c.list_artifacts(run.info.run_id, "eval")} >= {"eval/benchmark.json",
                                                                                "eval/benchmark.png"}
        code, out, err = run_job(capsys, "--model", MODEL, "--rollback")
        assert code == 1 and "no @previous" in err
        code, out, err = run_job(capsys, "--model", MODEL, "--list")
        assert code == 0 and "@champion" in out
    finally:
        s3.stop()


# ---------------------------------------------------------------------------- the packaged reference
def test_publish_reference_replaces_only_a_winner(target, work, prompts, monkeypatch):
    """jobs/publish_reference.py's rule: with no reference yet the bar is the target alone,
    then the current reference; the winner is written in fp16 with its numbers."""
    from safetensors.torch import load_file

    from specdec.checkpoint import load_drafter, save_drafter
    from specdec.tiny import random_drafter

    root = work / "reference"
    slow = save_drafter(random_drafter(target, block_size=BLOCK, layers=1, seed=5, mask_token_id=16,
                                       target_layer_ids=LAYERS), work / "cand-random")
    fast = save_drafter(copy_anchor_drafter(target), work / "cand-copy")
    kw = dict(prompts=prompts, num_prompts=3, max_new_tokens=32, target=target, root=root, block_size=2)
    decision, report = R.publish_reference(slow, "cyclic", **kw)
    assert not decision.promote and "not faster than the target alone" in decision.reason
    assert not (root / "cyclic").exists() and report["exactness"]["equal"]["dflash:candidate"]

    with monkeypatch.context() as m:  # given numbers: a real win over AR is timing noise on a tiny target
        m.setattr(E, "measure", fake_measure({"candidate": 1.5}))
        decision, report = R.publish_reference(fast, "cyclic", command="python train.py", **kw)
    assert decision.promote, decision.reason
    d = load_drafter(root / "cyclic", target=target)
    ref = d.config.extra["reference"]
    stored = load_file(str(root / "cyclic" / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.float16} and d.fc.weight.dtype == target.dtype
    assert ref["exact"] and ref["tau"] > 1.6 and ref["speedup_vs_ar"] > 1.02
    assert ref["command"] == "python train.py"

    # now the bar is the published reference: a slower drafter leaves it in place
    decision, report = R.publish_reference(slow, "cyclic", **kw)
    assert not decision.promote and "not better by the margin" in decision.reason
    assert [r["method"] for r in report["results"]] == ["ar", "dflash:reference", "dflash:candidate"]
    assert load_drafter(root / "cyclic").config.extra["reference"]["tau"] == ref["tau"]


def test_drafter_cache_keeps_same_named_versions_of_two_registries_apart(work, target, target_dir):
    """v1 of one model name in two registries (two demo stacks, a staging and a prod MLflow)
    are two drafters: the node's download cache must not hand out the first for the second."""
    from safetensors.torch import load_file

    dirs = []
    for i, seed in enumerate((1, 2)):
        db = f"sqlite:///{work}/cache-{i}/mlflow.db"
        d = tiny.random_drafter(target, block_size=BLOCK, layers=1, seed=seed, mask_token_id=16,
                                target_layer_ids=LAYERS)
        v = register(db, MODEL, d, target, target_dir, f"cache-{i}")
        dirs.append(registry.resolve_drafter(db, f"models:/{MODEL}/{v}")[0])
    assert dirs[0] != dirs[1]
    a, b = (load_file(str(p / "model.safetensors")) for p in dirs)
    assert any(not torch.equal(a[k], b[k]) for k in a)
