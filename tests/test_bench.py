"""The engine benchmark (harness.bench) and the generate CLI on a tiny random target."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.bench import BenchConfig, run_benchmark, write_report
from specdec.bench import BenchError
from specdec.checkpoint import save_drafter
from specdec.drafter import DFlashDrafter, drafter_config_for_target
from specdec.target import load_target
from specdec.tiny import save_tiny_target

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
RESULT_KEYS = {"method", "tokens_per_s", "speedup_vs_ar", "tau_mean", "tau_hist", "draft_s", "verify_s", "overhead_s",
               "decode_tokens_per_s"}
ALL = ["hf_generate", "ar", "dflash", "lookup", "dflash_lookup", "prompt_lookup", "oracle"]
ENGINE = ("ar", "dflash", "lookup", "dflash_lookup", "oracle")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    tdir = save_tiny_target(root / "t")
    target = load_target(str(tdir))
    torch.manual_seed(0)
    cfg = drafter_config_for_target(target, num_hidden_layers=1, block_size=8)
    save_drafter(DFlashDrafter(cfg), root / "d")
    # same shapes, but layer ids this 6-layer target does not have
    save_drafter(DFlashDrafter(dataclasses.replace(cfg, target_layer_ids=[1, 2, 40])), root / "bad")
    prompts = root / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "Write a function that adds two numbers."}]},
        {"prompt": "Name three colours."},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]},
    ]) + "\n")
    return {"root": root, "target_dir": str(tdir), "target": target, "drafter": str(root / "d"),
            "bad": str(root / "bad"), "prompts": str(prompts)}


def test_benchmark_schema_exactness_and_plot(assets):
    out = assets["root"] / "run" / "b.json"
    cfg = BenchConfig(target=assets["target_dir"], drafter=assets["drafter"], prompts=assets["prompts"],
                      num_prompts=3, max_new_tokens=16, block_size=8, batch_size=2, methods=",".join(ALL),
                      save_outputs=True, out=str(out), progress=False)
    report = run_benchmark(cfg, target=assets["target"])
    write_report(report, out)
    data = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 1000

    assert set(data) == {"config", "results", "exactness", "cost_terms", "outputs"}
    c = data["config"]
    for k in ("target", "drafter", "prompts", "num_prompts", "max_new_tokens", "block_size", "temperature",
              "batch_size", "methods", "save_outputs", "out", "seed", "target_id", "target_identity", "drafter_path"):
        assert k in c, k
    assert {"cpu_count", "torch", "threads"} <= set(c["machine"])
    assert any("prompt by prompt" in n for n in c["notes"])  # batch 2: prompt_lookup ran per prompt

    assert [r["method"] for r in data["results"]] == ALL
    for r in data["results"]:
        assert set(r) == RESULT_KEYS
        assert isinstance(r["tokens_per_s"], float) and r["tokens_per_s"] > 0
        assert isinstance(r["speedup_vs_ar"], float)
        engine = r["method"] in ENGINE
        for k in ("tau_mean", "draft_s", "verify_s", "overhead_s", "decode_tokens_per_s"):
            assert isinstance(r[k], float) if engine else r[k] is None, (r["method"], k)
        if engine:  # prefill excluded: the decode rate is the higher one
            assert r["decode_tokens_per_s"] > r["tokens_per_s"]
        if engine:
            assert all(isinstance(k, str) and isinstance(v, int) for k, v in r["tau_hist"].items())
        else:
            assert r["tau_hist"] is None
    by = {r["method"]: r for r in data["results"]}
    assert by["ar"]["speedup_vs_ar"] == 1.0 and by["ar"]["tau_mean"] == 1.0
    assert by["oracle"]["tau_mean"] > 1
    assert max(map(int, by["oracle"]["tau_hist"])) == 8

    ex = data["exactness"]
    assert ex["applicable"] and all(ex["equal"][m] for m in ALL if m != "ar"), ex
    assert set(data["cost_terms"]["oracle"]) >= {"r_d", "r_v", "r_o", "tau"}

    outs = data["outputs"]
    assert set(outs) == set(ALL)
    assert all(len(o) == 3 and all(len(t) == 16 for t in o) for o in outs.values())
    assert all(isinstance(t, int) for t in outs["ar"][0])


def test_respect_eos_stops_every_method_at_the_same_token(assets, monkeypatch):
    """--respect-eos: HF generate, prompt lookup and our engine all stop at the target's stop
    tokens, so their outputs (and the exactness line) compare like for like."""
    target = assets["target"]
    base = dict(target=assets["target_dir"], drafter=assets["drafter"], prompts=assets["prompts"], num_prompts=3,
                max_new_tokens=16, methods="hf_generate,ar,dflash,prompt_lookup", save_outputs=True, progress=False)
    free = run_benchmark(BenchConfig(**base), target=target)["outputs"]["ar"]
    stop = free[0][4]  # a token the target emits early on the first prompt
    monkeypatch.setattr(target, "stop_token_ids", lambda: {stop})
    report = run_benchmark(BenchConfig(**base, respect_eos=True), target=target)
    outs = report["outputs"]
    first = free[0].index(stop) + 1
    assert outs["ar"][0] == free[0][:first] and len(outs["ar"][0]) < 16
    assert all(outs[m] == outs["ar"] for m in outs), outs
    assert all(report["exactness"]["equal"].values()), report["exactness"]


def test_benchmark_rejects_bad_flags():
    with pytest.raises(BenchError, match="unknown method"):
        BenchConfig(methods="ar,beam")
    with pytest.raises(BenchError, match="--drafter"):  # no drafter: none given, and not the embedded target
        BenchConfig(methods="ar,dflash", drafter="none")
    with pytest.raises(BenchError, match="--drafter"):
        BenchConfig(methods="ar,dflash", target="/models/other")
    assert BenchConfig(methods="oracle").methods == ["ar", "oracle"]
    # the default list without a drafter drops every method that needs one
    assert BenchConfig(target="/models/other").methods == ["hf_generate", "ar", "prompt_lookup", "oracle"]
    with pytest.raises(BenchError, match="--lookup-block"):
        BenchConfig(methods="ar,lookup", lookup_block=1)


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, str(ROOT / "jobs" / "generate.py"), *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)


def test_generate_cli_prints_completion_and_stats(assets):
    p = _run("--prompt", "Say hello.", "--target", assets["target_dir"], "--drafter", assets["drafter"],
             "--block-size", "8", "--max-new-tokens", "12")
    assert p.returncode == 0, p.stderr
    for word in ("tokens 12", "tok/s", "cycles", "tau", "histogram", "draft", "verify", "overhead"):
        assert word in p.stdout, word
    assert p.stdout.split("--- stats")[0].strip()  # the completion text comes first
    assert "(dflash+lookup, block 8, lookup up to 8," in p.stdout


def test_generate_cli_bad_drafter_exits_2(assets, capsys):
    p = _run("--prompt", "x", "--target", assets["target_dir"], "--drafter", str(assets["root"] / "missing"))
    assert p.returncode == 2
    assert "drafter directory not found" in p.stderr and "Traceback" not in p.stderr

    # a drafter that does not fit the target: in-process (saves a second interpreter start)
    spec = importlib.util.spec_from_file_location("generate_job", ROOT / "jobs" / "generate.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    assert job.main(["--prompt", "x", "--target", assets["target_dir"], "--drafter", assets["bad"]]) == 2
    err = capsys.readouterr().err
    assert "target_layer_ids" in err and len(err.strip().splitlines()) == 1


def test_recipe_bench_reads_costs_and_measures_every_kept_checkpoint(assets, tmp_path):
    """jobs/bench_recipe.py's library: cost from the feature run and the checkpoints' state,
    tau and exactness from the real engine, one row per kept checkpoint, table + JSON + PNG."""
    import shutil

    from harness.recipe_bench import (RecipeBenchConfig, RecipeBenchError, Variant, data_cost, format_table,
                                      plot as plot_recipe, run_recipe_bench)

    feats = tmp_path / "features"
    feats.mkdir()
    (feats / "run.json").write_text(json.dumps({"started_at": "2026-01-01T10:00:00+00:00"}))
    (feats / "manifest.json").write_text(json.dumps({"created_at": "2026-01-01T11:30:00+00:00", "num_samples": 7,
                                                     "num_response_tokens": 700}))
    run = tmp_path / "run"
    for step, secs, tau in ((10, 1800, 1.2), (20, 3600, 1.4)):
        ck = run / f"checkpoint-step{step:08d}"
        shutil.copytree(assets["drafter"], ck / "drafter")
        hist = [{"step": s, "holdout_tau": t, "train_seconds": x} for s, x, t in ((0, 0, 1.0), (10, 1800, 1.2),
                                                                                 (20, 3600, 1.4)) if s <= step]
        (ck / "state.json").write_text(json.dumps({"step": step, "train_seconds": secs, "history": hist}))
    shutil.copytree(assets["drafter"], run / "drafter")
    cfg_file = run / "drafter" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["dflash_ray"] = {"features_uri": str(feats), "best_step": 20}
    cfg_file.write_text(json.dumps(cfg))

    report = run_recipe_bench(RecipeBenchConfig([Variant.parse(f"tiny={run}")], [assets["prompts"]], num_prompts=2,
                                                max_new_tokens=8, target=assets["target_dir"], progress=False))
    rows = report["rows"]
    assert [r["step"] for r in rows] == [10, 20]
    assert rows[0]["data_hours"] == pytest.approx(1.5) and rows[1]["hours"] == pytest.approx(2.5)
    assert rows[1]["sim_tau"] == 1.4 and rows[0]["samples"] == 7
    assert all(r["p_exact"] and r["p_tau"] >= 1.0 and r["p_speedup"] > 0 for r in rows)
    table = format_table(report)
    assert "p tau" in table and "| 2.50 |" in table
    js, png = write_report(report, tmp_path / "out" / "recipe", plot_recipe)
    assert json.loads(js.read_text())["rows"][1]["step"] == 20 and png.stat().st_size > 1000
    best = run_recipe_bench(RecipeBenchConfig([Variant("tiny", run)], [assets["prompts"]], num_prompts=1,
                                              max_new_tokens=4, checkpoints="best", target=assets["target_dir"],
                                              progress=False))
    assert [r["step"] for r in best["rows"]] == [20] and best["rows"][0]["train_hours"] == pytest.approx(1.0)
    with pytest.raises(RecipeBenchError, match="training run not found"):
        Variant.parse(f"x={tmp_path / 'nope'}")
    shutil.copytree(feats, tmp_path / "features2")  # two runs trained on together: their costs add up
    two = data_cost(f"{feats},{tmp_path / 'features2'}")
    assert (two["data_hours"], two["samples"], two["response_tokens"]) == (pytest.approx(3.0), 14, 1400)
    assert data_cost(f"{feats},{tmp_path / 'nope'}")["samples"] is None  # one unreadable run: unknown, not half



def test_adaptation_benchmark_traffic_split_goals_and_app():
    """jobs/bench_adapt.py's pure parts: the code questions are made offline, the same every
    time; the held-out ones are never served; the goal's ratios; the app it serves is valid
    on both backends, with capture on and @champion followed."""
    from harness.adapt_bench import AdaptBenchConfig, app_settings, code_prompts, format_table, goals, split_prompts
    from serve_app.config import load_config

    prompts = code_prompts()
    assert len(prompts) > 500 and prompts == code_prompts()  # enough for the goal's 1,500 requests, in turn
    assert len({p["id"] for p in prompts}) == len(prompts)
    assert all("`" in p["messages"][0]["content"] for p in prompts[:50])
    served, held = split_prompts(prompts, 24)
    assert len(held) == 24 and len(served) == len(prompts) - 24
    assert not {p["id"] for p in held} & {p["id"] for p in served}
    assert split_prompts(list(reversed(prompts)), 24)[1] == sorted(held, key=prompts.index)[::-1]
    r = lambda tau, s: {"tau": tau, "speedup": s, "exact": True}  # noqa: E731
    results = {"code (held out)": {"reference": r(1.2, 1.0), "adapted": r(1.6, 1.25)},
               "sharegpt (held out)": {"reference": r(1.3, 1.1), "adapted": r(1.2, 1.0)}}
    g = goals(results)
    assert g["domain_tau"]["met"] and g["domain_speedup"]["met"] and not g["sharegpt_tau"]["met"]
    assert abs(g["sharegpt_tau"]["ratio"] - 1.2 / 1.3) < 1e-9
    table = format_table({"results": results, "goals": g, "stage_seconds": {"serving": 60.0}, "total_seconds": 60.0})
    assert "| code (held out) | adapted | 1.60 | 1.25x | yes |" in table and "| total | 60 |" in table
    for backend in ("hf", "vllm"):
        cfg = load_config(app_settings(AdaptBenchConfig(Path("/tmp/b"), backend=backend), "sqlite:///x.db"))
        assert cfg.capture.uri == "/tmp/b/capture" and cfg.drafter.endswith("@champion")
