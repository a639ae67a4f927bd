"""Logprob values: what a sampled or scored token's log-probability looks like.

A leaf module (it imports nothing of the engine) so that both ``engine.request`` (a
request keeps its scored prompt positions) and ``engine.outputs`` (the runner's and the
scheduler's contracts carry them) can name these types without importing each other.
``engine.outputs`` re-exports both names for its callers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's logprob and the top alternatives (token id, logprob).
    ``rank`` (1 = most likely) is filled for prompt tokens, which were not sampled."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class PromptLogprobChunk:
    """Logprobs of consecutive prompt tokens scored in one forward piece; ``start`` is
    the prompt position of the first entry (>= 1: the first prompt token has none)."""

    start: int
    entries: tuple[TokenLogprob, ...]
