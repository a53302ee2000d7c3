"""Load test of the OpenAI endpoint: speculative vs AR serving at several concurrencies.

    # against running apps (spec at --url, AR at --ar-url)
    python jobs/loadtest.py --url http://127.0.0.1:8000 --ar-url http://127.0.0.1:8000/ar
    # or start both apps in-process first (1 replica each, drafter vs no drafter)
    python jobs/loadtest.py --start --drafter models:/dflash-smollm2-135m@champion
    # the same on the vllm backend: the speculative vLLM app against plain vLLM
    python jobs/loadtest.py --start --backend vllm
    # speculation off under load: 2 requests speculate at once, the rest go to a plain pool
    python jobs/loadtest.py --start --backend vllm --plain-pool 2

AR serving is the same application with ``drafter=none`` (plain AR decoding in the same
continuous-batching engine); ``--start`` runs it at route ``/ar`` next to the
speculative app at ``/spec``. Each concurrency level sends ``--requests`` streaming,
greedy chat requests from ``--concurrency`` parallel clients; spec and AR run back to
back at each level (which goes first alternates), so both see the same machine load.
Per level and mode it reports output throughput (tokens/s), TTFT (time to the first
content chunk) p50/p99, inter-token latency p50/p99 (the gap between streamed chunks
divided by the tokens they carry) and TPOT (per-request (last - first) / (tokens - 1)),
the mean accepted length tau, and the replicas' CPU seconds per generated token (from
/metrics): on a machine shared with other work wall-clock ratios are noisy, CPU per
token much less so.
Writes ``loadtest.json`` and ``loadtest.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def replica_counters(url: str, api_key: str | None) -> dict | None:
    """Totals over the app's replicas from /metrics: CPU seconds (None where the backend does
    not report them: vllm), generated tokens, and the accepted-length sum and count."""
    from serve_app.metrics import scrape_totals

    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # the key guards /metrics too
        totals = scrape_totals(httpx.get(url + "/metrics", headers=headers, timeout=30).text)
    except httpx.HTTPError:
        return None
    return {"cpu": totals.get("process_cpu_seconds_total"), "tokens": totals.get("generated_tokens_total", 0.0),
            "tau_sum": totals.get("accepted_length_sum", 0.0), "tau_count": totals.get("accepted_length_count", 0.0)}


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[i]


async def one_request(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int,
                      model: str | None) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    chunk_times: list[tuple[float, str]] = []
    usage = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return {"error": ev["error"]["message"]}
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                text = ch.get("delta", {}).get("content")
                if text:
                    chunk_times.append((time.perf_counter(), text))
    t_end = time.perf_counter()
    n = (usage or {}).get("completion_tokens", len(chunk_times))
    spec = (usage or {}).get("speculative") or {}
    return {"start": t0, "end": t_end, "tokens": n, "chunk_times": [t for t, _ in chunk_times],
            "ttft": (chunk_times[0][0] - t0) if chunk_times else None,
            "tau": spec.get("mean_accepted_length")}


async def run_level(url: str, prompts: list[list[dict]], concurrency: int, n_requests: int, max_tokens: int,
                    model: str | None, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    before = replica_counters(url, api_key)
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(n_requests):
        queue.put_nowait(prompts[i % len(prompts)])
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, headers=headers, limits=limits) as client:
        async def worker():
            while True:
                try:
                    msgs = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await one_request(client, url, msgs, max_tokens, model))

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    itl: list[float] = []
    tpot: list[float] = []
    for r in ok:
        ts = r["chunk_times"]
        if len(ts) >= 2 and r["tokens"] >= 2:
            per_chunk = r["tokens"] / len(ts)  # tokens per streamed chunk (a verify cycle's output)
            itl += [(b - a) / per_chunk for a, b in zip(ts, ts[1:])]
            tpot.append((ts[-1] - ts[0]) / (r["tokens"] - 1))
    cpu_per_token, fleet_tau = None, None
    if before is not None:
        await asyncio.sleep(2.5)  # replicas publish their counters every metrics_push_s
        after = replica_counters(url, api_key)
        if after is not None and after["tokens"] > before["tokens"] and after["cpu"] is not None:
            cpu_per_token = (after["cpu"] - before["cpu"]) / (after["tokens"] - before["tokens"])
        if after is not None and after["tau_count"] > before["tau_count"]:
            fleet_tau = (after["tau_sum"] - before["tau_sum"]) / (after["tau_count"] - before["tau_count"])
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    taus = [r["tau"] for r in ok if r["tau"] is not None]
    return {
        "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
        "error_samples": [r["error"] for r in results if "error" in r][:3],
        "wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall if wall else 0.0,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        # per request (hf: usage.speculative) or, where responses carry none (vllm), the replicas'
        # accepted-length histogram over the level
        "mean_tau": statistics.fmean(taus) if taus else fleet_tau,
        "replica_cpu_s_per_token": cpu_per_token,
    }


def load_messages(source: str, limit: int) -> list[list[dict]]:
    from specdec.prompts import load_prompts

    split = "holdout" if source == "sharegpt" else "all"
    prompts = load_prompts(source, split=split, limit=limit, max_prompt_chars=1500, min_prompt_chars=20)
    return [p.messages for p in prompts]


def app_settings(args) -> tuple[dict, dict]:
    """Settings of the speculative and the AR app: the same app, with and without a drafter."""
    common = {"backend": args.backend, "target": args.target, "min_replicas": args.replicas,
              "max_replicas": args.replicas, "replica_cpus": args.replica_cpus,
              "api_key_env": "DFLASH_LOADTEST_NO_KEY"}
    if args.backend == "vllm":  # engine limits are vLLM's own (serve_app.vllm_app refuses ours)
        common["vllm_engine_kwargs"] = {"max_model_len": 2048, "max_num_seqs": max(args.concurrency)}
        extra = {} if args.plain_pool is None else {"vllm_plain_pool": True,
                                                    "speculative_max_inflight": args.plain_pool}
    else:
        common.update(max_batch_size=max(args.concurrency), max_tokens_limit=max(args.max_tokens, 16),
                      torch_threads=args.torch_threads, registry_poll_s=0)
        extra = {"lookup_block": args.lookup_block}
    if args.tracking_uri:
        common["tracking_uri"] = args.tracking_uri
    return {**common, "drafter": args.drafter, "speculation": args.speculation, **extra}, {**common, "drafter": "none"}


def start_apps(args) -> tuple[str, str]:
    """Start the speculative app at /spec and the AR app at /ar in this process."""
    import ray
    from ray import serve

    from serve_app import build_app

    # logical CPUs: the two apps' engine replicas (and a plain pool) reserve replica_cpus each;
    # each app's builder checks itself against the cluster, not against the other app
    ray.init(address="local", num_cpus=args.num_cpus or (8 if args.backend == "vllm" else None),
             include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    spec, ar = app_settings(args)
    serve.run(build_app(spec), name="spec", route_prefix="/spec")
    serve.run(build_app(ar), name="ar", route_prefix="/ar")
    base = f"http://127.0.0.1:{args.port}"
    return base + "/spec", base + "/ar"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode, color, marker in (("spec", "C0", "o"), ("ar", "C1", "s")):
        rows = report["results"].get(mode) or []
        if not rows:
            continue
        c = [r["concurrency"] for r in rows]
        ms = lambda key: [(r[key] or 0) * 1e3 for r in rows]  # noqa: E731
        axes[0].plot(c, [r["tokens_per_s"] for r in rows], marker=marker, color=color, label=mode)
        for ax, key in ((axes[1], "ttft"), (axes[2], "itl")):
            ax.plot(c, ms(f"{key}_p50_s"), marker=marker, color=color, label=f"{mode} p50")
            ax.plot(c, ms(f"{key}_p99_s"), marker=marker, color=color, linestyle=":", alpha=0.6,
                    label=f"{mode} p99")
    for ax, title in zip(axes, ("output tokens/s", "TTFT (ms)", "inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    speedups = report.get("speedup") or {}
    if speedups:
        fig.suptitle("spec / AR throughput: " + ", ".join(f"c={c}: {s:.2f}x" for c, s in speedups.items()))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def compare(results: dict[str, list[dict]]) -> tuple[dict, dict]:
    """Per level, spec/AR throughput and spec/AR tokens per replica CPU second (printed)."""
    speedup, cpu_speedup = {}, {}
    if "ar" not in results:
        return speedup, cpu_speedup
    for s, a in zip(results["spec"], results["ar"]):
        if a["tokens_per_s"]:
            speedup[str(s["concurrency"])] = s["tokens_per_s"] / a["tokens_per_s"]
        if s["replica_cpu_s_per_token"] and a["replica_cpu_s_per_token"]:
            cpu_speedup[str(s["concurrency"])] = a["replica_cpu_s_per_token"] / s["replica_cpu_s_per_token"]
    print("spec/AR throughput:         " + "  ".join(f"c={c}: {v:.2f}x" for c, v in speedup.items()))
    if cpu_speedup:  # robust to other load on the machine: tokens per replica CPU second
        print("spec/AR tokens per CPU-sec: " + "  ".join(f"c={c}: {v:.2f}x" for c, v in cpu_speedup.items()))
    return speedup, cpu_speedup


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="speculative endpoint base URL (without /v1)")
    ap.add_argument("--ar-url", help="AR endpoint base URL (same app with drafter=none)")
    ap.add_argument("--start", action="store_true", help="start both apps in-process (ignores --url/--ar-url)")
    ap.add_argument("--concurrency", default="1,2,4,8,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--requests", type=int, default=32,
                    help="requests per level (at least the concurrency); several waves per level keep the "
                         "spec/AR ratio out of one wave's noise")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", default="sharegpt", help="sharegpt | humaneval | a prompt file (specdec.prompts)")
    ap.add_argument("--model", default=None, help="model name to send (default: the server's)")
    ap.add_argument("--api-key", default=os.environ.get("DFLASH_API_KEY"))
    ap.add_argument("--out", default="runs/loadtest")
    # --start only
    ap.add_argument("--target", default=None)
    ap.add_argument("--backend", default="hf", choices=("hf", "vllm"), help="the serving backend of both apps")
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--tracking-uri", default=None)
    ap.add_argument("--speculation", default="auto", help="the served mode: auto | off | N (a fixed block)")
    ap.add_argument("--lookup-block", type=int, default=8, help="prompt lookup beside the drafter (0: drafter alone)")
    ap.add_argument("--plain-pool", type=int, default=None, metavar="N",
                    help="vllm: the speculative app gets a plain pool; N requests speculate at once, the rest "
                         "decode plain (vllm_plain_pool, speculative_max_inflight)")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--replica-cpus", type=float, default=1.0)
    ap.add_argument("--torch-threads", type=int, default=None)
    ap.add_argument("--num-cpus", type=int, default=None)
    ap.add_argument("--port", type=int, default=8011)
    args = ap.parse_args(argv)

    if args.start:
        spec_url, ar_url = start_apps(args)
    else:
        if not args.url:
            ap.error("--url is required unless --start is given")
        spec_url, ar_url = args.url.rstrip("/"), (args.ar_url.rstrip("/") if args.ar_url else None)
    messages = load_messages(args.prompts, limit=max(args.requests, max(args.concurrency)) * 2)
    modes = {"spec": spec_url, **({"ar": ar_url} if ar_url else {})}
    for url in modes.values():  # warm up: first requests pay one-off costs
        asyncio.run(run_level(url, messages, 1, 1, 8, args.model, args.api_key))

    results: dict[str, list[dict]] = {m: [] for m in modes}
    print(f"{'mode':<5} {'conc':>4} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'TPOT p50':>9} {'tau':>5} {'cpu/tok':>8} {'err':>4}")
    for level, c in enumerate(args.concurrency):
        order = list(modes.items())
        if level % 2:  # alternate which mode goes first, so drifting machine load favours neither
            order.reverse()
        for mode, url in order:
            row = asyncio.run(run_level(url, messages, c, max(args.requests, c), args.max_tokens, args.model,
                                        args.api_key))
            results[mode].append(row)
            ms = lambda v: f"{v * 1e3:8.0f}ms" if v is not None else "       -"  # noqa: E731
            tau = f"{row['mean_tau']:5.2f}" if row["mean_tau"] else "    -"
            cpu = row["replica_cpu_s_per_token"]
            cpu = f"{cpu * 1e3:6.1f}ms" if cpu is not None else "       -"
            print(f"{mode:<5} {c:>4} {row['tokens_per_s']:8.1f} {ms(row['ttft_p50_s'])} {ms(row['ttft_p99_s'])}"
                  f"{ms(row['itl_p50_s'])}{ms(row['itl_p99_s'])} {ms(row['tpot_p50_s'])} {tau} {cpu} "
                  f"{row['errors']:>4}", flush=True)
    speedup, cpu_speedup = compare(results)
    report = {"urls": modes, "max_tokens": args.max_tokens, "requests_per_level": args.requests,
              "lookup_block": args.lookup_block if args.start else None,
              "prompts": args.prompts, "results": results, "speedup": speedup, "cpu_speedup": cpu_speedup,
              "started_in_process": args.start, "drafter": args.drafter if args.start else None,
              "backend": args.backend if args.start else None}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loadtest.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "loadtest.png")
    print(f"wrote {out / 'loadtest.json'} and {out / 'loadtest.png'}")
    if args.start:
        from ray import serve

        serve.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
