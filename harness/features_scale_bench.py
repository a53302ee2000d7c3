"""How the vLLM feature pipeline scales (``jobs/bench_features.py --scale``).

Runs the whole feature job (``run_features``: long-lived vLLM engine actors regenerating,
extraction actors writing shards, one Ray Data execution) at 1x and ``factor``x prompts, each
in a fresh driver process, and at the larger size also each stage alone. Reports:

* per-token cost: seconds the actors spent generating and extracting per stored token (the
  work, flat if nothing grows with the run) and the run's wall seconds per token;
* the driver's peak RSS over its RSS once connected to Ray (what the run itself added);
* the overlap ratio: the slower stage alone / the end-to-end run (1.0: the faster stage is
  completely hidden behind the slower one; the goal is >= 0.8).

On a CPU the engine gets one core (``VLLM_CPU_OMP_THREADS_BIND``) and extraction one, so
that the stages run side by side as they do on separate GPUs instead of fighting for cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rss_mib() -> float:
    """This process's resident set now (Linux /proc), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_config(config: str, prompts: int, max_new_tokens: int, per_shard: int, output: str):
    """The recipe's features section, on the vllm backend on CPU at this size."""
    from pipelines.config import load_features_config

    return load_features_config(config, [
        f"features.output={output}", f"features.prompts.limit={prompts}", "features.prompts.holdout_fraction=0",
        "features.prompts.max_prompt_tokens=256", "features.generation.backend=vllm",
        "features.generation.num_gpus=0", "features.generation.num_cpus=1", "features.generation.actors=1",
        f"features.generation.max_new_tokens={max_new_tokens}", "features.extract.from_generation=false",
        "features.extract.actors=1", "features.extract.num_cpus=1", f"features.storage.samples_per_shard={per_shard}"])


def work_per_token(uri: str) -> dict:
    """Actor seconds per stored token from the shards' progress records."""
    from pipelines import storage

    fs, root = storage.filesystem(uri)
    recs = storage.read_json_many(fs, storage.list_files(fs, storage.join(root, "progress"), ".json"))
    tokens = sum(r["tokens"] for r in recs)
    gen, ext = sum(r["gen_seconds"] for r in recs), sum(r["extract_seconds"] for r in recs)
    return {"shards": len(recs), "tokens": tokens, "gen_tokens": sum(r["gen_tokens"] for r in recs),
            "gen_ms_per_token": 1000 * gen / tokens, "extract_ms_per_token": 1000 * ext / tokens,
            "work_ms_per_token": 1000 * (gen + ext) / tokens}


def child(config: str, prompts: int, max_new_tokens: int, per_shard: int, stages: bool) -> dict:
    """One size in this (fresh) process: the whole job, then optionally each stage alone."""
    import ray

    from pipelines.features import run_features

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    base = rss_mib()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = bench_config(config, prompts, max_new_tokens, per_shard, f"{tmp}/run")
        t0 = time.perf_counter()
        summary = run_features(cfg)
        out = {"prompts": prompts, "wall_s": time.perf_counter() - t0, "samples": summary["num_samples"],
               **work_per_token(summary["uri"]), "driver_rss_base_mib": base, "driver_rss_peak_mib": peak_rss_mib()}
        out["wall_ms_per_token"] = 1000 * out["wall_s"] / out["tokens"]
        out["driver_rss_added_mib"] = out["driver_rss_peak_mib"] - base
        if stages:
            out |= stage_times(cfg, f"{tmp}/alone")
            out["overlap"] = max(out["generation_alone_s"], out["extraction_alone_s"]) / out["wall_s"]
    ray.shutdown()
    return out


def stage_times(cfg, scratch: str) -> dict:
    """Generation alone (materialized), then extraction alone over its output."""
    import ray.data

    from pipelines.features.plan import plan_shards
    from pipelines.features.vllm_regen import regeneration_stage
    from pipelines.features.workers import ExtractFeatures
    from specdec.target import resolve_target_path

    shards, _ = plan_shards(cfg)
    target, gen = dataclasses.asdict(cfg.target), dataclasses.asdict(cfg.generation)
    t0 = time.perf_counter()
    generated = regeneration_stage(ray.data.from_items([s.as_row() for s in shards], override_num_blocks=len(shards)),
                                   resolve_target_path(cfg.target.model), target, gen, cfg.prompts.max_prompt_tokens,
                                   cfg.prompts.max_prompt_tokens + cfg.generation.max_new_tokens).materialize()
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    generated.map_batches(
        ExtractFeatures, batch_size=1, batch_format="pyarrow",
        fn_constructor_kwargs={"run_uri": scratch, "storage_options": {}, "target": target,
                               "layer_ids": cfg.layer_ids, "num_layers": cfg.num_layers,
                               "storage_cfg": dataclasses.asdict(cfg.storage), "batch_size": cfg.extract.batch_size,
                               "num_gpus": 0, "num_cpus": 1, "run_key": "alone"},
        compute=ray.data.ActorPoolStrategy(size=1), num_cpus=1).materialize()
    return {"generation_alone_s": gen_s, "extraction_alone_s": time.perf_counter() - t0}


def run_scale(config: str, prompts: int, factor: int, max_new_tokens: int, per_shard: int) -> dict:
    """Both sizes, each in a driver process of its own (peak RSS is per process)."""
    runs = []
    for n, stages in ((prompts, False), (prompts * factor, True)):
        cmd = [sys.executable, "-m", "harness.features_scale_bench", "--child", config, str(n), str(max_new_tokens),
               str(per_shard), "1" if stages else "0"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"the {n}-prompt run failed:\n{proc.stderr[-3000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"  {n} prompts: {runs[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    small, large = runs
    return {"config": config, "factor": factor, "max_new_tokens": max_new_tokens, "samples_per_shard": per_shard,
            "runs": runs, "work_per_token_ratio": large["work_ms_per_token"] / small["work_ms_per_token"],
            "wall_per_token_ratio": large["wall_ms_per_token"] / small["wall_ms_per_token"],
            "driver_rss_added_ratio": large["driver_rss_added_mib"] / max(small["driver_rss_added_mib"], 1.0),
            "overlap": large["overlap"], "created_at": time.strftime("%Y-%m-%d %H:%M %Z"),
            "load_avg_1m": os.getloadavg()[0]}


def scale_table(r: dict) -> str:
    rows = ["| prompts | samples | tokens | wall s | work ms/token (gen + extract) | wall ms/token | driver RSS "
            "added MiB (peak) |", "|---|---|---|---|---|---|---|"]
    for x in r["runs"]:
        rows.append(f"| {x['prompts']} | {x['samples']} | {x['tokens']:,} | {x['wall_s']:.0f} | "
                    f"{x['work_ms_per_token']:.2f} ({x['gen_ms_per_token']:.2f} + {x['extract_ms_per_token']:.2f}) | "
                    f"{x['wall_ms_per_token']:.2f} | {x['driver_rss_added_mib']:.0f} "
                    f"({x['driver_rss_peak_mib']:.0f}) |")
    big = r["runs"][-1]
    rows.append(f"\n{r['factor']}x: work per token {r['work_per_token_ratio']:.2f}x, wall per token "
                f"{r['wall_per_token_ratio']:.2f}x, driver RSS added {r['driver_rss_added_ratio']:.2f}x; overlap "
                f"{r['overlap']:.2f} (generation alone {big['generation_alone_s']:.0f} s, extraction alone "
                f"{big['extraction_alone_s']:.0f} s, together {big['wall_s']:.0f} s)")
    return "\n".join(rows)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--child":
    sys.path.insert(0, str(REPO))
    cfg_path, n, new, per, stages = sys.argv[2:7]
    print(json.dumps(child(cfg_path, int(n), int(new), int(per), stages == "1")))
