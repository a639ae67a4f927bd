"""N-gram (prompt-lookup) proposals: a sequence's next tokens guessed from its own history.

For the last ``n`` tokens of a sequence (``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``: the longest match wins), find their most recent earlier occurrence
in the sequence's prompt and output; up to ``k`` tokens that followed it are the proposal.
No draft model: it pays where the output repeats its input (edits, quotes, code, lists).

Each sequence keeps an index from n-gram to the end of its latest occurrence, extended with
the tokens appended since the last call, so a proposal costs a few dictionary lookups, not
a scan of a history thousands of tokens long. Pure Python, no torch: the scheduler calls it.
"""

from __future__ import annotations

from engine.config import SpeculativeConfig

NGram = tuple[int, ...]


class NgramIndex:
    """Latest end position (exclusive) of every n-gram of one token sequence, for
    ``low <= n <= high``, over occurrences that some token follows."""

    def __init__(self, low: int, high: int) -> None:
        self.low = low
        self.high = high
        self._latest: dict[NGram, int] = {}
        self._next_end = 1  # the first end position not indexed yet

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams ending before the last token of ``tokens`` (which must extend
        what was indexed before). The current suffix is left out: a match must have a
        continuation, and the suffix would only ever match itself."""
        latest = self._latest
        for end in range(self._next_end, len(tokens)):
            for n in range(self.low, min(self.high, end) + 1):
                latest[tuple(tokens[end - n : end])] = end
        self._next_end = max(self._next_end, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        suffix of ``tokens`` found in the index; empty when there is none."""
        self.extend(tokens)
        length = len(tokens)
        for n in range(min(self.high, length), self.low - 1, -1):
            end = self._latest.get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end : end + k]
        return []


class NgramProposer:
    """Per-sequence n-gram indexes; ``forget`` drops a sequence that left the engine."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, tokens: list[int], max_tokens: int) -> list[int]:
        """At most ``min(max_tokens, num_speculative_tokens)`` proposed next tokens."""
        k = min(max_tokens, self.config.num_speculative_tokens)
        if k <= 0:
            return []
        index = self._indexes.get(request_id)
        if index is None:
            index = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
            self._indexes[request_id] = index
        return index.propose(tokens, k)

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
