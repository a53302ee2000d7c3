"""Prompt lookup (n-gram speculation): the tokens that followed the latest earlier
occurrence of the context's last n tokens, prompt and output alike. Answers quote their
prompt, code repeats identifiers, small models repeat themselves: a match costs no model
pass and is often long, while a DFlash drafter is right on the first token or two of free
text. The proposers that draft from it are in proposers.py.
"""

from __future__ import annotations


class NgramIndex:
    """Where each n-gram (``min_n <= n <= max_n``) of a growing token sequence last ended.

    ``after[g]`` is the index just after the latest occurrence of n-gram ``g`` that ends
    before the sequence's last token, so the sequence's own suffix never matches itself."""

    def __init__(self, tokens: list[int], min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        seq = self.tokens
        for t in tokens:
            end = len(seq)  # n-grams ending at the current last token become visible now
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    self.after[tuple(seq[end - n:end])] = end
            seq.append(t)

    def lookup(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        suffix n-gram found ([] when no suffix of ``min_n`` tokens or more occurred before)."""
        seq = self.tokens
        for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
            start = self.after.get(tuple(seq[-n:]))
            if start is not None:
                return seq[start:start + k]
        return []
