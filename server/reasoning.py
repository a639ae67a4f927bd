"""Reasoning output split from the answer: ``--reasoning-parser`` (vLLM's names).

Thinking models write their reasoning between ``<think>`` and ``</think>`` before the
answer. A parser turns a choice's text into ``ReasoningText`` events for that part and
passes the rest on to the choice's usual output processing (content, or tool calls):

- ``deepseek_r1`` (DeepSeek-R1 and its distills): the chat template opens the think block
  in the prompt, so the output starts inside it; everything up to ``</think>`` is
  reasoning (a ``<think>`` the model writes anyway is dropped), all of it when the tag never
  comes.
- ``qwen3`` (Qwen3, QwQ): reasoning only when the output opens with ``<think>``
  (whitespace before it allowed); with ``enable_thinking: false`` the template closes an
  empty block in the prompt and the output is all answer.

A prompt that ends with an open ``<think>`` (the thinking templates of Qwen3-2507, QwQ)
starts the output inside the block for either parser (``for_prompt``).

Tags split across stream pieces are held back until they are whole, so the streamed and
the whole answer split the same way (tests/unit/test_reasoning.py). When the output starts
inside the block, a structured-output constraint or a forced tool call applies only after
it: the engine leaves the grammar off until the end tag's tokens (``end_marker_ids``)
appear (``StructuredOutputs.after``). An output that may open a block itself (Qwen3 with
thinking on) gets the grammar's first tokens and the start tag to choose from
(``StructuredOutputs.opener``): opening the block defers the constraint to its end, any
other first token starts it at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from server.tools.events import OutputEvent, ReasoningText

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family marks its reasoning."""

    name: str
    starts_inside: bool  # the template opened the block: the output begins in reasoning
    start: str = THINK_START
    end: str = THINK_END

    def for_prompt(self, prompt_text: str) -> ReasoningFormat:
        """This format for an output that follows ``prompt_text``: starting inside the
        block when the prompt leaves one open."""
        if self.starts_inside or not prompt_text.rstrip().endswith(self.start):
            return self
        return dataclasses.replace(self, starts_inside=True)

    def opener_id(self, tokenizer: Any, prompt_text: str) -> int | None:
        """The start tag's token when the output may open a block itself (the model
        chooses whether to think): None when it starts inside one, after a prompt that
        closed an empty one (``enable_thinking: false``), or when the tag is not one
        token."""
        if self.starts_inside or prompt_text.rstrip().endswith(self.end):
            return None
        ids = tokenizer.encode(self.start, add_special_tokens=False)
        return int(ids[0]) if len(ids) == 1 else None

    def end_marker_ids(self, tokenizer: Any) -> tuple[int, ...]:
        """The end tag as the tokenizer encodes it (one added token for Qwen3, R1)."""
        return tuple(tokenizer.encode(self.end, add_special_tokens=False))


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_inside=True),
    "qwen3": ReasoningFormat("qwen3", starts_inside=False),
}


def reasoning_format(name: str) -> ReasoningFormat:
    """The parser ``--reasoning-parser name`` names; ValueError listing them if none."""
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}"
        )
    return REASONING_PARSERS[name]


class ReasoningSplitter:
    """One choice's text, split: ``feed`` returns the reasoning events of the new text and
    the answer text that follows them (both possibly empty)."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self._buffer = ""
        # "opening": may still see the start tag (leading whitespace only so far);
        # "inside": reasoning until the end tag; "after": all answer.
        self._state = "inside" if fmt.starts_inside else "opening"
        self._at_start = True  # no reasoning text emitted yet (a leading tag is dropped)

    @property
    def reasoning_ended(self) -> bool:
        return self._state == "after"

    def feed(self, text: str) -> tuple[list[OutputEvent], str]:
        self._buffer += text
        events: list[OutputEvent] = []
        answer = ""
        while True:
            if self._state == "opening":
                if not self._open():
                    return events, answer
            elif self._state == "inside":
                done, reasoning = self._inside()
                if reasoning:
                    events.append(ReasoningText(reasoning))
                if not done:
                    return events, answer
            else:
                answer, self._buffer = answer + self._buffer, ""
                return events, answer

    def finish(self) -> tuple[list[OutputEvent], str]:
        """The held-back rest: reasoning when inside the block, else answer."""
        rest, self._buffer = self._buffer, ""
        if self._state == "inside":
            return ([ReasoningText(rest)] if rest else []), ""
        self._state = "after"
        return [], rest

    def _open(self) -> bool:
        """Decide whether the output opens a think block; False to wait for more text."""
        stripped = self._buffer.lstrip()
        if stripped.startswith(self.fmt.start):
            self._buffer = stripped[len(self.fmt.start) :]
            self._state = "inside"
            return True
        if self.fmt.start.startswith(stripped):  # nothing yet, or part of the tag
            return False
        self._state = "after"
        return True

    def _inside(self) -> tuple[bool, str]:
        """Reasoning up to the end tag: (the block ended, reasoning text released)."""
        if self._at_start:  # a start tag the model writes though the template opened it
            stripped = self._buffer.lstrip()
            if self.fmt.start.startswith(stripped) and stripped != self.fmt.start:
                return False, ""  # could still be the start tag
            if stripped.startswith(self.fmt.start):
                self._buffer = stripped[len(self.fmt.start) :]
        end = self._buffer.find(self.fmt.end)
        if end >= 0:
            reasoning = self._buffer[:end]
            self._buffer = self._buffer[end + len(self.fmt.end) :]
            self._state = "after"
            self._at_start = False
            return True, reasoning
        keep = _held_suffix(self._buffer, self.fmt.end)
        reasoning = self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep :]
        if reasoning:
            self._at_start = False
        return False, reasoning


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (it may be the tag's
    start, to be completed by the next piece)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
