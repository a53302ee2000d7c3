"""Replica metrics: collected by the engine thread (``ReplicaMetrics``), published every
``metrics_push_s`` to the ``MetricsHub`` deployment, rendered by the ingress at
``/metrics`` in the Prometheus text format (one ``replica`` label per replica).

Metric names (all prefixed ``dflash_``):

=============================  =========  ===============================================
accepted_length                histogram  tokens committed per request per speculative cycle
                                          (A + 1; its mean is tau)
tau                            gauge      recent mean tokens per cycle, all cycles (1 = AR)
draft_seconds                  histogram  drafter pass per engine cycle
verify_seconds                 histogram  target verify pass (+ bookkeeping) per engine cycle
prefill_seconds_total          counter    time spent prefilling new requests
generated_tokens_total         counter    tokens sent to clients
tokens_per_second              gauge      recent output rate
queue_depth                    gauge      requests waiting for a batch slot
active_requests                gauge      rows in the engine's batch
block_size                     gauge      block size of the last cycle (1 = speculation off)
expected_speedup               gauge      controller's predicted speedup over AR
engine_cycles_total            counter    draft/verify cycles
requests_total{finish_reason}  counter    finished requests (stop, length, cancelled, error)
draft_tokens_total{source}     counter    tokens drafted, by source (dflash, lookup)
accepted_draft_tokens_total    counter    drafted tokens the target accepted, by source
  {source}                                (their ratio: each source's acceptance rate)
process_cpu_seconds_total      counter    CPU time of the replica process (compare modes on a
                                          shared machine: CPU seconds per generated token)
drafter_info{source,version}   gauge      1 for the drafter in use
accepted_tokens_per_position_  counter    drafted tokens accepted at each draft position
  total{position}                         (vllm backend only, from vLLM's counter)
capture_records_total{outcome} counter    traffic capture (serve_app/capture.py): records
                                          captured, dropped (buffer full, store failing),
                                          sampled_out (past capture.rate)
capture_bytes_total            counter    bytes of capture files written
capture_errors_total           counter    capture batches the store refused
http_requests_total            counter    ingress requests by endpoint and status
=============================  =========  ===============================================
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque

from ray import serve

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        for i, le in enumerate(self.buckets):
            if value <= le:
                self.counts[i] += n
                break
        self.sum += value * n
        self.count += n

    def snapshot(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum, "count": self.count}


class ReplicaMetrics:
    """Written by the engine thread, read by the replica's event loop (under a lock)."""

    def __init__(self, max_block: int = 16, window_s: float = 10.0):
        self._lock = threading.Lock()
        self.window_s = window_s
        self.accepted_length = Histogram(tuple(float(i) for i in range(1, max(max_block, 2) + 1)))
        self.draft_seconds = Histogram(SECONDS_BUCKETS)
        self.verify_seconds = Histogram(SECONDS_BUCKETS)
        self.prefill_seconds_total = 0.0
        self.generated_tokens_total = 0
        self.engine_cycles_total = 0
        self.requests_total: dict[str, int] = defaultdict(int)
        self.draft_tokens_total: dict[str, int] = defaultdict(int)  # by source
        self.accepted_draft_tokens_total: dict[str, int] = defaultdict(int)
        self.queue_depth = 0
        self.active_requests = 0
        self.block_size = 1
        self.expected_speedup = 1.0
        self.drafter: dict = {"source": "", "version": ""}
        self._tokens: deque[tuple[float, int]] = deque()  # (time, tokens emitted)
        self._cycles: deque[tuple[float, int, int]] = deque()  # (time, rows, tokens committed)

    def set_max_block(self, max_block: int) -> None:
        with self._lock:
            if max_block > len(self.accepted_length.buckets):
                old = self.accepted_length
                self.accepted_length = Histogram(tuple(float(i) for i in range(1, max_block + 1)))
                for i, c in enumerate(old.counts):
                    self.accepted_length.counts[i] += c
                self.accepted_length.sum, self.accepted_length.count = old.sum, old.count

    # -- engine thread
    def cycle(self, rows: int, k: int, accepted: list[int], draft_s: float, verify_s: float,
              expected_speedup: float, drafted: list[tuple[str, int]] | None = None) -> None:
        """One engine step; ``drafted``: per row (source, tokens drafted), default all
        rows drafted k - 1 tokens with the drafter."""
        now = time.monotonic()
        if drafted is None:
            drafted = [("dflash", k - 1)] * len(accepted) if k > 1 else []
        with self._lock:
            for (src, n), a in zip(drafted, accepted):
                if src != "none" and n > 0:
                    self.draft_tokens_total[src] += n
                    self.accepted_draft_tokens_total[src] += min(a, n)
            self.engine_cycles_total += 1
            self.block_size = k
            self.expected_speedup = expected_speedup
            if k > 1:
                self.draft_seconds.observe(draft_s)
                for a in accepted:
                    self.accepted_length.observe(float(a + 1))
            self.verify_seconds.observe(verify_s)
            self._cycles.append((now, rows, sum(a + 1 for a in accepted)))
            self._trim(now)

    def emitted(self, n: int) -> None:
        if n:
            with self._lock:
                self.generated_tokens_total += n
                self._tokens.append((time.monotonic(), n))

    def finished(self, reason: str) -> None:
        with self._lock:
            self.requests_total[reason] += 1

    def prefill(self, seconds: float) -> None:
        with self._lock:
            self.prefill_seconds_total += seconds

    def load(self, queued: int, active: int) -> None:
        self.queue_depth, self.active_requests = queued, active

    def _trim(self, now: float) -> None:
        for dq in (self._tokens, self._cycles):
            while dq and now - dq[0][0] > self.window_s:
                dq.popleft()

    # -- readers
    def tokens_per_s(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            if not self._tokens:
                return 0.0
            span = max(now - self._tokens[0][0], 1.0)
            return sum(n for _, n in self._tokens) / span

    def tau(self) -> float:
        """Mean tokens committed per request per cycle over the window (1.0 when idle)."""
        with self._lock:
            self._trim(time.monotonic())
            rows = sum(r for _, r, _ in self._cycles)
            return (sum(t for _, _, t in self._cycles) / rows) if rows else 1.0

    def snapshot(self) -> dict:
        tps, tau = self.tokens_per_s(), self.tau()
        with self._lock:
            return {
                "accepted_length": self.accepted_length.snapshot(),
                "draft_seconds": self.draft_seconds.snapshot(),
                "verify_seconds": self.verify_seconds.snapshot(),
                "prefill_seconds_total": self.prefill_seconds_total,
                "generated_tokens_total": self.generated_tokens_total,
                "engine_cycles_total": self.engine_cycles_total,
                "requests_total": dict(self.requests_total),
                "draft_tokens_total": dict(self.draft_tokens_total),
                "accepted_draft_tokens_total": dict(self.accepted_draft_tokens_total),
                "queue_depth": self.queue_depth,
                "active_requests": self.active_requests,
                "block_size": self.block_size,
                "expected_speedup": self.expected_speedup,
                "tokens_per_second": tps,
                "tau": tau,
                "drafter": dict(self.drafter),
                "process_cpu_seconds_total": time.process_time(),
            }


# ---------------------------------------------------------------------- hub
@serve.deployment(name="MetricsHub", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=1000, logging_config={"enable_access_log": False})
class MetricsHub:
    """Holds the latest snapshot of every live replica; entries expire if not refreshed
    (a crashed or removed replica disappears from /metrics)."""

    def __init__(self, ttl_s: float = 15.0):
        self.ttl_s = ttl_s
        self._snapshots: dict[str, tuple[float, dict]] = {}

    def report(self, replica_id: str, snapshot: dict) -> None:
        self._snapshots[replica_id] = (time.monotonic(), snapshot)

    def forget(self, replica_id: str) -> None:
        self._snapshots.pop(replica_id, None)

    def collect(self) -> dict[str, dict]:
        now = time.monotonic()
        self._snapshots = {k: v for k, v in self._snapshots.items() if now - v[0] <= self.ttl_s}
        return {k: v[1] for k, v in self._snapshots.items()}


# ---------------------------------------------------------------------- rendering
_HELP = {
    "accepted_length": ("histogram", "Tokens committed per request per speculative cycle (A+1); mean = tau"),
    "draft_seconds": ("histogram", "Drafter pass seconds per engine cycle"),
    "verify_seconds": ("histogram", "Target verify pass seconds per engine cycle"),
    "prefill_seconds_total": ("counter", "Seconds spent prefilling new requests"),
    "generated_tokens_total": ("counter", "Tokens sent to clients"),
    "engine_cycles_total": ("counter", "Draft/verify cycles run"),
    "requests_total": ("counter", "Finished requests by finish reason"),
    "draft_tokens_total": ("counter", "Tokens drafted, by source (dflash, lookup)"),
    "accepted_draft_tokens_total": ("counter", "Drafted tokens the target accepted, by source"),
    "queue_depth": ("gauge", "Requests waiting for a batch slot"),
    "active_requests": ("gauge", "Rows in the engine batch"),
    "block_size": ("gauge", "Block size of the last cycle (1 = speculation off)"),
    "expected_speedup": ("gauge", "Controller's predicted speedup over AR decoding"),
    "tokens_per_second": ("gauge", "Recent output tokens per second"),
    "tau": ("gauge", "Recent mean tokens committed per request per cycle"),
    "drafter_info": ("gauge", "Drafter in use (value 1)"),
    "accepted_tokens_per_position_total": ("counter", "Drafted tokens accepted at each draft position "
                                           "(vllm backend: vLLM's per-position counter)"),
    "process_cpu_seconds_total": ("counter", "CPU seconds used by the replica process"),
    "capture_records_total": ("counter", "Traffic capture: records captured, dropped or sampled out"),
    "capture_bytes_total": ("counter", "Traffic capture: bytes of capture files written"),
    "capture_errors_total": ("counter", "Traffic capture: batches the store refused (their records dropped)"),
}


def capture_metrics(stats: dict[str, int]) -> dict:
    """A capture writer's counts (``CaptureWriter.stats``) as snapshot entries."""
    return {"capture_records_total": {k: stats[k] for k in ("captured", "dropped", "sampled_out")},
            "capture_bytes_total": stats["bytes"], "capture_errors_total": stats["errors"]}


def _labels(**kv) -> str:
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in kv.items())
    return "{" + inner + "}"


def _fmt(v: float) -> str:
    f = float(v)
    return str(int(f)) if f.is_integer() and abs(f) < 1e15 else repr(f)


def render_prometheus(replicas: dict[str, dict], http_counts: dict[tuple[str, int], int] | None = None,
                      prefix: str = "dflash_") -> str:
    """Prometheus text exposition of every replica snapshot plus the ingress counters."""
    lines: list[str] = []
    lines += [f"# HELP {prefix}replicas Replicas currently reporting", f"# TYPE {prefix}replicas gauge",
              f"{prefix}replicas {len(replicas)}"]
    for name, (kind, help_) in _HELP.items():
        full = prefix + name
        lines += [f"# HELP {full} {help_}", f"# TYPE {full} {kind}"]
        for rid, snap in sorted(replicas.items()):
            if name not in snap and name != "drafter_info":
                continue  # a figure this replica's backend does not measure (vllm: cycle timings)
            if name == "drafter_info":
                d = snap.get("drafter") or {}
                labels = _labels(replica=rid, source=d.get("source", ""), version=d.get("version", ""))
                lines.append(f"{full}{labels} 1")
            elif kind == "histogram":
                h = snap[name]
                cum = 0
                for le, c in zip(h["buckets"], h["counts"]):
                    cum += c
                    lines.append(f"{full}_bucket{_labels(replica=rid, le=_fmt(le))} {cum}")
                lines.append(f"{full}_bucket{_labels(replica=rid, le='+Inf')} {h['count']}")
                lines.append(f"{full}_sum{_labels(replica=rid)} {_fmt(h['sum'])}")
                lines.append(f"{full}_count{_labels(replica=rid)} {h['count']}")
            elif name == "requests_total":
                for reason, n in sorted(snap[name].items()):
                    lines.append(f"{full}{_labels(replica=rid, finish_reason=reason)} {n}")
            elif name == "capture_records_total":
                for outcome, n in sorted(snap[name].items()):
                    lines.append(f"{full}{_labels(replica=rid, outcome=outcome)} {n}")
            elif name in ("draft_tokens_total", "accepted_draft_tokens_total"):
                for src, n in sorted(snap.get(name, {}).items()):
                    lines.append(f"{full}{_labels(replica=rid, source=src)} {n}")
            elif name == "accepted_tokens_per_position_total":
                for pos, n in enumerate(snap[name]):
                    lines.append(f"{full}{_labels(replica=rid, position=pos)} {_fmt(n)}")
            else:
                lines.append(f"{full}{_labels(replica=rid)} {_fmt(snap.get(name, 0))}")
    if http_counts is not None:
        full = prefix + "http_requests_total"
        lines += [f"# HELP {full} Ingress requests by endpoint and status", f"# TYPE {full} counter"]
        for (endpoint, status), n in sorted(http_counts.items()):
            lines.append(f"{full}{_labels(endpoint=endpoint, status=status)} {n}")
    return "\n".join(lines) + "\n"


def scrape_totals(text: str, prefix: str = "dflash_") -> dict:
    """Parse ``/metrics`` text back into totals over the replicas: every sample by its name
    without ``prefix`` (``draft_seconds_sum``, ``generated_tokens_total``, ...), the
    by-source counters and ``capture_records_total`` (by outcome) as ``{label: value}`` dicts,
    and ``drafter_info`` as the labels of the drafter in use (None without one; empty labels
    only where no replica has one)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {"draft_tokens_total": {}, "accepted_draft_tokens_total": {}, "drafter_info": None,
                 "capture_records_total": {}}
    for family in text_string_to_metric_families(text):
        for smp in family.samples:
            name = smp.name.removeprefix(prefix)
            if name == "drafter_info":  # a replica without a drafter (a plain pool's) names none
                if out[name] is None or smp.labels.get("source"):
                    out[name] = {"source": smp.labels.get("source"), "version": smp.labels.get("version")}
            elif name in ("draft_tokens_total", "accepted_draft_tokens_total"):
                src = smp.labels["source"]
                out[name][src] = out[name].get(src, 0.0) + smp.value
            elif name == "capture_records_total":
                outcome = smp.labels["outcome"]
                out[name][outcome] = out[name].get(outcome, 0.0) + smp.value
            elif "le" not in smp.labels:
                out[name] = out.get(name, 0.0) + smp.value
    return out
