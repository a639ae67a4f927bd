"""How long a prefix every KV group can serve: the prefix-cache hit across groups.

A hit of ``h`` blocks means the request's first ``h * S`` tokens need no compute: its next
query, at position ``h * S``, reads only cached keys. What that takes depends on the kind:

- full attention needs every block ``0 .. h-1``; a hit at ``h`` implies one at any shorter
  length, so the search runs left to right and stops at the first miss;
- a sliding window ``W`` needs only the blocks under the last ``W - 1`` keys before
  ``h * S``; a hit at ``h`` says nothing about shorter ones (their windows reach back to
  blocks that may be gone), so the search runs right to left and takes the top of the
  first run of cached blocks long enough for the window.

The request's hit is the longest ``h`` every kind serves: each kind in turn lowers the
candidate to what it serves at or below it, until no kind lowers it further (a full
kind's answer stays valid for any lower candidate; a sliding kind's must be asked again).

Groups of one kind run in lock step, so a block index is available for a kind when every
one of its groups has it. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.kv.groups import first_needed_block

# available(group, block index) -> whether that group's block at that index is usable.
Availability = Callable[[int, int], bool]


@dataclass(frozen=True)
class AttentionKind:
    """Groups that keep the same history (a window, or None for full attention)."""

    window: int | None
    groups: tuple[int, ...]

    def first_needed_block(self, position: int, block_size: int) -> int:
        return first_needed_block(self.window, position, block_size)


def kinds_of(windows: Sequence[int | None]) -> tuple[AttentionKind, ...]:
    """Group indices by window (``windows[g]`` is group g's), in first-seen order."""
    by_window: dict[int | None, list[int]] = {}
    for group, window in enumerate(windows):
        by_window.setdefault(window, []).append(group)
    return tuple(AttentionKind(window, tuple(groups)) for window, groups in by_window.items())


def hit_length(
    kinds: Sequence[AttentionKind], limit: int, block_size: int, available: Availability
) -> int:
    """The longest ``h <= limit`` (in blocks) that every kind serves."""
    candidate = limit
    while True:
        lowered = candidate
        for kind in kinds:
            lowered = _kind_hit(kind, lowered, block_size, available)
        if lowered == candidate:
            return candidate
        candidate = lowered


def _kind_hit(kind: AttentionKind, limit: int, block_size: int, available: Availability) -> int:
    def has(index: int) -> bool:
        return all(available(group, index) for group in kind.groups)

    if kind.window is None:
        for index in range(limit):
            if not has(index):
                return index
        return limit
    top = limit  # the candidate hit: the exclusive end of the run scanned so far
    for index in range(limit - 1, -1, -1):
        if not has(index):
            top = index
            continue
        if index <= kind.first_needed_block(top * block_size, block_size):
            return top  # the run index..top-1 covers the window before top
    return top  # the run reaches block 0 (or top is 0): nothing before it is needed
