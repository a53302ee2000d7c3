"""The traffic-adaptation benchmark (``jobs/bench_adapt.py``): the whole loop of issue 44 in one
run, on a domain the reference drafter never saw, with the time of each stage.

1. **traffic**: code questions made from the documented functions of Python's standard library
   (:func:`code_prompts`, offline and deterministic), split by a hash of their id: the served
   share, and a held-out share that is never served (the benchmark's domain set);
2. **serving**: the app (``serve_app``, hf or vllm backend) follows ``@champion`` = the packaged
   reference drafter in a fresh MLflow store, with capture on; a load generator sends the served
   share (greedy, ``--concurrency`` clients); the app is stopped, its buffers written;
3. **adaptation**: one pass of ``jobs/adapt_drafter.py`` over the captures (features from the
   captured answers, a fine-tune from ``@champion``, the promotion on held-out traffic and
   ShareGPT), as a user runs it;
4. **measurement**: the engine benchmark (``pipelines.evaluate.measure``: AR, the reference and
   the adapted drafter side by side, interleaved, greedy, exact) on the held-out code questions and
   on ShareGPT held-out: tau, speedup vs AR, and the ratios the goal names.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
MODEL = "dflash-smollm2-135m"
#: the goal (issue 44): adapted / reference on the domain, and on ShareGPT
GOALS = {"domain_tau": 1.25, "domain_speedup": 1.2, "sharegpt_tau": 0.95}
#: standard-library modules whose documented functions make the code questions
STDLIB = ("os.path", "shutil", "pathlib", "glob", "fnmatch", "string", "textwrap", "difflib", "re", "json", "csv",
          "base64", "binascii", "hashlib", "hmac", "secrets", "random", "statistics", "math", "cmath", "decimal",
          "fractions", "itertools", "functools", "operator", "collections", "heapq", "bisect", "copy", "pprint",
          "enum", "dataclasses", "typing", "inspect", "ast", "tokenize", "keyword", "calendar", "datetime", "time",
          "zoneinfo", "html", "html.parser", "urllib.parse", "email.utils", "mimetypes", "ipaddress", "uuid",
          "socket", "ssl", "http.client", "http.cookies", "wsgiref.util", "xml.dom.minidom", "configparser",
          "argparse", "logging", "warnings", "contextlib", "abc", "io", "gzip", "zipfile", "tarfile", "zlib",
          "sqlite3", "tempfile", "subprocess", "shlex", "threading", "queue", "sched", "asyncio", "unittest",
          "doctest", "timeit", "trace", "traceback", "pickle", "struct", "array", "weakref", "types", "locale",
          "gettext", "platform", "sysconfig", "codecs", "unicodedata", "stringprep", "quopri", "uu", "colorsys",
          "wave", "graphlib", "numbers", "getpass", "netrc", "plistlib", "filecmp", "fileinput", "linecache")
STYLES = ("Write a Python function `{sig}` that does the following:\n\n{doc}\n\nReply with the code only.",
          "Implement `{sig}` in Python. Its documentation says:\n\n{doc}",
          "Show how to write `{sig}` from scratch in Python. It should behave like this:\n\n{doc}")


class AdaptBenchError(RuntimeError):
    """A stage failed; the message says which and why."""


@dataclass
class AdaptBenchConfig:
    out: Path
    requests: int = 1500  # served (and captured) requests: at most the goal's 1,500
    holdout: int = 24  # code questions never served: the domain set measured at the end
    concurrency: int = 16
    max_tokens: int = 256
    backend: str = "vllm"
    eval_prompts: int = 16
    eval_tokens: int = 96
    port: int = 8013
    adapt_sets: list[str] = field(default_factory=list)  # recipe overrides for the adaptation pass
    recipe: str = "configs/smollm2-135m-adapt.yaml"


# ------------------------------------------------------------------------------ 1. traffic
def code_prompts(limit: int | None = None) -> list[dict]:
    """Code questions from the standard library's documented public functions and methods, one
    per (function, style), in a fixed order: ``{"id", "messages"}``. No network, no dataset."""
    import importlib

    out, seen = [], set()
    for name in STDLIB:
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this Python lacks (uu was removed in 3.13)
            continue
        for qual, fn in _documented(mod):
            doc = inspect.cleandoc(fn.__doc__).split("\n\n")[0].strip()
            key = f"{name}.{qual}"
            if len(doc) < 40 or key in seen or "deprecated" in doc.lower() or doc.startswith("Don't"):
                continue
            seen.add(key)
            sig = f"{qual.rsplit('.', 1)[-1]}{_signature(fn)}"
            style = int(hashlib.sha256(key.encode()).hexdigest()[:4], 16) % len(STYLES)
            out.append({"id": f"code-{key}", "messages": [
                {"role": "user", "content": STYLES[style].format(sig=sig, doc=doc)}]})
            if limit is not None and len(out) >= limit:
                return out
    return out


def _documented(mod) -> list[tuple[str, object]]:
    """(qualified name, callable) of ``mod``'s public functions and its public classes' methods."""
    found = []
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isfunction(obj) and obj.__doc__:
            found.append((name, obj))
        elif inspect.isclass(obj):
            for m, f in sorted(vars(obj).items()):
                if not m.startswith("_") and inspect.isfunction(f) and f.__doc__:
                    found.append((f"{name}.{m}", f))
    return found


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def split_prompts(prompts: list[dict], holdout: int) -> tuple[list[dict], list[dict]]:
    """(served, held out): the ``holdout`` prompts whose id hashes lowest are never served."""
    ranked = sorted(prompts, key=lambda p: hashlib.sha256(p["id"].encode()).hexdigest())
    held = {p["id"] for p in ranked[:holdout]}
    return [p for p in prompts if p["id"] not in held], [p for p in prompts if p["id"] in held]


# ------------------------------------------------------------------------------ 2. serving
def register_reference(tracking_uri: str) -> str:
    """The packaged reference drafter as version 1 and ``@champion`` of a fresh store."""
    from pipelines import registry
    from pipelines.promote import register_directory
    from specdec.assets import reference_drafter_for

    _, version, _ = register_directory(tracking_uri, MODEL, reference_drafter_for(None))
    registry.set_aliases(tracking_uri, MODEL, [("champion", version)], {"champion": None})
    return version


def app_settings(cfg: AdaptBenchConfig, tracking_uri: str) -> dict:
    """The served app: @champion of the fresh store, capture on, one engine replica."""
    common = {"backend": cfg.backend, "drafter": f"models:/{MODEL}@champion", "tracking_uri": tracking_uri,
              "min_replicas": 1, "max_replicas": 1, "api_key_env": "DFLASH_BENCH_NO_KEY",
              "capture": {"uri": str(cfg.out / "capture"), "flush_s": 5.0, "max_buffer": 4 * cfg.requests}}
    if cfg.backend == "vllm":
        return {**common, "vllm_engine_kwargs": {"max_model_len": 2048, "max_num_seqs": cfg.concurrency}}
    return {**common, "max_batch_size": cfg.concurrency, "max_tokens_limit": cfg.max_tokens, "registry_poll_s": 0}


def serve_and_drive(cfg: AdaptBenchConfig, served: list[dict], tracking_uri: str) -> dict:
    """Start the app, send ``cfg.requests`` requests cycling over ``served``, stop the app (its
    capture buffers are written on the way down). Returns the load's numbers."""
    import asyncio

    import ray
    from ray import serve

    from serve_app import build_app

    ray.init(address="local", num_cpus=8 if cfg.backend == "vllm" else None, include_dashboard=False,
             log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": cfg.port})
        serve.run(build_app(app_settings(cfg, tracking_uri)), name="bench", route_prefix="/")
        url = f"http://127.0.0.1:{cfg.port}"
        load = asyncio.run(drive(url, served, cfg.requests, cfg.concurrency, cfg.max_tokens))
        serve.shutdown()  # the replicas write what their capture buffers hold
    finally:
        ray.shutdown()
    return load


async def drive(url: str, prompts: list[dict], n: int, concurrency: int, max_tokens: int) -> dict:
    """``n`` greedy chat requests from ``concurrency`` clients, prompts in turn; progress on the log."""
    import asyncio

    import httpx

    todo = asyncio.Queue()
    for i in range(n):
        todo.put_nowait(prompts[i % len(prompts)])
    done = {"ok": 0, "failed": 0, "tokens": 0, "errors": []}
    t0 = time.monotonic()

    async def client(http):
        while not todo.empty():
            p = todo.get_nowait()
            try:
                r = await http.post(f"{url}/v1/chat/completions", json={
                    "model": "smollm2-135m", "messages": p["messages"], "max_tokens": max_tokens, "temperature": 0})
                r.raise_for_status()
                done["ok"] += 1
                done["tokens"] += r.json()["usage"]["completion_tokens"]
            except (httpx.HTTPError, KeyError, ValueError) as e:
                done["failed"] += 1
                done["errors"] = (done["errors"] + [str(e)[:200]])[:5]
            if (done["ok"] + done["failed"]) % 50 == 0:
                log.info("traffic: %d/%d requests, %.0f tok/s", done["ok"] + done["failed"], n,
                         done["tokens"] / (time.monotonic() - t0))

    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    seconds = time.monotonic() - t0
    return {**done, "requests": n, "seconds": seconds, "tokens_per_s": done["tokens"] / seconds}


# ------------------------------------------------------------------------------ 3. adaptation
def adapt_pass(cfg: AdaptBenchConfig, tracking_uri: str) -> dict:
    """One pass of ``jobs/adapt_drafter.py`` over the captures, in the benchmark's folders."""
    sets = [f"adapt.captures=[{cfg.out / 'capture'}]", f"adapt.state={cfg.out / 'adapt'}", "adapt.min_prompts=1",
            f"features.output={cfg.out / 'features'}", f"train.storage_path={cfg.out / 'train'}",
            f"registry.tracking_uri={tracking_uri}", *cfg.adapt_sets]
    cmd = [sys.executable, "jobs/adapt_drafter.py", "--config", cfg.recipe, "--json"]
    for s in sets:
        cmd += ["--set", s]
    logf = cfg.out / "adapt.log"
    with open(logf, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=f, text=True,
                            env={**os.environ, "MLFLOW_TRACKING_URI": tracking_uri}).returncode
    state = cfg.out / "adapt" / "state.json"
    if rc not in (0, 1) or not state.is_file():
        raise AdaptBenchError(f"the adaptation pass exited {rc} (log: {logf})")
    window = json.loads(state.read_text())["windows"][-1]
    return {"returncode": rc, "decision": "promoted" if rc == 0 else "refused", "window": window}


# ------------------------------------------------------------------------------ 4. measurement
def measure_sets(cfg: AdaptBenchConfig, tracking_uri: str, version: str, held: list[dict]) -> dict:
    """Reference and adapted drafter beside AR on the held-out code questions and ShareGPT."""
    from pipelines import registry
    from pipelines.evaluate import Candidate, measure
    from specdec.assets import reference_drafter_for
    from specdec.bench import load_prompt_ids
    from specdec.checkpoint import load_drafter
    from specdec.target import load_target

    target = load_target(None)
    adapted_dir = registry.download_version(tracking_uri, MODEL, version, cfg.out / "adapted")
    drafters = {"reference": load_drafter(reference_drafter_for(None), target=target),
                "adapted": load_drafter(adapted_dir, target=target)}
    cands = [Candidate(name, "challenger" if name == "adapted" else "champion", name, d, d.config.block_size)
             for name, d in drafters.items()]
    code = held[:cfg.eval_prompts]
    sets = {"code (held out)": ([p["id"] for p in code], [target.encode_chat(p["messages"]) for p in code]),
            "sharegpt (held out)": load_prompt_ids(target, "sharegpt", cfg.eval_prompts)}
    out = {}
    for name, (ids, prompts) in sets.items():
        log.info("measuring ar, reference and adapted on %d prompts of %s", len(prompts), name)
        report = measure(target, cands, prompts, ids, cfg.eval_tokens, name)
        out[name] = {r["method"]: {"tau": r["tau_mean"], "speedup": r["speedup_vs_ar"],
                                   "tokens_per_s": r["tokens_per_s"],
                                   "exact": bool(report["exactness"]["equal"].get(r["method"], True))}
                     for r in report["results"]}
    return out


def goals(results: dict) -> dict:
    """The goal's ratios, adapted / reference, and whether each is met."""
    code, chat = results["code (held out)"], results["sharegpt (held out)"]
    ratio = lambda s, k: (s["adapted"][k] or 0) / (s["reference"][k] or float("nan"))  # noqa: E731
    got = {"domain_tau": ratio(code, "tau"), "domain_speedup": ratio(code, "speedup"),
           "sharegpt_tau": ratio(chat, "tau")}
    return {k: {"ratio": v, "goal": GOALS[k], "met": v >= GOALS[k]} for k, v in got.items()}


# ------------------------------------------------------------------------------ the run
def run_adapt_bench(cfg: AdaptBenchConfig) -> dict:
    """The four stages, timed; the report ``write_report`` writes as JSON and PNG."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    tracking_uri = f"sqlite:///{(cfg.out / 'mlflow.db').absolute()}"
    stages: dict[str, float] = {}
    t = time.monotonic()
    prompts = code_prompts()
    served, held = split_prompts(prompts, cfg.holdout)
    if len(served) < 1:
        raise AdaptBenchError("no code questions to serve")
    register_reference(tracking_uri)
    stages["traffic"] = time.monotonic() - t
    t = time.monotonic()
    load = serve_and_drive(cfg, served, tracking_uri)
    stages["serving"] = time.monotonic() - t
    if load["ok"] == 0:
        raise AdaptBenchError(f"no request was answered: {load['errors']}")
    t = time.monotonic()
    adapted = adapt_pass(cfg, tracking_uri)
    stages["adaptation"] = time.monotonic() - t
    t = time.monotonic()
    results = measure_sets(cfg, tracking_uri, adapted["window"]["version"], held)
    stages["measurement"] = time.monotonic() - t
    return {"config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()} |
            {"code_questions": len(prompts), "served_questions": len(served), "held_out_questions": len(held)},
            "stage_seconds": stages, "total_seconds": sum(stages.values()), "traffic": load,
            "adaptation": adapted, "results": results, "goals": goals(results)}


def format_table(report: dict) -> str:
    lines = ["| prompts | drafter | tau | speedup vs AR | exact |", "|---|---|---|---|---|"]
    for name, methods in report["results"].items():
        for m in ("reference", "adapted"):
            r = methods[m]
            lines.append(f"| {name} | {m} | {r['tau']:.2f} | {r['speedup']:.2f}x | {'yes' if r['exact'] else 'NO'} |")
    lines += ["", "| goal (adapted / reference) | ratio | goal | met |", "|---|---|---|---|"]
    for k, g in report["goals"].items():
        lines.append(f"| {k} | {g['ratio']:.2f} | >= {g['goal']} | {'yes' if g['met'] else 'no'} |")
    lines += ["", "| stage | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.0f} |" for k, v in report["stage_seconds"].items()]
    lines.append(f"| total | {report['total_seconds']:.0f} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(report["results"])
    for ax, key, title in ((axes[0], "tau", "engine tau"), (axes[1], "speedup", "speedup vs AR")):
        for i, m in enumerate(("reference", "adapted")):
            vals = [report["results"][n][m][key] or 0 for n in names]
            ax.bar([x + 0.38 * i for x in range(len(names))], vals, width=0.36, label=m)
        ax.set_xticks([x + 0.19 for x in range(len(names))], names)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report['traffic']['ok']} captured requests, loop {report['total_seconds'] / 60:.0f} min")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
