"""The OpenAI wire format: request validation (-> ``GenerationJob`` or ``APIError``) and
response/chunk builders. Pure functions, no Ray, no model."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from specdec.temperature import API_DEFAULT_TEMPERATURE, check_temperature

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_SEQUENCES = 4


class APIError(Exception):
    """An error the client caused (4xx) or a server fault (5xx), in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def as_event(self) -> dict:
        return {"type": "error", "status": self.status, "message": self.message, "param": self.param,
                "code": self.code, "error_type": self.type}

    @classmethod
    def from_event(cls, ev: dict) -> "APIError":
        return cls(ev["status"], ev["message"], ev.get("param"), ev.get("code"), ev.get("error_type"))


@dataclass
class GenerationJob:
    """What the ingress hands a replica: a validated request, model-agnostic."""

    kind: str  # "chat" | "completion"
    max_tokens: int
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    temperature: float = API_DEFAULT_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    id: str = ""
    created: int = 0
    store: bool | None = None  # OpenAI's "store": False keeps a request out of traffic capture

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Limits:
    model_name: str
    max_tokens_limit: int
    default_max_tokens: int


# ---------------------------------------------------------------------- parsing
def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request: {e}. "
                            "(HINT: send a JSON object with Content-Type: application/json.)") from None
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, got {type(body).__name__}.")
    return body


def _type_error(name: str, value: Any, expected: str) -> APIError:
    return APIError(400, f"Invalid type for '{name}': expected {expected}, but got {type(value).__name__} "
                         f"({json.dumps(value)[:60]}).", param=name, code="invalid_type")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_object(v: Any) -> bool:
    return isinstance(v, dict)


def _is_objects(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, dict) for x in v)


def _is_logit_bias(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and k.isascii() and k.isdigit()
                                       and _is_number(b) and -100 <= b <= 100 for k, b in v.items())


@dataclass(frozen=True)
class _Unimplemented:
    """An OpenAI request field we accept but do not implement. It is still type-checked (a
    typo must not pass silently), and a value other than one that changes nothing is refused:
    ignoring it would answer a request the client did not make. ``None`` means "not set"."""

    expected: str  # a well-typed value, in words, for the 400
    well_typed: Callable[[Any], bool]
    neutral: Callable[[Any], bool] = lambda v: True  # the values we honour by doing nothing
    bounds: tuple[float, float] | None = None  # OpenAI's range, checked before "neutral"
    refusal: str = "'{name}' = {value} is not supported by this server."


_PENALTY = _Unimplemented("a number", _is_number, lambda v: v == 0, bounds=(-2, 2))
_UNIMPLEMENTED_COMMON: dict[str, _Unimplemented] = {
    "logit_bias": _Unimplemented(
        "an object mapping token-id strings to numbers in [-100, 100]", _is_logit_bias, lambda v: not v,
        refusal="'logit_bias' is not supported by this server: speculative decoding verifies drafts "
                "against the target model's own distribution, which a bias would change."),
    "presence_penalty": _PENALTY,
    "frequency_penalty": _PENALTY,
    "n": _Unimplemented("an integer", _is_int, lambda v: v == 1, bounds=(1, 128), refusal="Only n=1 is supported."),
    # Accepted but not honoured: every row of a batch draws from the engine's one generator, so
    # a per-request seed would need per-row generators. Seeded sampling is not reproducible.
    "seed": _Unimplemented("an integer", _is_int),
    "user": _Unimplemented("a string", _is_str),
}
_TOOL_CHOICE = _Unimplemented("a string or an object", lambda v: isinstance(v, (str, dict)),
                              lambda v: v in ("none", "auto"))  # with no tools, "auto" can only mean "none"
_UNIMPLEMENTED_CHAT: dict[str, _Unimplemented] = {
    "logprobs": _Unimplemented("a boolean", _is_bool, lambda v: v is False),
    "top_logprobs": _Unimplemented("an integer", _is_int, lambda v: v == 0, bounds=(0, 20)),
    "response_format": _Unimplemented("an object with a string 'type'",
                                      lambda v: isinstance(v, dict) and isinstance(v.get("type"), str),
                                      lambda v: v["type"] == "text"),
    "tools": _Unimplemented("an array of objects", _is_objects, lambda v: not v),
    "tool_choice": _TOOL_CHOICE,
    "parallel_tool_calls": _Unimplemented("a boolean", _is_bool),  # nothing to parallelise without tools
    "functions": _Unimplemented("an array of objects", _is_objects, lambda v: not v),  # deprecated "tools"
    "function_call": _TOOL_CHOICE,  # deprecated "tool_choice"
    "modalities": _Unimplemented("an array of strings", lambda v: isinstance(v, list) and all(map(_is_str, v)),
                                 lambda v: all(m == "text" for m in v)),
    "audio": _Unimplemented("an object", _is_object, lambda v: False),
    "prediction": _Unimplemented("an object", _is_object),  # a predicted output only saves latency
    "metadata": _Unimplemented("an object mapping strings to strings",  # tags stored completions: none here
                               lambda v: isinstance(v, dict) and all(map(_is_str, v.values()))),
    "service_tier": _Unimplemented("a string", _is_str),  # one tier here; a tier sets latency, not output
    "safety_identifier": _Unimplemented("a string", _is_str),
    "prompt_cache_key": _Unimplemented("a string", _is_str),
}
_UNIMPLEMENTED_COMPLETION: dict[str, _Unimplemented] = {
    "echo": _Unimplemented("a boolean", _is_bool, lambda v: v is False),
    # any integer asks for log-probabilities (0: the sampled token's own); false means off
    "logprobs": _Unimplemented("an integer", lambda v: v is False or _is_int(v), lambda v: v is False,
                               bounds=(0, 5)),
    "suffix": _Unimplemented("a string", _is_str, lambda v: v == ""),
    "best_of": _Unimplemented("an integer", _is_int, lambda v: v == 1, bounds=(1, 20)),
}


def _check_unimplemented(body: dict, fields: dict[str, _Unimplemented]) -> None:
    for name, f in fields.items():
        value = body.get(name)
        if value is None:
            continue
        if not f.well_typed(value):
            raise _type_error(name, value, f.expected)
        if f.bounds is not None and not f.bounds[0] <= value <= f.bounds[1]:
            lo, hi = f.bounds
            code = ("integer" if _is_int(value) else "decimal") + ("_below_min" if value < lo else "_above_max")
            raise APIError(400, f"Invalid '{name}': {value} is outside [{lo:g}, {hi:g}].", param=name,
                           code=code + "_value")
        if not f.neutral(value):
            raise APIError(400, f.refusal.format(name=name, value=json.dumps(value)[:60]), param=name,
                           code="unsupported_value")


def _common(body: dict, limits: Limits, kind: str) -> dict:
    """Fields shared by both endpoints."""
    model = body.get("model", limits.model_name)
    if not isinstance(model, str):
        raise _type_error("model", model, "a string")
    if model != limits.model_name:
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{limits.model_name}`.",
                       param="model", code="model_not_found")

    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    elif not _is_int(max_tokens):
        raise _type_error(name, max_tokens, "an integer")
    max_tokens = int(max_tokens)
    if max_tokens <= 0:
        raise APIError(400, f"Invalid '{name}': integer below minimum value. Expected a value >= 1, "
                            f"but got {max_tokens} instead.", param=name, code="integer_below_min_value")
    if max_tokens > limits.max_tokens_limit:
        raise APIError(400, f"Invalid '{name}': {max_tokens} is greater than the maximum of "
                            f"{limits.max_tokens_limit} this server allows.", param=name,
                       code="integer_above_max_value")

    temperature = body.get("temperature")
    temperature = API_DEFAULT_TEMPERATURE if temperature is None else temperature
    if not _is_number(temperature):
        raise _type_error("temperature", temperature, "a number")
    try:
        temperature = check_temperature(temperature)  # the library's one rule, as an OpenAI 400
    except ValueError as e:
        raise APIError(400, f"Invalid 'temperature': {e}.", param="temperature",
                       code="decimal_below_min_value" if temperature < 0 else "decimal_above_max_value") from None

    top_p = body.get("top_p", 1.0)
    top_p = 1.0 if top_p is None else top_p
    if not _is_number(top_p):
        raise _type_error("top_p", top_p, "a number")
    if not 0 < top_p <= 1:
        raise APIError(400, f"Invalid 'top_p': {top_p} is outside (0, 1].", param="top_p",
                       code="decimal_below_min_value" if top_p <= 0 else "decimal_above_max_value")

    top_k = body.get("top_k", 0)
    top_k = 0 if top_k is None or top_k == -1 else top_k
    if not _is_int(top_k) or top_k < 0:
        raise APIError(400, f"Invalid 'top_k': expected an integer >= 0 (or -1 for off), got {top_k!r}.",
                       param="top_k", code="invalid_value")

    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = list(stop)
    else:
        raise _type_error("stop", stop, "a string or an array of strings")
    if len(stop) > MAX_STOP_SEQUENCES or any(not s for s in stop):
        raise APIError(400, f"'stop' takes up to {MAX_STOP_SEQUENCES} non-empty strings.", param="stop",
                       code="invalid_value")

    stream = body.get("stream", False)
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise _type_error("stream", stream, "a boolean")
    opts = body.get("stream_options")
    opts = {} if opts is None else opts  # not `or {}`: that would let "", 0 and [] through
    if not isinstance(opts, dict):
        raise _type_error("stream_options", opts, "an object")
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _type_error("stream_options.include_usage", include_usage, "a boolean")

    _check_unimplemented(body, _UNIMPLEMENTED_COMMON)
    _check_unimplemented(body, _UNIMPLEMENTED_CHAT if kind == "chat" else _UNIMPLEMENTED_COMPLETION)

    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return dict(max_tokens=max_tokens, temperature=temperature, top_p=float(top_p), top_k=int(top_k),
                stop=stop, stream=stream, include_usage=include_usage,
                id=f"{prefix}-{uuid.uuid4().hex[:24]}", created=int(time.time()))


def _message_text(i: int, msg: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise _type_error(where, msg, "an object")
    role = msg.get("role")
    if role not in CHAT_ROLES:
        raise APIError(400, f"Invalid value for '{where}.role': {json.dumps(role)}. Supported values are: "
                            f"{', '.join(repr(r) for r in CHAT_ROLES)}.", param=f"{where}.role", code="invalid_value")
    content = msg.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise APIError(400, f"Invalid '{where}.content[{j}]': only text parts are supported.",
                               param=f"{where}.content", code="invalid_value")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise _type_error(f"{where}.content", content, "a string or an array of text parts")
    return {"role": role, "content": content}


def parse_chat(body: dict, limits: Limits) -> GenerationJob:
    if "messages" not in body or body["messages"] is None:
        raise APIError(400, "Missing required parameter: 'messages'.", param="messages",
                       code="missing_required_parameter")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise _type_error("messages", messages, "an array")
    if not messages:
        raise APIError(400, "Invalid 'messages': empty array. Expected an array with minimum length 1.",
                       param="messages", code="empty_array")
    msgs = [_message_text(i, m) for i, m in enumerate(messages)]
    store = body.get("store")
    if store is not None and not _is_bool(store):
        raise _type_error("store", store, "a boolean")
    return GenerationJob(kind="chat", messages=msgs, store=store, **_common(body, limits, "chat"))


def parse_completion(body: dict, limits: Limits) -> GenerationJob:
    if "prompt" not in body or body["prompt"] is None:
        raise APIError(400, "Missing required parameter: 'prompt'.", param="prompt", code="missing_required_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(_is_int(t) and not isinstance(t, float) and t >= 0 for t in prompt):
            raise APIError(400, "Invalid 'prompt': expected a string, or a non-empty array of token ids "
                                "(batches of several prompts are not supported).", param="prompt",
                           code="invalid_value")
    elif not isinstance(prompt, str):
        raise _type_error("prompt", prompt, "a string or an array of token ids")
    if isinstance(prompt, str) and not prompt:
        raise APIError(400, "Invalid 'prompt': empty string.", param="prompt", code="invalid_value")
    return GenerationJob(kind="completion", prompt=prompt, **_common(body, limits, "completion"))


# ---------------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int, speculative: dict | None) -> dict:
    """OpenAI usage plus the request's accepted-length statistics."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if speculative is not None:
        out["speculative"] = speculative
    return out


def chat_response(job: GenerationJob, model: str, text: str, finish_reason: str, use: dict) -> dict:
    return {"id": job.id, "object": "chat.completion", "created": job.created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}


def completion_response(job: GenerationJob, model: str, text: str, finish_reason: str, use: dict) -> dict:
    return {"id": job.id, "object": "text_completion", "created": job.created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}


def chunk(job: GenerationJob, model: str, text: str | None, finish_reason: str | None = None,
          role: bool = False, use: dict | None = None, no_choices: bool = False) -> dict:
    """One streaming chunk for either endpoint."""
    if job.kind == "chat":
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        out = {"id": job.id, "object": "chat.completion.chunk", "created": job.created, "model": model,
               "choices": [] if no_choices else [choice]}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        out = {"id": job.id, "object": "text_completion", "created": job.created, "model": model,
               "choices": [] if no_choices else [choice]}
    if use is not None:
        out["usage"] = use
    return out


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
