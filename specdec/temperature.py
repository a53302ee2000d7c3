"""The one temperature rule, without torch: config checks run in Ray Data's read tasks and the
driver, where importing torch would cost a second of CPU per worker process for a number."""

from __future__ import annotations

import numbers

MAX_TEMPERATURE = 2.0  # OpenAI's upper bound; the one range every entry point enforces
# What a request that names no temperature gets: OpenAI's documented default (sampling at T=1).
# SamplingParams() itself stays greedy (temperature 0): library callers and GREEDY rely on it.
API_DEFAULT_TEMPERATURE = 1.0


def check_temperature(value: float) -> float:
    """The one temperature rule: a number in [0, MAX_TEMPERATURE] (0 = greedy); raises
    ValueError naming the field and the range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {value!r}")
    return float(value)
