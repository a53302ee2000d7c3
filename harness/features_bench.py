"""Benchmark of the feature stage against a bare batched teacher-forced forward, and of
stored bytes per token against tokens x layers x hidden x bytes (``jobs/bench_features.py``).

All timings come from one process and one model copy, interleaved per mini-batch (bare,
stage, stage, bare, ...) so that load from other jobs on a shared machine hits both
alike; the Ray Data stage is then timed once more through a real actor for reference.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from pipelines.features.target_pass import resolve_layer_ids
from pipelines.features.workers import ExtractFeatures
from pipelines.features.writer import ShardWriter

TARGET = {"model": "smollm2", "dtype": "float32", "trust_remote_code": False}


def bench_sequences(target, n: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, prompt length) for ``n`` ShareGPT prompts with the dataset's
    own answers as responses: real text at realistic, mixed lengths."""
    from specdec.prompts import load_prompts

    out = []
    for p in load_prompts("sharegpt", split="train", limit=4 * n, max_prompt_chars=2000):
        if not p.reference:
            continue
        prompt = target.encode_chat(p.messages)
        if len(prompt) >= max_tokens // 2:
            continue
        answer = target.encode(p.reference)[: max_tokens - len(prompt)]
        out.append((prompt + answer, len(prompt)))
        if len(out) == n:
            break
    return out


def shard_rows(seqs: list[tuple[list[int], int]], per_shard: int) -> list[dict]:
    rows = []
    for k in range(0, len(seqs), per_shard):
        chunk = seqs[k: k + per_shard]
        rows.append({"shard_id": f"{k // per_shard:05d}", "ids": [f"s{k + i}" for i in range(len(chunk))],
                     "input_ids": [s for s, _ in chunk], "prompt_tokens": [p for _, p in chunk],
                     "finish_reason": ["length"] * len(chunk), "skipped_ids": [], "skipped_reasons": [],
                     "gen_tokens": 0, "gen_seconds": 0.0, "gen_pid": 0})
    return rows


@torch.no_grad()
def bare_forward(target, seqs: list[list[int]], batch_size: int, layer_ids: list[int] | None) -> float:
    """Seconds for a plain batched teacher-forced pass (length-sorted, right-padded)."""
    order = sorted(seqs, key=len)
    t0 = time.perf_counter()
    for k in range(0, len(order), batch_size):
        chunk = order[k: k + batch_size]
        ids = torch.zeros(len(chunk), max(map(len, chunk)), dtype=torch.long)
        for i, s in enumerate(chunk):
            ids[i, : len(s)] = torch.tensor(s)
        pos = torch.arange(ids.shape[1])[None].expand_as(ids)
        out = target(ids, pos, None, None, layer_ids)
        (out.features if layer_ids else out.hidden).sum().item()  # forces completion (GPU)
    return time.perf_counter() - t0


def stage_pass(writer: ShardWriter, rows: list[dict]) -> tuple[float, int]:
    """Seconds and stored bytes for the stage's own shard writer (forward, encode,
    Parquet, sha256, atomic commit, progress record)."""
    t0 = time.perf_counter()
    nbytes = sum(writer.write_shard(row)["bytes"] for row in rows)
    return time.perf_counter() - t0, nbytes


def make_writer(target, out_dir: str, dtype: str, compression: str, batch_size: int) -> ShardWriter:
    layer_ids = resolve_layer_ids(None, 5, target.num_layers)
    return ShardWriter(target, layer_ids, dtype, compression, batch_size, out_dir, {}, "bench", TARGET["model"])


def storage_projection(samples: int, tokens_per_sample: int, layers: int, hidden: int) -> dict:
    """Stored feature bytes for a run (ids and masks add 5 bytes a token)."""
    tokens = samples * tokens_per_sample
    fp16 = tokens * (layers * hidden * 2 + 5)
    int8 = tokens * (layers * hidden + layers * 4 + 5)
    online = tokens * 5  # online features: store tokens only, recompute hidden states while training
    return {"samples": samples, "tokens": tokens, "layers": layers, "hidden": hidden,
            "fp16_TB": fp16 / 1e12, "int8_TB": int8 / 1e12, "online_GB": online / 1e9,
            "fp16_KB_per_token": layers * hidden * 2 / 1e3}


def run_bench(num_seqs: int = 24, max_tokens: int = 256, batch_size: int = 8, rounds: int = 2,
              with_ray: bool = True) -> dict:
    from specdec.target import load_target

    target = load_target(TARGET["model"], dtype=TARGET["dtype"])
    seqs = bench_sequences(target, num_seqs, max_tokens)
    rows = shard_rows(seqs, batch_size)  # one mini-batch per shard: fine-grained interleaving
    tokens = sum(len(s) for s, _ in seqs)
    with tempfile.TemporaryDirectory(prefix="bench-features-") as tmp:
        writer = make_writer(target, str(Path(tmp) / "fp16"), "float16", "none", batch_size)
        bare_forward(target, rows[0]["input_ids"], batch_size, None)  # warm-up both paths
        writer.write_shard(rows[0])
        wall = {"bare": 0.0, "stage": 0.0}
        cpu = {"bare": 0.0, "stage": 0.0}
        stored = 0
        for r in range(rounds):
            for k, row in enumerate(rows):
                steps = [("bare", lambda: bare_forward(target, row["input_ids"], batch_size, None)),
                         ("stage", lambda: writer.write_shard(row))]
                for name, step in (steps if (r + k) % 2 == 0 else steps[::-1]):  # alternate who goes first
                    w0, c0 = time.perf_counter(), time.process_time()
                    out = step()
                    wall[name] += time.perf_counter() - w0
                    cpu[name] += time.process_time() - c0
                    if name == "stage" and r == 0:
                        stored += out["bytes"]
        variants = {}
        for name, dtype, comp in [("int8", "int8", "none"), ("fp16_zstd", "float16", "zstd")]:
            v = make_writer(target, str(Path(tmp) / name), dtype, comp, batch_size)
            vbytes = sum(v.write_shard(row)["bytes"] for row in rows)
            variants[name] = {"bytes_per_token": vbytes / tokens, "nominal": v.layout.nominal_bytes_per_token}
        result = {
            "model": "SmolLM2-135M-Instruct (fp32, CPU)", "threads": torch.get_num_threads(),
            "layer_ids": writer.layer_ids, "sequences": len(seqs), "tokens": tokens, "batch_size": batch_size,
            "rounds": rounds,
            "bare_tokens_per_s": rounds * tokens / wall["bare"],
            "stage_tokens_per_s": rounds * tokens / wall["stage"],
            "throughput_ratio": wall["bare"] / wall["stage"],
            "cpu_time_ratio": cpu["bare"] / cpu["stage"],  # less sensitive to other jobs on the machine
            "wall_s": wall, "cpu_s": cpu,
            "bytes_per_token": stored / tokens,
            "nominal_bytes_per_token": writer.layout.nominal_bytes_per_token,
            "bytes_ratio": stored / tokens / writer.layout.nominal_bytes_per_token,
            "variants": variants,
        }
        if with_ray:
            result["ray_stage"] = ray_stage_pass(str(Path(tmp) / "ray"), rows, batch_size, tokens)
    result["projection_qwen3_8b"] = storage_projection(800_000, 1500, 5, 4096)
    return result


def ray_stage_pass(out_dir: str, rows: list[dict], batch_size: int, tokens: int) -> dict:
    """The same shards through the real Ray Data stage (one actor with every CPU)."""
    import os

    import ray
    import ray.data

    ray.init(ignore_reinit_error=True, include_dashboard=False, logging_level="warning")
    cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
    t0 = time.perf_counter()
    ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        ExtractFeatures, batch_size=1, batch_format="pyarrow",
        fn_constructor_kwargs={"run_uri": out_dir, "storage_options": {}, "target": TARGET, "layer_ids": None,
                               "num_layers": 5, "storage_cfg": {"dtype": "float16", "compression": "none"},
                               "batch_size": batch_size, "num_gpus": 0, "run_key": "bench"},
        compute=ray.data.ActorPoolStrategy(size=1), num_cpus=cpus)
    status = ds.take_all()
    wall = time.perf_counter() - t0
    inside = sum(s["extract_seconds"] for s in status)
    return {"actor_tokens_per_s": tokens / inside, "wall_s_with_actor_start": wall, "actor_cpus": cpus}


# ---------------------------------------------------------------------------- generation backends
def generation_bench(num_prompts: int = 64, max_new_tokens: int = 128,
                     config: str = "configs/smollm2-135m-reference.yaml", hf_actors: int = 2,
                     vllm_binds: tuple[str, ...] = ("auto",)) -> dict:
    """Generated tokens/s of the hf and vllm backends on the same ShareGPT prompts (the
    recipe's prompt and sampling settings), in one Ray session, each through its own
    pipeline stage on this machine's CPUs: hf as its recipes ran it (``hf_actors``
    ``Regenerate`` actors of one thread), vllm through Ray Data's vLLM processor (one
    engine, once per ``VLLM_CPU_OMP_THREADS_BIND`` value: "auto" keeps a core for vLLM's
    scheduler).

    hf runs before and after vllm: on a shared machine, two hf rows that disagree say the
    neighbours' load changed in between (each row also records the load average).
    ``tokens_per_s`` counts the generation window (first shard started to last token):
    model load and engine start-up are excluded for both, and included in ``wall_s``."""
    import dataclasses
    import math
    import os

    import ray
    import ray.data

    from pipelines.config import load_features_config
    from pipelines.features.plan import plan_shards
    from pipelines.features.shards import generation_actors
    from pipelines.features.vllm_regen import regeneration_stage
    from pipelines.features.workers import Regenerate
    from specdec.target import resolve_target_path

    cfg = load_features_config(config, [f"features.prompts.limit={num_prompts}",
                                        f"features.generation.max_new_tokens={max_new_tokens}"])
    # the recipe's shards, or fewer prompts each so that every hf actor gets one
    per_shard = min(cfg.storage.samples_per_shard, math.ceil(num_prompts / hf_actors))
    shards, _ = plan_shards(dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage,
                                                                                 samples_per_shard=per_shard)))
    rows = [s.as_row() for s in shards]
    if not ray.is_initialized():  # a cluster of our own unless the job runs on one
        ray.init(address=os.environ.get("RAY_ADDRESS", "local"), include_dashboard=False, logging_level="warning")
    target, gen = dataclasses.asdict(cfg.target), dataclasses.asdict(cfg.generation)
    gen |= {"num_gpus": 0, "num_cpus": 1}
    hgen = {**gen, "backend": "hf", "actors": hf_actors}
    vgen = {**gen, "backend": "vllm", "actors": 1}  # one engine; its threads: the bind

    def hf() -> list[dict]:
        return ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
            Regenerate, batch_size=1, batch_format="pyarrow",
            fn_constructor_kwargs={"target": target, "generation": hgen,
                                   "max_prompt_tokens": cfg.prompts.max_prompt_tokens},
            compute=generation_actors(hf_actors), num_cpus=1, num_gpus=0,
        ).take_all()

    def vllm(bind: str) -> list[dict]:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind  # reaches the engine actor through its constructor
        try:
            return regeneration_stage(ray.data.from_items(rows, override_num_blocks=len(rows)),
                                      resolve_target_path(cfg.target.model), target, vgen,
                                      cfg.prompts.max_prompt_tokens,
                                      cfg.prompts.max_prompt_tokens + max_new_tokens).take_all()
        finally:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)

    hf_setup = f"{hf_actors} actor(s) x 1 thread, batch {gen['batch_size']}"
    runs = [("hf", hf, hf_setup)]
    runs += [(f"vllm bind={b}", lambda b=b: vllm(b), f"1 engine, VLLM_CPU_OMP_THREADS_BIND={b}") for b in vllm_binds]
    runs += [("hf again", hf, hf_setup)]
    results, reference = {}, None
    for name, run, setup in runs:
        t0 = time.perf_counter()
        out = run()
        results[name] = _generation_summary(out, time.perf_counter() - t0) | {"setup": setup,
                                                                              "load_avg_1m": os.getloadavg()[0]}
        seqs = _sequences(out)
        reference = reference or seqs
        results[name]["same_tokens_as_hf"] = sum(seqs[k] == v for k, v in reference.items()) / len(reference)
    return {"model": cfg.target.model, "dtype": cfg.target.dtype, "config": config, "prompts": num_prompts,
            "max_new_tokens": max_new_tokens, "temperature": gen["temperature"],
            "cluster_cpus": ray.cluster_resources().get("CPU"), "backends": results}


def _generation_summary(shard_rows: list[dict], wall: float) -> dict:
    tokens = sum(r["gen_tokens"] for r in shard_rows)
    window = max(r["gen_start"] + r["gen_seconds"] for r in shard_rows) - min(r["gen_start"] for r in shard_rows)
    return {"sequences": sum(len(r["ids"]) for r in shard_rows), "generated_tokens": tokens,
            "generating_pids": len({r["gen_pid"] for r in shard_rows}),  # hf: the actors that decoded
            "gen_window_s": window, "tokens_per_s": tokens / window, "wall_s": wall, "tokens_per_s_wall": tokens / wall}


def _sequences(shard_rows: list[dict]) -> dict[str, list[int]]:
    return {i: [int(t) for t in s] for r in shard_rows for i, s in zip(r["ids"], r["input_ids"])}


def generation_table(result: dict) -> str:
    lines = [f"{'backend':<16}{'sequences':>10}{'gen tokens':>11}{'window s':>10}{'tok/s':>8}{'wall s':>8}"
             f"{'tok/s wall':>11}{'same as hf':>11}{'load':>6}  setup"]
    for name, r in result["backends"].items():
        lines.append(f"{name:<16}{r['sequences']:>10}{r['generated_tokens']:>11}{r['gen_window_s']:>10.1f}"
                     f"{r['tokens_per_s']:>8.1f}{r['wall_s']:>8.1f}{r['tokens_per_s_wall']:>11.1f}"
                     f"{r['same_tokens_as_hf']:>11.0%}{r['load_avg_1m']:>6.1f}  {r['setup']}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m harness.features_bench --prompts 64 --out runs/bench/generation.json
    import argparse
    import json

    ap = argparse.ArgumentParser(description="generated tokens/s: hf vs vllm backend")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--config", default="configs/smollm2-135m-reference.yaml")
    ap.add_argument("--hf-actors", type=int, default=2, help="one-thread hf actors (the hf recipes' setting)")
    ap.add_argument("--vllm-bind", action="append", help="VLLM_CPU_OMP_THREADS_BIND values (repeatable)")
    ap.add_argument("--out", help="write the result JSON here too")
    args = ap.parse_args()
    res = generation_bench(args.prompts, args.max_new_tokens, args.config, args.hf_actors,
                           tuple(args.vllm_bind or ["auto"]))
    print(generation_table(res))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
