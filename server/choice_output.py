"""What a choice's output keeps: vLLM's output options, and logprobs kept in step with
the text actually returned.

``OutputOptions`` carries ``skip_special_tokens``, ``spaces_between_special_tokens`` and
``include_stop_str_in_output`` from the request to each choice's detokenizer and stop
matcher. ``LogprobGate`` holds a choice's token logprobs until the text they produced is
released by the stop-string matcher: a token whose text lies wholly inside a stop string
cut from the content is dropped, so ``logprobs`` describe exactly the returned tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.outputs import TokenLogprob


@dataclass(frozen=True)
class OutputOptions:
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @classmethod
    def from_request(cls, body: Any) -> OutputOptions:
        return cls(
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
        )


class LogprobGate:
    """Token logprobs tagged with where their text starts in the decoded output; released
    once the output up to there has been emitted."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, TokenLogprob]] = []

    def add(self, start: int, logprobs: list[TokenLogprob]) -> None:
        self._pending.extend((start, lp) for lp in logprobs)

    def release(self, emitted: int) -> list[TokenLogprob]:
        """Logprobs of tokens whose text starts before ``emitted`` characters."""
        ready = [lp for start, lp in self._pending if start < emitted]
        self._pending = [(start, lp) for start, lp in self._pending if start >= emitted]
        return ready

    def release_all(self) -> list[TokenLogprob]:
        ready = [lp for _, lp in self._pending]
        self._pending = []
        return ready

    def drop_rest(self) -> None:
        self._pending = []
