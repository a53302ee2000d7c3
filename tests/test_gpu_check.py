"""jobs/gpu_check.py where CI runs it (no GPU), always as the lent machine runs it: from the
repository with ``PYTHONPATH=.``, no install.

* tier 1 at tiny shapes on the CPU (``--tiny --device cpu``): every check PASSes with sensible
  numbers, tier 2 SKIPs naming the missing GPU, no tier-1 check loads Ray, vLLM, MLflow or
  ``pipelines``;
* without ``--tiny`` and with GPUs hidden (CUDA_VISIBLE_DEVICES=""): one SKIP per check naming
  "no GPU", exit 0; with --require-gpu FAIL and exit 1; the JSON report either way;
* importing the tier-1 modules pulls in none of ray, vllm, mlflow, pipelines, yaml;
* the tier-1 shapes hard-coded from configs/qwen3-8b.yaml equal the recipe's.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "jobs" / "gpu_check.py"
TIER1 = ["bf16_exactness", "train_step", "cycle_cost"]
TIER2 = ["train_bf16_flex", "vllm_serve_drafter", "vllm_serve_http", "vllm_feature_generation"]


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": "."}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=timeout, check=False)


def _check_lines(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) > 1 and parts[0] in ("PASS", "FAIL", "TIMEOUT", "SKIP"):
            out[parts[1]] = line
    return out


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("gpu-check") / "gpu_check.json"
    r = _run("--tiny", "--device", "cpu", "--out", str(out), timeout=120)
    assert out.exists(), r.stdout + r.stderr
    return r, json.loads(out.read_text())


def test_tiny_tier1_passes_on_cpu_and_tier2_skips(tiny_report: tuple) -> None:
    r, report = tiny_report
    assert r.returncode == 0, r.stdout + r.stderr
    lines = _check_lines(r.stdout)
    assert list(lines) == TIER1 + TIER2
    assert r.stdout.strip().splitlines()[-1].startswith("SUMMARY OK: 3 passed, 0 failed, 0 timed out, 4 skipped")
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is True and report["counts"] == {"PASS": 3, "FAIL": 0, "TIMEOUT": 0, "SKIP": 4}
    assert report["device"] == "cpu" and report["tiny"] is True and report["budget_s"] == 480
    for name in TIER1:
        c = checks[name]
        assert c["status"] == "PASS" and c["tier"] == 1, c
        assert c["forbidden_modules"] == [] and 0 < c["seconds"] <= c["budget_s"]
        assert c["metrics"]["shapes"] == "tiny" and c["metrics"]["dtype"] == "float32"
    for name in TIER2:
        assert checks[name]["status"] == "SKIP" and "no GPU" in checks[name]["detail"], checks[name]


def test_tiny_exactness_is_exact_in_float32(tiny_report: tuple) -> None:
    m = {c["name"]: c for c in tiny_report[1]["checks"]}["bf16_exactness"]["metrics"]
    assert m["identical"] == 1.0 and m["target_layers"] == 8 and m["skipped_for_time"] == []
    assert set(m["modes"]) == {"dflash", "oracle", "ar_batch1", "dflash2"}
    for mode in m["modes"].values():
        assert mode["identical"] == 1.0 and mode["divergences"] == [] and mode["explained"] is True
    assert m["modes"]["oracle"]["tau"] > 4  # the oracle's whole blocks were accepted
    assert m["gap_median"] > 0 and m["near_tie_steps"] == 0.0
    assert m["noise"]["bound"] < 1e-3 and m["within_noise_steps"] == 0.0  # float32: the shapes agree


def test_chunked_logits_equal_one_forward_in_float32() -> None:
    """The shape-noise probe feeds the cache as the engine does: in float32, decoding one
    token at a time and verifying B at a time give the whole forward's logits (a wrong
    position, mask or cache slot would not)."""
    import torch

    from harness.gpu_exactness import chunked_logits
    from harness.gpu_models import build_target, random_prompts, shapes_for

    s = shapes_for({"tiny": True})
    target = build_target(s, torch.device("cpu"), torch.float32)
    prompt, toks = random_prompts(s, 2, seed=5)
    ids = torch.tensor([prompt + toks[:-1]])
    whole = target.logits(target(ids, torch.arange(ids.shape[1])[None]).hidden[0, len(prompt) - 1:])
    for chunk in (1, 5, 16):
        got = chunked_logits(target, prompt, toks, chunk)
        assert got.shape == whole.shape == (len(toks), s.vocab)
        torch.testing.assert_close(got, whole.float(), atol=1e-4, rtol=1e-4)


def test_tiny_train_step_measures_both_layouts(tiny_report: tuple) -> None:
    m = {c["name"]: c for c in tiny_report[1]["checks"]}["train_step"]["metrics"]
    assert set(m["layouts"]) == {"deepspeed_bf16", "ddp_autocast"} and m["errors"] == {}
    for r in m["layouts"].values():
        assert math.isfinite(r["step_s"]) and r["step_s"] > 0 and r["block_tokens_per_s"] > 0
        assert r["block_tokens_per_step"] == 2 * 16 * 16  # batch x anchors x B: every anchor found a block
        assert all(math.isfinite(x) for x in r["losses"]) and r["peak_gib"] is None  # CPU: no allocator stats
        assert r["plan_gib"] is None or r["plan_gib"] > 0, r["plan_note"]
    assert m["step_s"] == m["layouts"]["deepspeed_bf16"]["step_s"]  # the recipe's layout headlines


def test_tiny_cycle_cost_reports_ratios_and_the_ceiling(tiny_report: tuple) -> None:
    m = {c["name"]: c for c in tiny_report[1]["checks"]}["cycle_cost"]["metrics"]
    assert [b["batch"] for b in m["batches"]] == [1, 8]
    for b in m["batches"]:
        assert all(b[k] > 0 for k in ("ar_step_ms", "verify_ms", "draft_ms", "cycle_ms", "r_d", "r_v"))
        assert b["draft2_ms"] > 0 and b["dflash2_draft_ratio"] > 0
        assert b["oracle_tau"] == 16 and b["oracle_speedup"] == pytest.approx(16 / (b["r_d"] + b["r_v"]), rel=0.01)


def test_without_gpu_every_check_skips_and_exit_is_zero(tmp_path: Path) -> None:
    out = tmp_path / "report" / "gpu_check.json"
    r = _run("--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = _check_lines(r.stdout)
    assert list(lines) == TIER1 + TIER2
    assert all(line.startswith("SKIP") and "no GPU" in line for line in lines.values()), r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith("SUMMARY OK: 0 passed, 0 failed, 0 timed out, 7 skipped")
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["counts"] == {"PASS": 0, "FAIL": 0, "TIMEOUT": 0, "SKIP": 7}
    assert [c["name"] for c in report["checks"]] == TIER1 + TIER2
    assert all(c["status"] == "SKIP" and "no GPU" in c["detail"] for c in report["checks"])


def test_require_gpu_turns_no_gpu_into_fail(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    r = _run("--require-gpu", "--out", str(out), "--checks", "train_step,train_bf16_flex,vllm_serve_http")
    assert r.returncode == 1, r.stdout + r.stderr
    lines = _check_lines(r.stdout)
    assert list(lines) == ["train_step", "train_bf16_flex", "vllm_serve_http"]
    assert all(line.startswith("FAIL") and "no GPU" in line for line in lines.values()), r.stdout
    assert "SUMMARY FAILED" in r.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is False and [c["status"] for c in report["checks"]] == ["FAIL", "FAIL", "FAIL"]


def test_tier_selects_and_unknown_check_is_refused(tmp_path: Path) -> None:
    r = _run("--tier", "2", "--out", str(tmp_path / "t2.json"))
    assert r.returncode == 0 and list(_check_lines(r.stdout)) == TIER2, r.stdout + r.stderr
    r = _run("--checks", "nope", "--out", str(tmp_path / "g.json"))
    assert r.returncode == 2 and "unknown check" in r.stderr
    assert not (tmp_path / "g.json").exists()


def test_a_check_past_its_share_is_killed_and_reported_timeout(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's kill path, in process: a (forked) check that overruns its share ends as
    TIMEOUT within seconds, keeping the metrics it had written."""
    from harness import gpu_check, gpu_tier1

    def sleepy(metrics: dict, opts: dict) -> str:
        metrics["started"] = opts["device"]
        time.sleep(60)
        return "never"

    monkeypatch.setitem(gpu_tier1.CHECKS, "cycle_cost", sleepy)  # the fork inherits the patch
    t0 = time.perf_counter()
    entry = gpu_check.run_check(gpu_check.BY_NAME["cycle_cost"], 2.0, tmp_path, {"device": "cpu"}, fork=True)
    assert entry["status"] == "TIMEOUT" and entry["metrics"] == {"started": "cpu"}, entry
    assert entry["budget_s"] == 2.0 and time.perf_counter() - t0 < 20


def test_tier1_modules_import_no_stack() -> None:
    code = ("import sys; import harness.gpu_check, harness.gpu_tier1; "
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'vllm', 'mlflow', 'pipelines', 'yaml'}); "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                       env={**os.environ, "PYTHONPATH": "."}, check=False)
    assert r.returncode == 0, r.stderr


def test_hard_coded_shapes_equal_the_recipe() -> None:
    """harness/gpu_models.py never reads YAML (the lent machine need not have it): its copy of
    configs/qwen3-8b.yaml's shapes must stay equal to the file."""
    import yaml

    from harness.gpu_models import QWEN3_8B, RECIPE

    cfg = yaml.safe_load((REPO / "configs" / "qwen3-8b.yaml").read_text())
    d, t, f = cfg["drafter"], cfg["train"], cfg["features"]
    assert RECIPE == {"drafter_layers": d["num_layers"], "block_size": d["block_size"],
                      "num_anchors": t["num_anchors"], "seq_len": t["max_length"], "batch_size": t["batch_size"],
                      "num_features": f["num_layers"], "loss_lambda": t["loss_lambda"], "lr": t["lr"],
                      "grad_clip": t["grad_clip"]}
    assert "Qwen3-8B" in f["target"]["model"] and f["target"]["dtype"] == "bfloat16"
    shipped = REPO / "configs" / "targets" / "Qwen3-8B.json"  # the planner's copy of the HF config, if shipped
    if shipped.is_file():
        hf = json.loads(shipped.read_text())
        rope = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta"))
        shape = {k: v for k, v in QWEN3_8B.items() if k != "rope_theta"}
        assert {k: hf[k] for k in shape} == shape
        assert rope == QWEN3_8B["rope_theta"]
