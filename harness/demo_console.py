"""What ``make demo`` prints: a line per stage and its progress read from the stage's own output
(feature shards, training steps, evaluation batches), at least every ``HEARTBEAT_S``, while
the full output goes to the stage's log file (:func:`run_logged`).
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT_S = 10.0
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class DemoError(RuntimeError):
    """A stage failed; the message names it and its log."""


def say(msg: str = "") -> None:
    print(msg, flush=True)


def elapsed(s: float) -> str:
    """Seconds as ``42s`` or ``3m05s``."""
    return f"{int(s) // 60}m{int(s) % 60:02d}s" if s >= 60 else f"{s:.0f}s"


def features_progress(line: str) -> str | None:
    """A committed shard's progress line -> 'shards 2/4 · 0.51 prompts/s · eta 40 s'."""
    m = re.search(r"(\d+)/(\d+) shards, eta (\d+) s \| (\d+) rows ([\d.]+) rows/s \| \S+ tok/s "
                  r"\(generated (\S+) tok/s\)", line)
    if m:
        done, total, eta, _, rate, gen = m.groups()
        return f"shards {done}/{total} · {float(rate):.2f} prompts/s · {gen} generated tok/s · eta {eta} s"
    m = re.search(r"(\d+) shards planned, (\d+) already committed", line)
    if m:
        return f"shards {m.group(2)}/{m.group(1)} · the target is answering the first shard's prompts"
    if "is already committed" in line:
        return "already committed: nothing to do"
    return None


class TrainProgress:
    """Training progress lines -> 'step 20/60 · 0.4 steps/s · loss 5.1 · tau 1.05'."""

    def __init__(self, total: int):
        self.total, self.first = total, None

    def __call__(self, line: str) -> str | None:
        m = re.search(r"\[train\] step (\d+) \|.*?loss ([\d.]+) \| tau ([\d.]+)", line)
        if m is None:
            if m2 := re.search(r"\[eval\] step (\d+) \|.*?holdout tau ([\d.]+)", line):
                return f"step {m2.group(1)}/{self.total} · held-out tau {float(m2.group(2)):.3f}"
            for needle, status in (("prepared run", "starting the Ray Train worker group"),
                                   ("Started training worker group", "worker group up: reading shards, first steps"),
                                   ("Ray Train finished", "exporting the drafter, registering it in MLflow")):
                if needle in line:
                    return status
            return None
        step, loss, tau = int(m.group(1)), float(m.group(2)), float(m.group(3))
        now = time.monotonic()
        self.first = self.first or (step, now)
        rate = (step - self.first[0]) / (now - self.first[1]) if now > self.first[1] else 0.0
        speed = f" · {rate:.2f} steps/s · eta {(self.total - step) / rate:.0f} s" if rate > 0 else ""
        return f"step {step}/{self.total}{speed} · loss {loss:.3f} · tau {tau:.3f}"


def evaluation_progress(line: str) -> str | None:
    """A tqdm bar ('benchmark:  50%|###  | 2/4 [00:10<00:10, 5.1s/batch]') -> 'benchmark 2/4 · 5.1s/batch · eta 00:10'."""
    m = re.search(r"(\w+):\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)\s*\[[^<\]]*<([^,\]]*),\s*([^\]]+)\]", line)
    return f"{m.group(1)} {m.group(2)}/{m.group(3)} · {m.group(5).strip()} · eta {m.group(4)}" if m else None


def interruptible() -> None:
    """``preexec_fn`` for a child we stop with Ctrl-C's signal: SIGINT back to its default. A
    shell starts a background job (``make demo &``, a CI step) with SIGINT ignored, a child
    inherits that, and Python then installs no KeyboardInterrupt: ``serve run`` would sit out
    the SIGINT that should shut its apps down until it is killed."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_logged(title: str, cmd: list[str], log: Path, env: dict, progress=None) -> tuple[int, list[str]]:
    """Run ``cmd`` with its output in ``log``; print a line at least every 10 s (the last
    progress ``progress(line)`` made of the output, else 'running'). Returns (exit code, lines)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    q: queue.Queue = queue.Queue()
    with open(log, "a") as f:
        f.write(f"\n$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1, start_new_session=True, preexec_fn=interruptible)

        def pump():
            for line in proc.stdout:
                q.put(line)
            q.put(None)

        threading.Thread(target=pump, daemon=True).start()
        t0 = last = time.monotonic()
        status = None
        try:
            while True:
                try:
                    line = q.get(timeout=1.0)
                except queue.Empty:
                    line = ""
                if line is None:
                    break
                if line:
                    f.write(line)
                    clean = _ANSI.sub("", line).rstrip("\n")
                    lines.append(clean)
                    status = (progress(clean) if progress else None) or status
                now = time.monotonic()
                if now - last >= HEARTBEAT_S:
                    say(f"  {title}: {status or 'running'} · {elapsed(now - t0)}")
                    last = now
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(30)
            raise
        return proc.wait(), lines
