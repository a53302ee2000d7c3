"""jobs/gpu_check.py where CI runs it (no GPU): one SKIP line per check naming "no GPU" and
exit 0; with --require-gpu a FAIL line per check and exit 1; the JSON report either way.
GPUs are hidden (CUDA_VISIBLE_DEVICES="") so this test never runs the real checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "jobs" / "gpu_check.py"
CHECKS = ["train_bf16_flex", "vllm_serve_drafter", "vllm_serve_http", "vllm_feature_generation"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=60, check=False)


def _check_lines(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) > 1 and parts[0] in ("PASS", "FAIL", "SKIP"):
            out[parts[1]] = line
    return out


def test_without_gpu_every_check_skips_and_exit_is_zero(tmp_path):
    out = tmp_path / "report" / "gpu_check.json"
    r = _run("--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = _check_lines(r.stdout)
    assert list(lines) == CHECKS
    assert all(line.startswith("SKIP") and "no GPU" in line for line in lines.values()), r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith("SUMMARY OK: 0 passed, 0 failed, 4 skipped")
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["counts"] == {"PASS": 0, "FAIL": 0, "SKIP": 4}
    assert [c["name"] for c in report["checks"]] == CHECKS
    assert all(c["status"] == "SKIP" and "no GPU" in c["detail"] for c in report["checks"])


def test_require_gpu_turns_no_gpu_into_fail(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = _run("--require-gpu", "--out", str(out), "--checks", "train_bf16_flex,vllm_serve_http")
    assert r.returncode == 1, r.stdout + r.stderr
    lines = _check_lines(r.stdout)
    assert list(lines) == ["train_bf16_flex", "vllm_serve_http"]
    assert all(line.startswith("FAIL") and "no GPU" in line for line in lines.values()), r.stdout
    assert "SUMMARY FAILED" in r.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is False and [c["status"] for c in report["checks"]] == ["FAIL", "FAIL"]


def test_unknown_check_is_refused(tmp_path):
    r = _run("--checks", "nope", "--out", str(tmp_path / "g.json"))
    assert r.returncode == 2 and "unknown check" in r.stderr
    assert not (tmp_path / "g.json").exists()
