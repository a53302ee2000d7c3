"""Evaluation by context length (jobs/bench_longctx.py) on a tiny target: every field of
every row, exactness, and a windowed drafter holding less draft K/V than the full one."""

import json

import pytest
import torch

from harness.context_bench import ContextBenchConfig, format_table, plot, run_context_bench
from pipelines.report import write_report
from specdec.bench import BenchError
from specdec.checkpoint import save_drafter
from specdec.target import load_target
from specdec.tiny import random_drafter, save_tiny_target

pytestmark = pytest.mark.unit

WINDOW = 64


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    work = tmp_path_factory.mktemp("ctx")
    target_dir = save_tiny_target(work / "target")
    target = load_target(str(target_dir))
    drafter = save_drafter(random_drafter(target, block_size=4), work / "drafter")
    return work, target_dir, drafter


def test_rows_by_bucket_and_variant(setup):
    work, target_dir, drafter = setup
    torch.manual_seed(0)
    cfg = ContextBenchConfig({"short": str(drafter)}, target=str(target_dir), window=WINDOW, buckets=[1],
                             prompts_per_bucket=1, max_new_tokens=6)
    report = run_context_bench(cfg)
    rows = {r["variant"]: r for r in report["rows"]}
    assert set(rows) == {"short", f"short+w{WINDOW}"}
    for r in rows.values():
        assert r["bucket_k"] == 1 and 600 <= r["context_tokens"] <= 1300 and r["exact"] is True
        for key in ("tau", "speedup", "tokens_per_s", "ar_tokens_per_s", "draft_ms_per_cycle", "draft_kv_mb"):
            assert isinstance(r[key], float) and r[key] > 0, key
    # the window keeps W - 1 positions (+ slack) of a ~1K-token context
    assert rows[f"short+w{WINDOW}"]["draft_kv_mb"] < rows["short"]["draft_kv_mb"] / 4
    js, png = write_report(report, work / "out" / "longctx", plot)
    assert json.loads(js.read_text())["rows"] and png.stat().st_size > 0
    assert "short+w64" in format_table(report)


@pytest.mark.parametrize("kw, match", [({"drafters": {}}, "at least one drafter"),
                                       ({"drafters": {"a": "x"}, "buckets": [3]}, "buckets \\[3\\]")])
def test_bad_settings_are_refused(kw, match):
    with pytest.raises(BenchError, match=match):
        ContextBenchConfig(**kw)


def test_any_prompt_file_is_bucketed_by_length(setup, tmp_path):
    """Users' long prompts (a LongAlign file: 16K-64K on a GPU) go to buckets by token count."""
    from harness.context_bench import bucket_prompts

    _, target_dir, _ = setup
    target = load_target(str(target_dir))
    rows = [{"id": "short", "prompt": "word " * 250}, {"id": "mid", "prompt": "word " * 800}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = bucket_prompts(target, [1], 4, str(path))
    assert got[1][0] == ["mid"] and 512 < len(got[1][1][0]) <= 1024
    with pytest.raises(BenchError, match=r"bucket\(s\) \[2\]K"):
        bucket_prompts(target, [1, 2], 4, str(path))
