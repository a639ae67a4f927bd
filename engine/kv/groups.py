"""KV cache groups: which layers share a block table, and what each keeps.

A model's layers do not all keep the same history. A full-attention layer reads every
earlier token; a sliding-window layer of window ``W`` reads only the last ``W`` (itself
included), so the blocks wholly before that window are dead weight for it. kvserve
groups layers by what their attention keeps, and gives every group its own block table
per request over one shared pool of equal pages (vLLM's hybrid KV cache design):

- A page holds one block of ``S`` tokens for ``page_layers`` layers (K and V). Every group
  has at most that many layers, so any page can serve any group, and memory moves between
  groups as the load changes (a pool per group would have to split memory in advance).
- Layers of one attention kind are cut, in layer order, into groups of ``page_layers``
  layers: the smallest kind's layer count, so no kind is padded beyond its last group. A
  group with fewer layers leaves the rest of its pages' slots unused (``padding_layers``;
  the accounting counts them).
- Groups of the same kind run in lock step (same block boundaries, same releases), so the
  scheduler's cost grows with the number of kinds, not of groups.

With ``hybrid=False`` (``--disable-hybrid-kv-cache-manager``) every layer is one
full-attention group: sliding layers still attend only their window, but keep every block,
as an all-full cache would. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    """Layers whose blocks share one block table per request. ``window`` None: full
    attention (every block kept); else the sliding window in tokens, the query included."""

    layers: tuple[int, ...]
    window: int | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a KV group needs at least one layer")
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must be >= 1 token, not {self.window}")

    @property
    def kind(self) -> str:
        return "full" if self.window is None else "sliding"

    @property
    def label(self) -> str:
        """``full`` or ``sliding_<W>``: the metrics and plan name of the group's kind."""
        return "full" if self.window is None else f"sliding_{self.window}"

    def first_needed_block(self, position: int, block_size: int) -> int:
        return first_needed_block(self.window, position, block_size)

    def max_blocks(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Most blocks one sequence holds in this group while it grows to ``num_tokens``,
        ``chunk`` tokens a step at most: ceil(t / S), or for a window at most
        ceil((W + chunk - 2) / S) + 1 (the blocks under the keys the chunk's first query
        still reads, through its last token): ceil((W - 1) / S) + 1 while decoding."""
        blocks = -(-num_tokens // block_size)
        if self.window is None:
            return blocks
        return min(blocks, -(-(self.window + chunk - 2) // block_size) + 1)

    def retained_tokens(self, num_tokens: int) -> int:
        """Tokens whose K/V the next query of a ``num_tokens``-token sequence reads."""
        return num_tokens if self.window is None else min(num_tokens, self.window)


def first_needed_block(window: int | None, position: int, block_size: int) -> int:
    """Index of the first block a query at ``position`` still reads: 0 for full attention
    (``window`` None); for a window, the block of the oldest key it sees."""
    if window is None:
        return 0
    return max(0, position - window + 1) // block_size


def plan_kv_groups(layer_windows: Sequence[int | None], hybrid: bool = True) -> tuple[KVGroup, ...]:
    """Group layers by what they keep (see the module docstring).

    ``layer_windows[i]`` is layer ``i``'s sliding window, None for full attention. One kind
    of layer (every Llama, every Mistral layer) is one group of all layers; so is any model
    with ``hybrid`` False, as full attention.
    """
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    everything = tuple(range(len(layer_windows)))
    if not hybrid:
        return (KVGroup(everything),)
    if len(kinds) == 1:
        return (KVGroup(everything, next(iter(kinds))),)
    page_layers = min(len(layers) for layers in kinds.values())
    groups = [
        KVGroup(tuple(layers[start : start + page_layers]), window)
        for window, layers in kinds.items()
        for start in range(0, len(layers), page_layers)
    ]
    return tuple(groups)


def page_layers(groups: Sequence[KVGroup]) -> int:
    """Layer slots of one page: the largest group's layer count."""
    return max(len(group.layers) for group in groups)


def padding_layers(groups: Sequence[KVGroup]) -> int:
    """Unused layer slots summed over groups (a page of a short group wastes them)."""
    slots = page_layers(groups)
    return sum(slots - len(group.layers) for group in groups)


def layer_slots(groups: Sequence[KVGroup], num_layers: int) -> tuple[int, ...]:
    """Each layer's slot in a page: its position within its group (the layer itself for
    a model of one group)."""
    slots = [0] * num_layers
    for group in groups:
        for slot, layer in enumerate(group.layers):
            slots[layer] = slot
    return tuple(slots)


def layer_group_indices(groups: Sequence[KVGroup], num_layers: int) -> tuple[int, ...]:
    """Each layer's group index (whose block table its attention reads)."""
    owners = [0] * num_layers
    for index, group in enumerate(groups):
        for layer in group.layers:
            owners[layer] = index
    return tuple(owners)


def check_partition(groups: Sequence[KVGroup], num_layers: int) -> None:
    """Raise ValueError unless ``groups`` cover layers 0..num_layers-1 exactly once."""
    seen = sorted(layer for group in groups for layer in group.layers)
    if seen != list(range(num_layers)):
        raise ValueError(f"KV groups must cover layers 0..{num_layers - 1} exactly once")
