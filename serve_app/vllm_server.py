"""The vllm backend's engine replica: Ray Serve LLM's ``LLMServer`` (``LLMConfig.server_cls``)
that also publishes what the hf backend's replicas publish, read in-process from vLLM's own
counters, so one autoscaling policy and one ``/metrics`` serve both backends.

vLLM's stat logger writes into this process's ``prometheus_client`` registry when
``log_engine_metrics`` is off and ``disable_log_stats`` is False (``vllm_app.vllm_llm_config``
sets both): ``vllm.v1.metrics.reader.get_metrics_snapshot()`` reads it back. From the
spec-decode counters (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``), the output counter
(``vllm:generation_tokens``) and the scheduler gauges (``vllm:num_requests_running`` /
``..._waiting``) :class:`VLLMReplicaStats` derives the hf names: tau, the accepted-length
histogram, tokens per second, ongoing requests, drafted and accepted tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from serve_app.autoscaling import METRIC_ONGOING, METRIC_TAU, METRIC_TPS
from serve_app.metrics import Histogram

log = logging.getLogger(__name__)

SPEC = "vllm:spec_decode_"


def read_counters(metrics) -> dict:
    """Totals over engines/labels of the vLLM metrics we use (``metrics``: the list
    ``get_metrics_snapshot()`` returns)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [], "generated": 0,
           "running": 0.0, "waiting": 0.0, "finished": {}}
    scalar = {SPEC + "num_drafts": "drafts", SPEC + "num_draft_tokens": "draft_tokens",
              SPEC + "num_accepted_tokens": "accepted", "vllm:generation_tokens": "generated",
              "vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting"}
    for m in metrics:
        if m.name in scalar:
            out[scalar[m.name]] += m.value
        elif m.name == SPEC + "num_accepted_tokens_per_pos":
            have, new = out["per_pos"], list(m.values)
            out["per_pos"] = [(have[i] if i < len(have) else 0) + (new[i] if i < len(new) else 0)
                              for i in range(max(len(have), len(new)))]
        elif m.name == "vllm:request_success":
            reason = m.labels.get("finished_reason", "")
            out["finished"][reason] = out["finished"].get(reason, 0) + int(m.value)
    return out


class VLLMReplicaStats:
    """Turns successive counter readings into the hf backend's snapshot and autoscaling
    stats (tau and tokens/s over the last ``window_s``)."""

    def __init__(self, block_size: int, drafter: dict, window_s: float = 10.0):
        self.block_size = block_size  # B verified per cycle; 1 = no drafter
        self.drafter = drafter
        self.window_s = window_s
        self.accepted_length = Histogram(tuple(float(i) for i in range(1, max(block_size, 2) + 1)))
        self.last = read_counters([])
        self._window: deque[tuple[float, dict]] = deque()

    def update(self, now: dict, at: float | None = None) -> None:
        """Take a new reading (cumulative counters)."""
        from specdec.vllm_engine import accepted_lengths

        for a in accepted_lengths(self.last, now) if now["drafts"] > self.last["drafts"] else []:
            self.accepted_length.observe(float(a + 1))
        self.last = now
        t = time.monotonic() if at is None else at
        self._window.append((t, now))
        while len(self._window) > 2 and t - self._window[1][0] >= self.window_s:
            self._window.popleft()

    def _delta(self, key: str) -> tuple[float, float]:
        (t0, first), (t1, last) = self._window[0], self._window[-1]
        return last[key] - first[key], t1 - t0

    def tau(self) -> float:
        """Mean tokens committed per request per cycle over the window (1.0 without drafts)."""
        if len(self._window) < 2:
            return 1.0
        drafts, _ = self._delta("drafts")
        accepted, _ = self._delta("accepted")
        return 1.0 + accepted / drafts if drafts > 0 else 1.0

    def tokens_per_s(self) -> float:
        if len(self._window) < 2:
            return 0.0
        tokens, span = self._delta("generated")
        return tokens / max(span, 1.0)

    def autoscaling(self) -> dict:
        """What :class:`serve_app.autoscaling.AcceptanceAwarePolicy` reads from a replica."""
        return {METRIC_ONGOING: self.last["running"] + self.last["waiting"], METRIC_TAU: self.tau(),
                METRIC_TPS: self.tokens_per_s()}

    def snapshot(self) -> dict:
        """The hf replica's snapshot keys this backend can fill (``render_prometheus`` skips
        the others: draft/verify/prefill seconds, the controller's figures, CPU time)."""
        c = self.last
        return {"accepted_length": self.accepted_length.snapshot(), "generated_tokens_total": c["generated"],
                "requests_total": dict(c["finished"]), "draft_tokens_total": {"dflash": c["draft_tokens"]},
                "accepted_draft_tokens_total": {"dflash": c["accepted"]},
                "accepted_tokens_per_position_total": list(c["per_pos"]),
                "queue_depth": c["waiting"], "active_requests": c["running"],
                "block_size": self.block_size, "tokens_per_second": self.tokens_per_s(), "tau": self.tau(),
                "drafter": dict(self.drafter)}


def dflash_llm_server_class():
    """The server class (built lazily: its base class needs ``ray[llm]``)."""
    from ray import serve
    from ray.serve.llm.deployment import LLMServer

    from serve_app.vllm_capture import CapturingServer

    class DFlashLLMServer(CapturingServer, LLMServer):
        """``LLMServer`` + our stats: ``record_autoscaling_stats`` for the policy, and a
        snapshot pushed to the app's ``MetricsHub`` every ``metrics_push_s`` for ``/metrics``;
        traffic capture when the app sets it (serve_app/vllm_capture.py)."""

        async def __init__(self, llm_config, **kwargs):
            await super().__init__(llm_config, **kwargs)
            extra = llm_config.experimental_configs.get("dflash", {})
            spec = llm_config.engine_kwargs.get("speculative_config") or {}
            block = int(spec.get("num_speculative_tokens", 0)) + 1
            self._stats = VLLMReplicaStats(block, extra.get("drafter", {}))
            ctx = serve.get_replica_context()
            self._replica_id = ctx.replica_id.unique_id
            self._hub = serve.get_deployment_handle("MetricsHub", ctx.app_name)
            self._push_s = float(extra.get("metrics_push_s", 1.0))
            self._start_capture(extra.get("capture"), extra.get("served_model") or llm_config.model_id,
                                self._replica_id, extra.get("drafter", {}))
            self._pusher = asyncio.get_running_loop().create_task(self._push_loop())

        def _read(self) -> None:
            from vllm.v1.metrics.reader import get_metrics_snapshot

            self._stats.update(read_counters(get_metrics_snapshot()))

        async def _push_loop(self) -> None:
            while True:
                try:
                    self._read()
                    await self._hub.report.remote(self._replica_id, {**self._stats.snapshot(), **self._capture_counts()})
                except Exception as e:  # metrics must never take the replica down
                    log.warning("metrics push failed: %s", e)
                await asyncio.sleep(self._push_s)

        async def record_autoscaling_stats(self) -> dict:
            self._read()
            return self._stats.autoscaling()

        def __del__(self):
            # Serve calls this when it stops the replica (scale-down, redeploy): its snapshot
            # leaves /metrics now rather than when the hub's entry expires
            pusher = getattr(self, "_pusher", None)
            if pusher is not None:
                pusher.cancel()
            self._stop_capture()
            if getattr(self, "_hub", None) is not None:
                try:
                    self._hub.forget.remote(self._replica_id)
                except Exception:  # the app going down with its hub
                    pass

    return DFlashLLMServer


def __getattr__(name: str):
    # "serve_app.vllm_server:DFlashLLMServer" (LLMConfig.server_cls) resolves here
    if name == "DFlashLLMServer":
        globals()[name] = cls = dflash_llm_server_class()
        return cls
    raise AttributeError(f"module 'serve_app.vllm_server' has no attribute {name!r}")
