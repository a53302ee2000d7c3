"""The paired replica: one target and its drafter side by side, one engine thread.

``generate`` is an async generator called through a streaming ``DeploymentHandle``. It
tokenizes and checks the prompt, submits it to the ``EngineWorker`` (continuous
batching: every live request shares each draft/verify pass), then turns the token
stream into text deltas. If the caller goes away (client disconnect -> Serve cancels
the call) the ``finally`` clause cancels the request and frees its batch slot.

Background tasks publish metrics to the ``MetricsHub`` and, for a registry drafter,
poll the alias: when it moves, the new drafter is checked against the target and
handed to the engine between steps (live rows finish on the old one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ray import serve

from serve_app.config import load_config
from serve_app.protocol import APIError, GenerationJob

if TYPE_CHECKING:
    from serve_app.registry import DrafterChoice

log = logging.getLogger("ray.serve")


class Detokenizer:
    """Token ids -> text deltas, holding back incomplete UTF-8 and watching stop strings."""

    def __init__(self, decode, stop: list[str]):
        self.decode = decode
        self.stop = stop
        self.tokens: list[int] = []
        self.text = ""  # emitted so far

    def add(self, tokens: list[int]) -> tuple[str, bool]:
        """Returns (new text, whether a stop string matched)."""
        self.tokens += tokens
        full = self.decode(self.tokens)
        if self.stop:
            start = max(0, len(self.text) - max(len(s) for s in self.stop))
            hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                cut = min(hits)
                new = full[len(self.text):cut] if cut > len(self.text) else ""
                self.text += new
                return new, True
        if full.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            return "", False
        new = full[len(self.text):]
        self.text = full
        return new, False

    def flush(self) -> str:
        full = self.decode(self.tokens)
        new = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += new
        return new


def speculative_summary(stats: dict, block_size_max: int) -> dict:
    """The accepted-length statistics reported in ``usage.speculative``."""
    from specdec.engine import length_histogram, tau_of  # the replica has torch loaded anyway

    accepted = stats.get("accepted") or []
    cycles = len(accepted)
    drafted = int(stats.get("drafted", 0))
    return {
        "cycles": cycles,
        "mean_accepted_length": tau_of(accepted),
        "draft_tokens": drafted,
        "accepted_draft_tokens": int(sum(accepted)),
        "acceptance_rate": (sum(accepted) / drafted) if drafted else None,
        "accepted_length_histogram": length_histogram(accepted),
        "max_block_size": block_size_max,
        "max_batch_rows": int(stats.get("max_batch_rows", 0)),
        "draft_s": round(float(stats.get("draft_s", 0.0)), 6),
        "verify_s": round(float(stats.get("verify_s", 0.0)), 6),
    }


@serve.deployment(name="DFlashReplica", health_check_period_s=5, health_check_timeout_s=30,
                  graceful_shutdown_timeout_s=60, graceful_shutdown_wait_loop_s=1)
class DFlashReplica:
    async def __init__(self, config: dict, hub=None):
        import torch

        from serve_app import backends
        from serve_app.metrics import ReplicaMetrics
        from serve_app.registry import choose_drafter
        from serve_app.worker import EngineWorker

        self.cfg = load_config(config)
        torch.set_num_threads(self.cfg.replica_torch_threads)
        self.hub = hub
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # local testing mode
            self.replica_id = "local"
        self.target = await asyncio.to_thread(backends.load_target, self.cfg)
        choice = await asyncio.to_thread(choose_drafter, self.cfg)
        choice.log_to(log)
        self.source = choice.source  # a registry alias is followed even while serving the reference or none
        self.drafter_error: str | None = None
        drafter = await asyncio.to_thread(self._load_drafter, choice)
        version = choice.version if drafter is not None else ""
        self._seen_version = version
        self.metrics = ReplicaMetrics(max_block=1)  # the worker sizes it for its engine's block
        self.metrics.drafter = {"source": (self.cfg.drafter_source or "") if drafter is not None else "",
                                "version": version}
        self.worker = EngineWorker(self.target, drafter, version, mode=self.cfg.speculation,
                                   max_batch_size=self.cfg.max_batch_size,
                                   max_prefill_tokens=self.cfg.max_prefill_tokens, seed=self.cfg.seed,
                                   metrics=self.metrics, lookup_block=self.cfg.lookup_block)
        self.capture = None
        if self.cfg.capture is not None:  # traffic for adapting the drafter (serve_app/capture.py)
            from serve_app.capture import CaptureWriter

            self.capture = CaptureWriter(self.cfg.capture, f"{self.cfg.served_model_name}-{self.replica_id}")
        self._tasks = [asyncio.create_task(self._publish_metrics())]
        if self.source is not None and self.source.registry and self.cfg.registry_poll_s > 0:
            self._tasks.append(asyncio.create_task(self._watch_registry()))
        log.info("DFlashReplica %s ready: target %s, drafter %s (version %s), speculation=%s",
                 self.replica_id, self.cfg.served_model_name, self.cfg.drafter_source if drafter else None,
                 version or "-", self.cfg.speculation)

    # ------------------------------------------------------------------ drafter
    def _load_drafter(self, choice: DrafterChoice):
        """The chosen drafter (``serve_app.registry.choose_drafter``), fetched on this node
        and checked against the target, or None."""
        from serve_app.backends import load_paired_drafter

        path = choice.fetch()
        # raises DrafterMismatchError (naming the field) for a drafter of another target
        return load_paired_drafter(path, self.target, device=self.cfg.device) if path is not None else None

    async def _watch_registry(self) -> None:
        from serve_app.backends import load_paired_drafter
        from serve_app.registry import DrafterNotFound
        from specdec.checkpoint import DrafterMismatchError

        while True:
            await asyncio.sleep(self.cfg.registry_poll_s)
            try:
                resolved = await asyncio.to_thread(self.source.poll, self._seen_version)
                if resolved is None:
                    continue
                self._seen_version = resolved.version
                drafter = await asyncio.to_thread(load_paired_drafter, resolved.path, self.target,
                                                  None, self.cfg.device)
            except DrafterNotFound:
                continue
            except DrafterMismatchError as e:
                self.drafter_error = f"refused drafter {self.cfg.drafter_source} version {self._seen_version}: {e}"
                log.error(self.drafter_error)
                continue
            except Exception as e:  # registry down etc.: keep serving, try again later
                log.warning("drafter registry poll failed: %s", e)
                continue
            self.drafter_error = None
            self.worker.set_drafter(drafter, resolved.version)
            self.metrics.drafter = {"source": self.cfg.drafter_source, "version": resolved.version}
            log.info("swapping to drafter %s version %s", self.cfg.drafter_source, resolved.version)

    # ------------------------------------------------------------------ requests
    async def _prompt_ids(self, job: GenerationJob) -> list[int]:
        try:
            if job.kind == "chat":
                ids = await asyncio.to_thread(self.target.encode_chat, job.messages)
            elif isinstance(job.prompt, str):
                ids = await asyncio.to_thread(self.target.encode, job.prompt)
            else:
                ids = [int(t) for t in job.prompt]
                if any(t >= self.target.vocab_size for t in ids):
                    raise APIError(400, f"Invalid 'prompt': token ids must be < {self.target.vocab_size}.",
                                   param="prompt", code="invalid_value")
        except APIError:
            raise
        except Exception as e:
            raise APIError(400, f"Could not render the prompt: {e}", param="messages" if job.kind == "chat"
                           else "prompt", code="invalid_value") from None
        if not ids:
            raise APIError(400, "The prompt is empty after tokenization.", param="prompt", code="invalid_value")
        limit = self.target.max_positions
        if len(ids) >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your "
                                f"{'messages' if job.kind == 'chat' else 'prompt'} resulted in {len(ids)} tokens.",
                           param="messages" if job.kind == "chat" else "prompt", code="context_length_exceeded")
        return ids

    async def generate(self, job: dict):
        """Events: ``start`` (or ``error``), then ``delta`` with text, then ``done``."""
        from specdec.engine import Request
        from specdec.sampling import SamplingParams

        job = GenerationJob(**job)
        try:
            prompt = await self._prompt_ids(job)
            params = SamplingParams(temperature=job.temperature, top_p=job.top_p, top_k=job.top_k)
            stream = self.worker.submit(Request(prompt=prompt, max_new_tokens=job.max_tokens, params=params,
                                                id=job.id))
        except APIError as e:
            yield e.as_event()
            return
        except (ValueError, RuntimeError) as e:
            yield APIError(503 if isinstance(e, RuntimeError) else 400, str(e)).as_event()
            return
        yield {"type": "start", "prompt_tokens": len(prompt), "replica": self.replica_id}
        detok = Detokenizer(self.target.decode, job.stop)
        closed = False
        stopped = False
        try:
            while True:
                items = [await stream.get()]
                while (more := stream.get_nowait()) is not None:
                    items.append(more)
                tokens = [t for it in items if it[0] == "tokens" for t in it[1]]
                final = next((it for it in items if it[0] != "tokens"), None)
                if tokens and not stopped:
                    text, hit = detok.add(tokens)
                    if text:
                        yield {"type": "delta", "text": text}
                    if hit:  # a stop string: free the row now, report once the engine confirms
                        stopped = True
                        self.worker.cancel(stream, reason="stop")
                if final is None:
                    continue
                closed = True
                if final[0] == "error":
                    yield APIError(500, f"generation failed: {final[1]}").as_event()
                    return
                if not stopped:
                    tail = detok.flush()
                    if tail:
                        yield {"type": "delta", "text": tail}
                reason = "stop" if stopped else ("length" if final[1] == "length" else "stop")
                if self.capture is not None and job.store is not False:
                    self.capture.offer(self._capture_record(job, prompt, detok.tokens, reason, final[2]))
                yield {"type": "done", "finish_reason": reason, "prompt_tokens": len(prompt),
                       "completion_tokens": len(detok.tokens),
                       "speculative": speculative_summary(final[2], self.worker.max_block)}
                return
        finally:
            if not closed:
                self.worker.cancel(stream)

    def _capture_record(self, job: GenerationJob, prompt: list[int], answer: list[int], reason: str,
                        stats: dict) -> dict:
        """What traffic capture keeps of a finished request (serve_app/capture.py's schema)."""
        return {"request_id": job.id, "time": time.time(), "model": self.cfg.served_model_name,
                "drafter_source": self.metrics.drafter.get("source", ""),
                "drafter_version": self.worker.drafter_version or "", "prompt_ids": list(prompt),
                "answer_ids": list(answer), "temperature": job.temperature, "top_p": job.top_p, "top_k": job.top_k,
                "max_tokens": job.max_tokens, "finish_reason": reason, "accepted": list(stats.get("accepted") or [])}

    # ------------------------------------------------------------------ control
    async def info(self) -> dict:
        waiting, live = self.worker.load()
        return {"replica": self.replica_id, "model": self.cfg.served_model_name,
                "drafter": {"source": self.cfg.drafter_source if self.worker.drafter is not None else None,
                            "version": self.worker.drafter_version or None,
                            # the drafter's trained B; the engine verifies up to engine_width = max(B, lookup_block)
                            "block_size": self.worker.drafter.config.block_size if self.worker.drafter is not None
                            else None, "engine_width": self.worker.max_block,
                            "generations": self.worker.generations},
                "drafter_error": self.drafter_error, "speculation": self.cfg.speculation,
                "queue_depth": waiting, "active_requests": live,
                "context_length": self.target.max_positions, "backend": "hf"}

    async def record_autoscaling_stats(self) -> dict:
        waiting, live = self.worker.load()
        return {"ongoing": float(waiting + live), "tau": float(self.metrics.tau()),
                "tokens_per_s": float(self.metrics.tokens_per_s())}

    async def check_health(self) -> None:
        if not self.worker.alive:
            raise RuntimeError(f"engine thread is not running: {self.worker.error!r}")

    async def _publish_metrics(self) -> None:
        from serve_app.metrics import capture_metrics

        while True:
            if self.hub is not None:
                try:
                    snap = self.metrics.snapshot()
                    if self.capture is not None:
                        snap.update(capture_metrics(self.capture.stats()))
                    await self.hub.report.remote(self.replica_id, snap)
                except Exception as e:  # the hub restarting: next round
                    log.debug("metrics push failed: %s", e)
            await asyncio.sleep(self.cfg.metrics_push_s)

    def __del__(self):
        for t in getattr(self, "_tasks", []):
            t.cancel()
        if getattr(self, "capture", None) is not None:
            self.capture.close(timeout=10.0)  # what is buffered is written
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.stop(timeout=5.0)
        if getattr(self, "hub", None) is not None:
            try:
                self.hub.forget.remote(self.replica_id)
            except Exception:
                pass
