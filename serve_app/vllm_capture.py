"""Traffic capture on the vllm backend: what an engine replica's responses say about a request,
as the hf backend's capture record (serve_app/capture.py's schema).

vLLM returns the prompt's token ids (after the chat template) and the answer's when a request
sets ``return_token_ids``; the replica sets it on every request it captures and
:class:`TokenTrail` reads the ids from the responses as they pass (a whole response, or the SSE
chunks of a stream: the prompt's ids in the first, each chunk's new answer ids), removing them
again when the client did not ask for them, so a captured client sees the response it would see
without capture. vLLM reports drafts and acceptances per engine, not per request: the record's
``accepted`` is empty on this backend (the replica's tau is on /metrics).
"""

from __future__ import annotations

import json
import time

class CapturingServer:
    """Capture for the engine replica (mixed in before Ray Serve LLM's ``LLMServer``): its
    ``chat`` and ``completions`` streams, read on their way out when a request is captured."""

    _capture = None

    def _start_capture(self, settings: dict | None, model: str, replica_id: str, drafter: dict) -> None:
        """Start the writer when the app captures (``settings``: ``ServeConfig.capture`` as a
        dict; ``drafter``: this engine's, fixed for its life: a hot swap starts a new replica)."""
        self._capture_model, self._capture_drafter = model, drafter
        if settings:
            from serve_app.capture import CaptureWriter
            from serve_app.config import CaptureSettings

            self._capture = CaptureWriter(CaptureSettings(**settings), f"{model}-{replica_id}")

    def _capture_counts(self) -> dict:
        """The writer's counts as /metrics snapshot entries (none when capture is off)."""
        from serve_app.metrics import capture_metrics

        return {} if self._capture is None else capture_metrics(self._capture.stats())

    def _stop_capture(self) -> None:
        if self._capture is not None:
            self._capture.close(timeout=10.0)  # what is buffered is written

    async def chat(self, request, raw_request_info=None):
        return await self._captured("chat", request, raw_request_info)

    async def completions(self, request, raw_request_info=None):
        return await self._captured("completions", request, raw_request_info)

    async def _captured(self, method: str, request, raw_request_info):
        run = getattr(super(), method)
        if self._capture is None or not wants_capture(request):
            return await run(request, raw_request_info)
        trail = TokenTrail(keep=bool(getattr(request, "return_token_ids", False)))
        request.return_token_ids = True
        stream = await run(request, raw_request_info)

        async def passing():
            async for item in stream:
                yield trail.read(item)
            record = trail.record(request, self._capture_model, self._capture_drafter)
            if record is not None:
                self._capture.offer(record)

        return passing()


#: the response fields ``return_token_ids`` adds: top level (prompt) and per choice (answer)
PROMPT_KEY, ANSWER_KEY = "prompt_token_ids", "token_ids"


def wants_capture(request) -> bool:
    """A request is captured unless it says ``"store": false`` (OpenAI's field, kept by vLLM's
    request models as an extra) or asks for several choices (a record is one answer)."""
    extra = getattr(request, "model_extra", None) or {}
    return extra.get("store") is not False and (getattr(request, "n", 1) or 1) == 1


class TokenTrail:
    """The token ids and finish reason one request's responses carry (see the module docstring)."""

    def __init__(self, keep: bool):
        self.keep = keep  # the client asked for the ids itself: leave them in
        self.prompt: list[int] = []
        self.answer: list[int] = []
        self.finish_reason: str | None = None
        self.failed = False

    def read(self, item):
        """Note what ``item`` (a response object, a dict, an SSE string, or a list of them, as
        the LLM server yields them) carries; return it as the client should get it."""
        if isinstance(item, list):
            return [self.read(x) for x in item]
        if isinstance(item, str):
            return self._read_sse(item)
        if isinstance(item, dict):
            return self._read_dict(item)
        if hasattr(item, "model_dump"):
            if type(item).__name__ == "ErrorResponse":
                self.failed = True
                return item
            self._note(item.model_dump())
            if not self.keep:
                _drop(item)
            return item
        return item

    def _read_sse(self, chunk: str) -> str:
        if not chunk.startswith("data: ") or chunk.strip() == "data: [DONE]":
            return chunk
        try:
            data = json.loads(chunk[len("data: "):])
        except ValueError:
            return chunk
        if not isinstance(data, dict):
            return chunk
        if "error" in data:
            self.failed = True
            return chunk
        self._note(data)
        if self.keep or not _has_ids(data):
            return chunk
        _drop(data)
        return "data: " + json.dumps(data, separators=(",", ":")) + "\n\n"

    def _read_dict(self, data: dict) -> dict:
        if "error" in data:
            self.failed = True
            return data
        self._note(data)
        if not self.keep:
            _drop(data)
        return data

    def _note(self, data: dict) -> None:
        if data.get(PROMPT_KEY):
            self.prompt = list(data[PROMPT_KEY])
        for choice in data.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            self.answer.extend(choice.get(ANSWER_KEY) or [])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def record(self, request, model: str, drafter: dict) -> dict | None:
        """The capture record (serve_app/capture.py's schema), or None if the request failed or
        its responses carried no ids (nothing a drafter could learn from)."""
        if self.failed or not self.prompt or self.finish_reason is None:
            return None
        max_tokens = getattr(request, "max_completion_tokens", None) or getattr(request, "max_tokens", None)
        return {"request_id": str(getattr(request, "request_id", "") or ""), "time": time.time(), "model": model,
                "drafter_source": drafter.get("source") or "", "drafter_version": drafter.get("version") or "",
                "prompt_ids": self.prompt, "answer_ids": self.answer,
                "temperature": _or_none(getattr(request, "temperature", None), float),
                "top_p": _or_none(getattr(request, "top_p", None), float),
                "top_k": _or_none(getattr(request, "top_k", None), int),
                "max_tokens": _or_none(max_tokens, int), "finish_reason": self.finish_reason, "accepted": []}


def _has_ids(data: dict) -> bool:
    return PROMPT_KEY in data or any(ANSWER_KEY in c for c in data.get("choices") or [] if isinstance(c, dict))


def _drop(obj) -> None:
    """The ids ``return_token_ids`` added, removed (a dict) or reset to their default (a model)."""
    if isinstance(obj, dict):
        obj.pop(PROMPT_KEY, None)
        for c in obj.get("choices") or []:
            if isinstance(c, dict):
                c.pop(ANSWER_KEY, None)
        return
    if hasattr(obj, PROMPT_KEY):
        setattr(obj, PROMPT_KEY, None)
    for c in getattr(obj, "choices", None) or []:
        if hasattr(c, ANSWER_KEY):
            setattr(c, ANSWER_KEY, None)


def _or_none(value, kind):
    return None if value is None else kind(value)
