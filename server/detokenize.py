"""Incremental detokenisation and stop-string matching for streamed choices.

Two small pieces that the routes chain per choice:

* ``IncrementalDetokenizer`` turns token ids, arriving a few at a time, into text that is
  final: it never emits half of a multi-byte character (byte-level BPE tokens can split a
  UTF-8 sequence, which decodes to U+FFFD until the rest arrives) and keeps tokenizers
  whose decoding depends on the left context (SentencePiece's leading spaces) correct by
  decoding a short sliding window instead of single tokens.
* ``StopStringMatcher`` holds back the last ``len(longest stop) - 1`` characters so a stop
  string that spans two chunks is still caught before any of it is emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Tokens decoded before the first new one, so the window starts with real left context.
_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer needs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Accumulates one choice's output ids and yields newly final text.

    ``prefix_offset``..``read_offset`` is the window of already emitted tokens decoded
    together with the new ones; the text beyond the window's own decoding is the new
    text. Text ending in U+FFFD is held back until the character completes.
    """

    def __init__(
        self,
        decoder: Decoder,
        *,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._decoder = decoder
        self._skip_special = skip_special_tokens
        # vLLM's spaces_between_special_tokens: kept special tokens are set apart from the
        # text around them by one space (what Hugging Face's slow tokenizers do).
        self._special_ids: frozenset[int] = frozenset()
        if not skip_special_tokens and spaces_between_special_tokens:
            self._special_ids = frozenset(getattr(decoder, "all_special_ids", ()) or ())
        # The prompt's last tokens seed the window as already-emitted context, so the
        # first output token decodes as it would after the prompt (SentencePiece
        # tokenizers drop a word's leading space when it is decoded alone).
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # the prompt ends inside a character: no clean boundary to diff
        self._num_context = len(context)
        self._all_ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    @property
    def token_ids(self) -> list[int]:
        """The output tokens pushed so far (without the prompt context)."""
        return self._all_ids[self._num_context :]

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that became final (possibly empty)."""
        ids = self._all_ids
        ids.extend(new_token_ids)
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        new_text = full_text[len(prefix_text) :]
        self._read_offset = len(ids)
        self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)
        return new_text

    def flush(self) -> str:
        """Return whatever is still held back, incomplete characters included."""
        ids = self._all_ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(ids[self._prefix_offset :])
        self._read_offset = len(ids)
        self._prefix_offset = self._read_offset
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._special_ids and any(t in self._special_ids for t in ids):
            return " ".join(
                self._decoder.decode(run, skip_special_tokens=False) for run in self._runs(ids)
            )
        return self._decoder.decode(ids, skip_special_tokens=self._skip_special)

    def _runs(self, ids: list[int]) -> list[list[int]]:
        """``ids`` split so every special token is a run of its own."""
        runs: list[list[int]] = []
        for token in ids:
            if token in self._special_ids or not runs or runs[-1][-1] in self._special_ids:
                runs.append([token])
            else:
                runs[-1].append(token)
        return runs


@dataclass(frozen=True)
class StopMatch:
    """What a feed produced: text safe to emit, and whether a stop string ended it."""

    text: str
    stopped: bool = False
    stop: str | None = None  # the stop string that ended the output


class StopStringMatcher:
    """Cuts the output at the first occurrence of any stop string, never emitting it."""

    def __init__(self, stop: Sequence[str], *, include_stop: bool = False) -> None:
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop  # vLLM's include_stop_str_in_output
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> StopMatch:
        """Add text; return what can be emitted now. After a stop, everything is dropped."""
        if self.stopped:
            return StopMatch("", stopped=True)
        buffer = self._pending + text
        found = self._first_stop(buffer)
        if found is not None:
            cut, stop = found
            self.stopped = True
            self._pending = ""
            end = cut + len(stop) if self._include_stop else cut
            return StopMatch(buffer[:end], stopped=True, stop=stop)
        keep = min(self._hold, len(buffer))
        emit_len = len(buffer) - keep
        self._pending = buffer[emit_len:]
        return StopMatch(buffer[:emit_len])

    def flush(self) -> str:
        """The held-back tail, once the choice has ended for another reason."""
        if self.stopped:
            return ""
        tail, self._pending = self._pending, ""
        return tail

    def _first_stop(self, buffer: str) -> tuple[int, str] | None:
        """The earliest stop string in ``buffer`` (the longest at that position)."""
        found = [(buffer.find(s), -len(s), s) for s in self._stops]
        hits = [(i, key, s) for i, key, s in found if i >= 0]
        if not hits:
            return None
        position, _, stop = min(hits)
        return position, stop
