"""`make demo`: the whole life of a drafter on one machine, ending in a served, measured speedup.

Stages (each one the command a user types; its full output goes to ``<out>/logs/<stage>.log``):

  stack     python -m cluster.stack up            Ray head + dashboard, MLflow server
  features  ray job submit -- python jobs/generate_features.py     (Ray Data, Parquet shards)
  reference python jobs/promote_drafter.py --register <packaged reference drafter>   (first @champion)
  training  ray job submit -- python jobs/train_drafter.py         (Ray Train, MLflow registration)
  promotion python jobs/promote_drafter.py --challenger <new version>   (vs @champion, side by side)
  serving   serve run <out>/serve.yaml            app "dflash" follows @champion, app "ar" is the target alone
  chat      the official openai client, the same greedy chat requests to both apps, interleaved

then a summary (``<out>/summary.json`` + ``summary.png``): tau, tokens/s and speedup vs AR over
HTTP, where the time goes per token (prefill / draft / verify / overhead, from /metrics).

Re-running reuses every stage whose result is recorded in ``<out>/demo.json`` and still
exists; the served apps keep running, and ``stop`` (``make demo-stop``) ends them and the stack.

One room over 400 lines: :class:`Demo` is the stage sequence, one method per stage over the
state they share (``demo.json``), read top to bottom as the stages run. What it prints is
``demo_console.py``'s, its summary numbers ``demo_metrics.py``'s, its processes (and ``stop``)
``demo_processes.py``'s.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.demo_console import (HEARTBEAT_S, DemoError, TrainProgress, elapsed, evaluation_progress,
                                  features_progress, interruptible, run_logged, say)
from harness.demo_metrics import app_metrics, metrics_delta, plot_summary, settled_metrics
from harness.demo_processes import STATE, alive, http_get, port_or_free

ROOT = Path(__file__).resolve().parents[1]
# this interpreter's bin (a venv's, not the symlink target): ray, serve and python that have the project
BIN = Path(os.path.dirname(os.path.abspath(sys.executable)))
APPS = {"dflash": "", "ar": "/ar"}  # served app -> route prefix


@dataclass
class DemoConfig:
    """What `make demo` runs; every path is under ``out``."""

    out: Path = Path("runs/demo")
    config: str = "configs/smollm2-135m.yaml"
    target: str | None = None  # None: the recipe's target (the embedded SmolLM2)
    prompts: int = 256  # ShareGPT prompts the target answers for the features (a few hundred)
    max_new_tokens: int = 64
    steps: int = 60  # training steps (the full recipe: configs/smollm2-135m.yaml)
    sets: list[str] = field(default_factory=list)  # extra recipe overrides for features and training
    reference: str = "auto"  # first champion: auto (the packaged one for the target), a drafter dir, none
    metric: str = "speedup"  # what promotion compares
    lookup_block: int = 8  # promotion judges drafters with prompt lookup beside them, as serving runs them
    eval_prompts: int = 4
    eval_tokens: int = 32
    chat_requests: int = 6
    chat_tokens: int = 64
    port: int | None = None  # HTTP port of the served apps (default: 8000 when free)
    stack_cpus: int = 4  # logical CPUs of the head: jobs and the served replicas fit side by side
    serve_timeout_s: float = 600.0

    def __post_init__(self):
        self.out = Path(self.out)
        if not self.out.is_absolute():
            self.out = ROOT / self.out
        for name in ("prompts", "max_new_tokens", "steps", "eval_prompts", "eval_tokens", "chat_requests",
                     "chat_tokens", "stack_cpus"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {getattr(self, name)!r}")
        for item in self.sets:
            if "=" not in item:
                raise ValueError(f"--set: expected KEY=VALUE, got {item!r}")


class Demo:
    def __init__(self, cfg: DemoConfig):
        self.cfg = cfg
        self.out = cfg.out
        self.logs = self.out / "logs"
        self.state_path = self.out / STATE
        self.state: dict = json.loads(self.state_path.read_text()) if self.state_path.is_file() else {}
        self.env: dict[str, str] = dict(os.environ)
        self.times: dict[str, float] = {}

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1, default=str))
        tmp.replace(self.state_path)

    def stage(self, key: str, title: str, shown: str) -> float:
        say(f"\n[{key}] {title}\n  $ {shown}")
        return time.monotonic()

    def done(self, key: str, t0: float, line: str) -> None:
        self.times[key] = round(time.monotonic() - t0, 1)
        say(f"  {line}  ({elapsed(self.times[key])}; log: {self._rel(self.logs / (key + '.log'))})")

    def _rel(self, p: Path) -> str:
        try:
            return str(Path(p).relative_to(ROOT))
        except ValueError:
            return str(p)

    def fail(self, key: str, why: str, lines: list[str]) -> DemoError:
        tail = "\n".join("    " + x for x in lines[-15:])
        return DemoError(f"demo stopped at '{key}': {why}\n{tail}\n  full log: {self.logs / (key + '.log')}")

    # ------------------------------------------------------------------------- helpers
    def recipe_sets(self) -> list[str]:
        c, out = self.cfg, self.out
        sets = [f"features.output={out / 'features'}", f"features.prompts.limit={c.prompts}",
                f"features.generation.max_new_tokens={c.max_new_tokens}", "features.storage.samples_per_shard=16",
                f"train.storage_path={out / 'train'}", "train.run_name=demo", f"train.max_steps={c.steps}",
                "train.eval_every=20", "train.log_every=5", "train.holdout_fraction=0.1"]
        if c.target:
            sets.append(f"features.target.model={c.target}")
        return sets + list(c.sets)

    def job(self, key: str, script: str) -> list[str]:
        """``ray job submit`` of one of our jobs against the stack (the head runs it in the repo)."""
        argv = ["python", script, "--config", self.cfg.config]
        for s in self.recipe_sets():
            argv += ["--set", s]
        sid = f"demo-{key}-{time.strftime('%Y%m%d-%H%M%S')}"
        return [str(BIN / "ray"), "job", "submit", "--submission-id", sid, "--log-style", "record", "--",
                *argv]

    def submit(self, key: str, script: str, progress) -> tuple[list[str], float]:
        cmd = self.job(key, script)
        shown = f"ray job submit -- python {script} --config {self.cfg.config} --set ... (see the log)"
        t0 = self.stage(key, {"features": "target generations + hidden states -> Parquet shards (Ray Data)",
                              "training": "fit a DFlash drafter (Ray Train), register it in MLflow"}[key], shown)
        rc, lines = run_logged(key, cmd, self.logs / f"{key}.log", self.env, progress)
        if rc != 0 or not any("succeeded" in x for x in lines[-20:]):
            raise self.fail(key, f"the Ray job did not succeed (exit {rc})", lines)
        return lines, t0

    def promote_cmd(self, *extra: str) -> list[str]:
        c = self.cfg
        cmd = [sys.executable, "jobs/promote_drafter.py", "--tracking-uri", self.tracking_uri, "--model", self.model,
               "--prompts", "sharegpt", "--num-prompts", str(c.eval_prompts), "--max-new-tokens", str(c.eval_tokens),
               "--metric", c.metric, "--lookup-block", str(c.lookup_block), *extra]
        return cmd + (["--target", c.target] if c.target else [])

    @property
    def tracking_uri(self) -> str:
        return self.env["MLFLOW_TRACKING_URI"]

    @property
    def model(self) -> str:
        from pipelines.promote import model_name

        return model_name(None, self.cfg.target)

    # ------------------------------------------------------------------------- stages
    def stack(self) -> None:
        t0 = self.stage("stack", "local stack: Ray head + dashboard, MLflow server",
                        f"python -m cluster.stack --state-dir {self._rel(self.out / 'stack')} up --num-cpus "
                        f"{self.cfg.stack_cpus}")
        cmd = [sys.executable, "-m", "cluster.stack", "--state-dir", str(self.out / "stack"), "up",
               "--num-cpus", str(self.cfg.stack_cpus)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_API_SERVER"))}
        rc, lines = run_logged("stack", cmd, self.logs / "stack.log", env)
        if rc != 0:
            raise self.fail("stack", f"`cluster.stack up` exited {rc}", lines)
        sys.path.insert(0, str(ROOT))
        from cluster.stack_state import load_state, stack_env

        st = load_state(self.out / "stack")
        self.env.update(stack_env(st))
        self.env["PATH"] = str(BIN) + os.pathsep + self.env.get("PATH", "")
        self.state["stack"] = {"dashboard": self.env.get("RAY_API_SERVER_ADDRESS"),
                               "mlflow": self.env["MLFLOW_TRACKING_URI"], "ray": self.env.get("RAY_ADDRESS")}
        again = any("already running" in x for x in lines)
        self.done("stack", t0, f"{'already running' if again else 'up'}: Ray dashboard "
                  f"{self.state['stack']['dashboard']}, MLflow {self.tracking_uri}")

    def features(self) -> None:
        man = self.out / "features" / "manifest.json"
        if man.is_file() and self.state.get("features"):
            say(f"\n[features] reused: {self._rel(man.parent)} ({self.state['features']['samples']} samples)")
            return
        _, t0 = self.submit("features", "jobs/generate_features.py", features_progress)
        m = json.loads(man.read_text())
        self.state["features"] = {"uri": str(man.parent), "samples": m["num_samples"], "tokens": m["num_tokens"]}
        self.save()
        self.done("features", t0,
                  f"committed {m['num_samples']} samples, {m['num_tokens']} tokens: {self._rel(man)}")

    def reference(self) -> None:
        from specdec.assets import reference_drafter_for

        ref = {"auto": lambda: reference_drafter_for(self.cfg.target), "none": lambda: None}.get(
            self.cfg.reference, lambda: Path(self.cfg.reference).absolute())()
        if ref is None:
            return
        r = self.state.get("reference")
        if r and r.get("path") == str(ref) and self._registered(r.get("version")):
            say(f"\n[reference] reused: {self.model} v{r['version']} ({r['decision']})")
            return
        self.state["reference"] = self._promote(
            "reference", "the reference drafter, registered and judged vs the target alone (the first @champion)",
            ["--register", str(ref)], shown=f"--register {self._rel(ref)}") | {"path": str(ref)}
        self.save()

    def training(self) -> None:
        drafter = self.out / "train" / "demo" / "drafter"
        if (drafter / "config.json").is_file() and self._registered(self.state.get("training", {}).get("version")):
            t = self.state["training"]
            say(f"\n[training] reused: {self._rel(drafter)} (models:/{t['model']}/{t['version']})")
            return
        lines, t0 = self.submit("training", "jobs/train_drafter.py", TrainProgress(self.cfg.steps))
        text = "\n".join(lines)
        reg = re.search(r"registered: models:/([^/\s]+)/(\d+)", text)
        tau = re.search(r"best held-out tau ([\d.]+) at step (\d+)", text)
        if reg is None:
            raise self.fail("training", "the job registered no version", lines)
        self.state["training"] = {"drafter": str(drafter), "model": reg.group(1), "version": reg.group(2),
                                  "holdout_tau": float(tau.group(1)) if tau else None,
                                  "best_step": int(tau.group(2)) if tau else None,
                                  "lineage": self._lineage(reg.group(1), reg.group(2))}
        self.save()
        self.done("training", t0,
                  f"held-out tau {self.state['training']['holdout_tau']} -> registered models:/{reg.group(1)}/"
                  f"{reg.group(2)}")

    def _registered(self, version: str | None) -> bool:
        """``version`` of the demo's model is in the (current) registry."""
        from pipelines import registry

        try:
            return version is not None and version in registry.read_model(self.tracking_uri, self.model).versions
        except registry.NotFound:
            return False

    def _lineage(self, name: str, version: str) -> dict:
        from pipelines import registry

        mv = registry.read_model(self.tracking_uri, name).versions[version]
        return {k: v for k, v in (mv.tags or {}).items() if k in registry.LINEAGE_KEYS} | {"run_id": mv.run_id}

    def promotion(self) -> None:
        version = self.state["training"]["version"]
        if self.state.get("promotion", {}).get("version") == version and self._registered(version):
            p = self.state["promotion"]
            say(f"\n[promotion] reused: v{version} {p['decision']} (@champion v{p['champion']})")
            return
        self.state["promotion"] = self._promote(
            "promotion", f"v{version} vs @champion, side by side (promoted only if it wins)",
            ["--challenger", version], shown=f"--challenger {version}")
        self.save()

    def _promote(self, key: str, title: str, args: list[str], shown: str) -> dict:
        """Run ``promote_drafter.py``, echo its side-by-side table and decision, record them."""
        t0 = self.stage(key, title, f"python jobs/promote_drafter.py {shown}")
        out = self.out / "promotion" / key
        (out / "decision.json").unlink(missing_ok=True)  # only this run's decision counts
        rc, lines = run_logged(key, self.promote_cmd(*args, "--out", str(out)), self.logs / f"{key}.log", self.env,
                               evaluation_progress)
        if rc not in (0, 1) or not (out / "decision.json").is_file():
            raise self.fail(key, f"promote_drafter.py exited {rc}", lines)
        start = next((i for i, x in enumerate(lines) if " vs " in x and "prompts from" in x), 0)
        for x in lines[start:]:
            if x.startswith(("method", "ar ", "dflash", "decision", "aliases", "registered", "already registered")) \
                    or (" vs " in x and not x.startswith("refused:")):
                say("  " + x)
        d = json.loads((out / "decision.json").read_text())
        from pipelines import registry

        st = registry.read_model(self.tracking_uri, self.model)
        res = {"decision": "PROMOTED" if d["decision"]["promote"] else "REFUSED", "reason": d["decision"]["reason"],
               "evaluations": d["evaluations"], "champion": st.champion, "tracking_uri": self.tracking_uri,
               "version": d["evaluations"]["challenger"]["version"]}
        self.done(key, t0, f"-> {res['decision']}; @champion is {'v' + st.champion if st.champion else 'unset'}")
        return res

    # ------------------------------------------------------------------------- serving
    def serve_config(self) -> Path:
        import yaml

        port = self.state.get("serving", {}).get("port") or self.cfg.port or port_or_free(8000)
        common = {"target": self.cfg.target or "smollm2", "min_replicas": 1, "max_replicas": 1,
                  "torch_threads": 2, "max_batch_size": 4, "registry_poll_s": 10}
        spec = {**common, "drafter": "auto", "tracking_uri": self.tracking_uri, "lookup_block": self.cfg.lookup_block}
        ar = {**common, "drafter": "none"}
        cfg = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
               "applications": [
                   {"name": "dflash", "route_prefix": "/", "import_path": "serve_app:build_app", "args": spec},
                   {"name": "ar", "route_prefix": "/ar", "import_path": "serve_app:build_app", "args": ar}]}
        path = self.out / "serve.yaml"
        path.write_text("# written by jobs/demo.py: the speculative app (drafter auto = @champion) and the\n"
                        "# same target alone at /ar, for the side-by-side numbers\n" + yaml.safe_dump(cfg, sort_keys=False))
        self.state.setdefault("serving", {})["port"] = port
        return path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.state['serving']['port']}"

    def _apps_up(self) -> list[str]:
        return [app for app, route in APPS.items() if http_get(self.url + route + "/v1/models", 2.0)[0] == 200]

    def serving(self) -> None:
        s = self.state.get("serving", {})
        if s.get("pid") and alive(s["pid"]) and s.get("tracking_uri") == self.tracking_uri \
                and len(self._apps_up()) == len(APPS):
            say(f"\n[serving] reused: {self.url} (serve run, pid {s['pid']})")
            return
        path = self.serve_config()
        t0 = self.stage("serving", "serve run: app 'dflash' follows @champion, app 'ar' is the target alone",
                        f"serve run {self._rel(path)}")
        log = self.logs / "serving.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            proc = subprocess.Popen([str(BIN / "serve"), "run", str(path)], cwd=ROOT, env=self.env, stdout=f,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=interruptible)
        self.state["serving"] |= {"pid": proc.pid, "config": str(path), "tracking_uri": self.tracking_uri}
        self.save()
        last = time.monotonic()
        while len(up := self._apps_up()) < len(APPS):
            if proc.poll() is not None:
                raise self.fail("serving", f"serve run exited {proc.returncode}",
                                log.read_text(errors="replace").splitlines())
            if time.monotonic() - t0 > self.cfg.serve_timeout_s:
                raise self.fail("serving", f"the apps did not answer within {self.cfg.serve_timeout_s:.0f} s",
                                log.read_text(errors="replace").splitlines())
            if time.monotonic() - last >= HEARTBEAT_S:
                say(f"  serving: loading target + drafter · apps up {len(up)}/{len(APPS)} · "
                    f"{elapsed(time.monotonic() - t0)}")
                last = time.monotonic()
            time.sleep(1.0)
        self.done("serving", t0, f"up: {self.url} (speculative) and {self.url}/ar (AR)")

    def chat(self) -> dict:
        """The same greedy chat requests to both apps with the openai client, interleaved
        (which goes first alternates), and each app's /metrics before and after."""
        from openai import OpenAI

        from specdec.prompts import load_prompts

        c = self.cfg
        t0 = self.stage("chat", f"{c.chat_requests} ShareGPT chat requests x {c.chat_tokens} tokens to each app, "
                        "with the official openai client", f"OpenAI(base_url='{self.url}/v1').chat.completions.create(...)")
        key = os.environ.get("DFLASH_API_KEY") or "none"
        clients = {app: OpenAI(base_url=self.url + route + "/v1", api_key=key, timeout=600, max_retries=0)
                   for app, route in APPS.items()}
        model = clients["dflash"].models.list().data[0].id
        logging.getLogger("specdec.prompts").setLevel(logging.ERROR)  # the packaged file's truncation note
        prompts = [p.messages for p in load_prompts("sharegpt", split="holdout", limit=c.chat_requests,
                                                    max_prompt_chars=1500, min_prompt_chars=20)]
        start = {app: app_metrics(self.url + route) for app, route in APPS.items()}
        warm = {}
        for app, cl in clients.items():  # warm-up: first-request costs stay out of the numbers
            r = cl.chat.completions.create(model=model, messages=prompts[0], max_tokens=4, temperature=0)
            warm[app] = r.usage.completion_tokens
        before = {app: settled_metrics(self.url + route, start[app]["tokens"] + warm[app])
                  for app, route in APPS.items()}
        rows, last = [], time.monotonic()
        for i, messages in enumerate(prompts):
            row = {"messages": messages}
            for app in (("dflash", "ar") if i % 2 == 0 else ("ar", "dflash")):
                t = time.perf_counter()
                r = clients[app].chat.completions.create(model=model, messages=messages, max_tokens=c.chat_tokens,
                                                         temperature=0)
                row[app] = {"seconds": time.perf_counter() - t, "tokens": r.usage.completion_tokens,
                            "text": r.choices[0].message.content}
            row["identical"] = row["dflash"]["text"] == row["ar"]["text"]
            rows.append(row)
            if time.monotonic() - last >= HEARTBEAT_S or i + 1 == len(prompts):
                sp = sum(x["dflash"]["tokens"] for x in rows) / sum(x["dflash"]["seconds"] for x in rows)
                ar = sum(x["ar"]["tokens"] for x in rows) / sum(x["ar"]["seconds"] for x in rows)
                say(f"  chat: {i + 1}/{len(prompts)} requests · speculative {sp:.1f} tok/s, AR {ar:.1f} tok/s")
                last = time.monotonic()
        after = {app: settled_metrics(self.url + route, before[app]["tokens"] + sum(r[app]["tokens"] for r in rows))
                 for app, route in APPS.items()}
        self.times["chat"] = round(time.monotonic() - t0, 1)
        return {"model": model, "rows": rows, "metrics": {k: metrics_delta(before[k], after[k]) for k in clients}}

    # ------------------------------------------------------------------------- summary
    def summary(self, chat: dict) -> dict:
        rows = chat["rows"]
        apps = {}
        for app in ("dflash", "ar"):
            secs = sum(r[app]["seconds"] for r in rows)
            toks = sum(r[app]["tokens"] for r in rows)
            m = chat["metrics"][app]
            parts = {k: m[k] for k in ("prefill_s", "draft_s", "verify_s")}
            parts["overhead_s"] = max(0.0, secs - sum(parts.values()))
            apps[app] = {"tokens": toks, "seconds": round(secs, 3), "tokens_per_s": toks / secs if secs else 0.0,
                         "tau": m["tau"], "cycles": m["cycles"], "drafter": m["drafter"],
                         "ms_per_token": {k.removesuffix("_s"): 1000 * v / max(toks, 1) for k, v in parts.items()},
                         "draft_tokens": m["draft_tokens"], "accepted_draft_tokens": m["accepted_draft_tokens"]}
        spec, ar = apps["dflash"], apps["ar"]
        out = {
            "target": self.cfg.target or "smollm2 (embedded SmolLM2-135M-Instruct)",
            "model": self.model,
            "stack": self.state.get("stack"),
            "features": self.state.get("features"),
            "reference": _brief(self.state.get("reference")),
            "training": self.state.get("training"),
            "promotion": _brief(self.state.get("promotion")),
            "serving": {"url": self.url, "ar_url": self.url + "/ar", "config": self.state["serving"].get("config"),
                        "served_model": chat["model"], "drafter": spec["drafter"]},
            "chat": {"requests": len(rows), "max_tokens": self.cfg.chat_tokens,
                     "identical_to_ar": all(r["identical"] for r in rows),
                     "outputs": [{"messages": r["messages"], "text": r["dflash"]["text"], "ar_text": r["ar"]["text"],
                                  "identical": r["identical"]} for r in rows]},
            "results": {"speculative": spec, "ar": ar,
                        "speedup": spec["tokens_per_s"] / ar["tokens_per_s"] if ar["tokens_per_s"] else None},
            "stage_seconds": self.times,
            "logs": str(self.logs),
        }
        (self.out / "summary.json").write_text(json.dumps(out, indent=1, default=str))
        plot_summary(out, self.out / "summary.png")
        return out

    def print_summary(self, s: dict) -> None:
        r, sp, ar = s["results"], s["results"]["speculative"], s["results"]["ar"]
        say(f"\n=== summary ({self._rel(self.out / 'summary.json')}, {self._rel(self.out / 'summary.png')})")
        if s["features"]:
            say(f"features   {s['features']['samples']} samples, {s['features']['tokens']} tokens "
                f"({self._rel(Path(s['features']['uri']))})")
        t = s["training"]
        say(f"training   models:/{t['model']}/{t['version']}: held-out tau {t['holdout_tau']} "
            f"(run {t['lineage'].get('run_name', '?')}, features {self._rel(Path(t['lineage'].get('features_uri', '?')))})")
        for k in ("reference", "promotion"):
            if s[k]:
                champ = f"v{s[k]['champion']}" if s[k]["champion"] else "unset"
                say(f"{k:<10} v{s[k]['version']}: {s[k]['decision']} -> @champion {champ}")
        d = sp["drafter"] or {}
        drafter = (d.get("source") or "none (speculation off)") + (f" v{d['version']}" if d.get("version") else "")
        if d.get("version") == "reference":  # no @champion: drafter=auto serves the packaged reference
            drafter = "the packaged reference drafter (no @champion yet)"
        say(f"serving    {s['serving']['url']} drafter {drafter}; AR at {s['serving']['ar_url']}")
        say(f"chat       {s['chat']['requests']} requests x {s['chat']['max_tokens']} tokens, greedy: outputs "
            f"{'identical to the target alone' if s['chat']['identical_to_ar'] else 'DIFFER from the target alone'}")
        say(f"speed      speculative {sp['tokens_per_s']:.1f} tok/s vs AR {ar['tokens_per_s']:.1f} tok/s -> "
            f"{r['speedup']:.2f}x" + (f", tau {sp['tau']:.2f}" if sp["tau"] else ""))
        for name, a in (("speculative", sp), ("AR", ar)):
            ms = a["ms_per_token"]
            say(f"  ms/token {name:<12} prefill {ms['prefill']:.1f} · draft {ms['draft']:.1f} · verify "
                f"{ms['verify']:.1f} · overhead {ms['overhead']:.1f}")
        say(f"\nThe apps keep running: {s['serving']['url']}/v1/chat/completions (AR: {s['serving']['ar_url']}); "
            f"metrics at {s['serving']['url']}/metrics")
        say(f"  curl -s {s['serving']['url']}/v1/chat/completions -H 'content-type: application/json' \\\n"
            f"       -d '{{\"model\": \"{s['serving']['served_model']}\", \"messages\": [{{\"role\": \"user\", "
            f"\"content\": \"Hi!\"}}]}}'")
        say(f"Ray dashboard {s['stack']['dashboard']} · MLflow {s['stack']['mlflow']} · logs {self._rel(self.logs)}/\n"
            "Stop everything: make demo-stop")

    def run(self) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        say(f"dflash-ray demo: everything under {self._rel(self.out)}/, full logs in {self._rel(self.logs)}/")
        self.stack()
        self.features()
        self.reference()
        self.training()
        self.promotion()
        self.serving()
        s = self.summary(self.chat())
        self.save()
        self.print_summary(s)
        return s


def _brief(d: dict | None) -> dict | None:
    return None if d is None else {k: v for k, v in d.items() if k != "tracking_uri"}


def run_demo(cfg: DemoConfig) -> dict:
    """Run (or resume) every stage; returns the summary."""
    return Demo(cfg).run()
