"""OpenAI-compatible HTTP ingress (FastAPI under Ray Serve).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE streaming or not),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).

The ingress validates requests (bad input -> OpenAI-style error JSON with a 4xx status)
and relays them to the paired replicas through a streaming ``DeploymentHandle``; it
holds no model. If ``$DFLASH_API_KEY`` (the variable named by ``api_key_env``) is set,
every route requires ``Authorization: Bearer <key>`` (:class:`APIKeyGuard`, in front of the
whole app, FastAPI's ``/docs`` and ``/openapi.json`` included; the vllm backend's ingress
uses the same guard).
"""

# No `from __future__ import annotations` here: FastAPI must see real annotations
# (``request: Request``) on the methods Serve wraps.
import asyncio
import hmac
import logging
import os
from collections import defaultdict

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app import protocol
from serve_app.config import load_config
from serve_app.metrics import render_prometheus
from serve_app.protocol import APIError, GenerationJob, Limits

log = logging.getLogger("ray.serve")

app = FastAPI(title="DFlash speculative decoding", description="OpenAI-compatible API served by Ray Serve")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


@app.exception_handler(APIError)
async def _api_error(_request: Request, exc: APIError):
    return error_response(exc)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_request: Request, exc: StarletteHTTPException):
    return error_response(APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404
                                   else None))


@app.exception_handler(RequestValidationError)
async def _validation_error(_request: Request, exc: RequestValidationError):
    return error_response(APIError(400, f"Invalid request: {exc.errors()}"))


def check_api_key(authorization: str | None, expected: str | None) -> None:
    """Raise 401 unless ``expected`` is unset or the bearer token equals it."""
    if not expected:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise APIError(401, "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")


class APIKeyGuard:
    """ASGI middleware: with a key set, every HTTP request must carry it (401 otherwise).
    In front of the whole app, so no route, present or added later, is left open. CORS
    preflights (OPTIONS) pass: browsers send them without credentials."""

    def __init__(self, app, key: str | None):
        self.app = app
        self.key = key

    async def __call__(self, scope, receive, send) -> None:
        if self.key and scope["type"] == "http" and scope["method"] != "OPTIONS":
            try:
                check_api_key(Headers(scope=scope).get("authorization"), self.key)
            except APIError as e:
                await error_response(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def guard_app(asgi_app, key: str | None):
    """``asgi_app`` with :class:`APIKeyGuard` outermost. Called from Serve's
    ``_set_asgi_app`` hook, where a replica installs its own (not yet started) copy of the
    FastAPI app: the only place both the app and the replica's key are at hand."""
    if isinstance(asgi_app, FastAPI):
        asgi_app.add_middleware(APIKeyGuard, key=key)  # last added runs first
        return asgi_app
    return APIKeyGuard(asgi_app, key)


async def render_metrics(hub, http_counts: dict | None = None) -> Response:
    """``/metrics`` on both backends: every live replica's snapshot from the app's
    ``MetricsHub``, as Prometheus text."""
    try:
        replicas = await asyncio.wait_for(hub.collect.remote(), timeout=10)
    except Exception as e:
        log.warning("metrics hub unavailable: %s", e)
        replicas = {}
    return PlainTextResponse(render_prometheus(replicas, http_counts), media_type="text/plain; version=0.0.4")


def _upstream_error(e: BaseException) -> APIError:
    """Map a failure between ingress and replica to a clean 5xx."""
    name = type(e).__name__
    if isinstance(e, asyncio.TimeoutError):
        return APIError(503, "Timed out waiting for a model replica; please retry.", code="timeout")
    if name == "BackPressureError":
        return APIError(503, "The server is overloaded; please retry later.", code="overloaded")
    if isinstance(e, (RayActorError, RayTaskError)) or "ActorDied" in name or "Unavailable" in name:
        return APIError(503, f"The model replica failed while handling the request ({name}); please retry.",
                        code="replica_unavailable")
    return APIError(500, f"Internal error: {name}: {e}")


@serve.deployment(name="OpenAIIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, replica, hub, config: dict):
        self.replica = replica
        self.hub = hub
        self.cfg = load_config(config)
        self.limits = Limits(self.cfg.served_model_name, self.cfg.max_tokens_limit, self.cfg.default_max_tokens)
        self.api_key = os.environ.get(self.cfg.api_key_env) or None
        self.http_counts: dict[tuple[str, int], int] = defaultdict(int)

    def _set_asgi_app(self, asgi_app) -> None:
        super()._set_asgi_app(guard_app(asgi_app, self.api_key))

    # ------------------------------------------------------------------ plumbing
    def _count(self, endpoint: str, status: int) -> None:
        self.http_counts[(endpoint, status)] += 1

    async def _first_event(self, job: GenerationJob):
        """Start a generation; returns (response generator, first event)."""
        gen = self.replica.options(stream=True).generate.remote(job.to_dict())
        try:
            first = await asyncio.wait_for(gen.__anext__(), timeout=self.cfg.request_timeout_s)
        except BaseException as e:
            gen.cancel()
            if isinstance(e, asyncio.CancelledError):
                raise
            if isinstance(e, StopAsyncIteration):
                raise APIError(500, "The replica closed the stream without an answer.") from None
            raise _upstream_error(e) from None
        if first.get("type") == "error":
            raise APIError.from_event(first)
        return gen, first

    async def _handle(self, request: Request, endpoint: str, parse) -> Response:
        try:
            job = parse(protocol.parse_json(await request.body()), self.limits)
            gen, first = await self._first_event(job)
        except APIError as e:
            self._count(endpoint, e.status)
            return error_response(e)
        if job.stream:
            self._count(endpoint, 200)
            return StreamingResponse(self._sse(job, gen, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            body = await self._collect(job, gen, first)
        except APIError as e:
            self._count(endpoint, e.status)
            return error_response(e)
        self._count(endpoint, 200)
        return JSONResponse(body)

    async def _events(self, gen):
        """Replica events after ``start``; upstream failures become an ``error`` event."""
        try:
            async for ev in gen:
                yield ev
                if ev.get("type") in ("done", "error"):
                    return
            yield APIError(500, "The replica closed the stream early.").as_event()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            yield _upstream_error(e).as_event()

    async def _collect(self, job: GenerationJob, gen, first: dict) -> dict:
        parts: list[str] = []
        try:
            async for ev in self._events(gen):
                if ev["type"] == "delta":
                    parts.append(ev["text"])
                elif ev["type"] == "error":
                    raise APIError.from_event(ev)
                elif ev["type"] == "done":
                    use = protocol.usage(ev["prompt_tokens"], ev["completion_tokens"], ev.get("speculative"))
                    build = protocol.chat_response if job.kind == "chat" else protocol.completion_response
                    return build(job, self.limits.model_name, "".join(parts), ev["finish_reason"], use)
        finally:
            gen.cancel()  # no-op once finished; frees the slot if we were cancelled
        raise APIError(500, "The replica closed the stream early.")

    async def _sse(self, job: GenerationJob, gen, first: dict):
        model = self.limits.model_name
        try:
            if job.kind == "chat":
                yield protocol.sse(protocol.chunk(job, model, "", role=True))
            async for ev in self._events(gen):
                if ev["type"] == "delta":
                    yield protocol.sse(protocol.chunk(job, model, ev["text"]))
                elif ev["type"] == "error":
                    yield protocol.sse(APIError.from_event(ev).body())
                    break
                elif ev["type"] == "done":
                    use = protocol.usage(ev["prompt_tokens"], ev["completion_tokens"], ev.get("speculative"))
                    yield protocol.sse(protocol.chunk(job, model, None if job.kind == "chat" else "",
                                                      finish_reason=ev["finish_reason"]))
                    if job.include_usage:
                        yield protocol.sse(protocol.chunk(job, model, None, use=use, no_choices=True))
                    break
            yield protocol.sse("[DONE]")
        finally:
            # the client went away (Serve cancels this generator) or we are done: either
            # way cancel the replica call, which cancels the request and frees its row
            gen.cancel()

    # ------------------------------------------------------------------ routes
    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat", protocol.parse_chat)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completions", protocol.parse_completion)

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            info = await asyncio.wait_for(self.replica.info.remote(), timeout=30)
        except Exception as e:
            info = {"error": str(_upstream_error(e))}
        card = {"id": self.limits.model_name, "object": "model", "created": 0, "owned_by": "dflash-ray",
                "backend": self.cfg.backend, "max_model_len": info.get("context_length"),
                "drafter": info.get("drafter"), "drafter_error": info.get("drafter_error"),
                "speculation": str(self.cfg.speculation)}  # auto | off | a fixed block (drafter's B: drafter.block_size)
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health(self) -> Response:
        try:
            info = await asyncio.wait_for(self.replica.info.remote(), timeout=10)
        except Exception as e:
            return JSONResponse({"status": "unavailable", "error": str(_upstream_error(e))}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.limits.model_name, "drafter": info.get("drafter"),
                             "drafter_error": info.get("drafter_error")})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        return await render_metrics(self.hub, dict(self.http_counts))
