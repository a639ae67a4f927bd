"""A step's attention inputs: slots, positions and block tables, built once per step and
shared by every layer (a leaf module: torch only).

The flattened batch is ordered decodes first, then prefill chunks. Decode rows (one new
token each) read a padded block table; prefill chunks are listed as spans and, for the
native kernel, as one padded table of all of them. The Triton backend's steps carry
``VarlenTables`` instead (engine/model/runtime/cuda_metadata.py builds them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SequenceChunk:
    """One request's new tokens in the step, as the runner hands it to the model."""

    num_computed: int  # tokens already in the cache before this step
    num_new: int
    block_ids: list[int]


@dataclass
class PrefillSpan:
    """A prefill chunk: rows ``[start, end)`` of the batch attend to the ``num_computed``
    cached tokens before them and causally to each other."""

    start: int
    end: int
    num_computed: int
    block_ids: torch.Tensor  # blocks covering the context


@dataclass
class PrefillTables:
    """All of a step's prefill chunks as the native kernel reads them (on the device)."""

    block_table: torch.Tensor  # [chunks, max_blocks], padded with each row's first block
    query_starts: torch.Tensor  # [chunks + 1] row offsets, relative to the first prefill row
    num_computed: torch.Tensor  # [chunks] cached tokens before each chunk


@dataclass
class VarlenTables:
    """Every sequence of a step for one varlen attention launch (the Triton backend; built
    by engine/model/runtime/cuda_metadata.py). Sequence ``i`` owns rows ``[query_starts[i],
    query_starts[i + 1])`` and attends to its first ``seq_lens[i]`` keys (its new tokens'
    included) through ``block_table[i]``; decodes and drafts are one-row sequences."""

    block_table: torch.Tensor  # [seqs, max_blocks]
    seq_lens: torch.Tensor  # [seqs]
    query_starts: torch.Tensor  # [seqs + 1]
    max_query_len: int  # host-side: 1 means row i is sequence i's only token


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, on the model's device. With ``varlen`` set, attention
    reads only it (and ``slots``/``positions``): the decode and prefill fields are unused."""

    slots: torch.Tensor  # [tokens] flat cache slot of every new token
    positions: torch.Tensor  # [tokens]
    num_decodes: int  # rows [0, num_decodes) are single-token decodes
    decode_block_table: torch.Tensor | None  # [num_decodes, max_blocks], padded
    decode_context_lens: torch.Tensor | None  # [num_decodes] keys each decode attends
    prefills: list[PrefillSpan]
    prefill_tables: PrefillTables | None
    varlen: VarlenTables | None = None
    # A model of several KV groups (engine/kv/groups.py): each layer's group, and every
    # group's metadata (this one is group 0's). None for one group: every layer reads this.
    layer_groups: tuple[int, ...] | None = None
    group_metas: list[AttentionMetadata] | None = None
    _decode_padding: torch.Tensor | None = field(default=None, init=False, repr=False)
    _decode_windows: dict[tuple[int, int], DecodeWindow] = field(
        default_factory=dict, init=False, repr=False
    )

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata of the KV group whose block tables ``layer`` reads."""
        if self.layer_groups is None or self.group_metas is None:
            return self
        return self.group_metas[self.layer_groups[layer]]

    def decode_padding(self, keys: int) -> torch.Tensor:
        """``[num_decodes, keys]``, True past each decode's context (its table's pad blocks,
        its last block's tail): the torch decode kernel's mask, built by the first layer
        that asks and reused by the rest of the step (the native and Triton kernels stop
        at each row's length and never ask)."""
        assert self.decode_context_lens is not None
        padding = self._decode_padding
        if padding is None or padding.shape[-1] != keys:
            positions = torch.arange(keys, device=self.decode_context_lens.device)
            padding = positions >= self.decode_context_lens[:, None]
            self._decode_padding = padding
        return padding

    def decode_window(self, window: int, block_size: int) -> DecodeWindow:
        """The blocks holding each decode row's last ``window`` keys, for a sliding layer
        (built by the first layer that asks, reused by the rest of the step). Only device
        ops, no host sync: CUDA graphs capture it."""
        key = (window, block_size)
        cached = self._decode_windows.get(key)
        if cached is None:
            assert self.decode_block_table is not None and self.decode_context_lens is not None
            cached = DecodeWindow.build(
                self.decode_block_table, self.decode_context_lens, window, block_size
            )
            self._decode_windows[key] = cached
        return cached


@dataclass(frozen=True)
class DecodeWindow:
    """Decode rows' sliding-window blocks: row ``i``'s table starts at the block holding
    its first key inside the window (position ``context_len - window``, or 0), so the work
    and the blocks read are bounded by the window whatever the context; ``hidden`` marks
    the keys those blocks hold outside the window or past the context."""

    block_table: torch.Tensor  # [rows, blocks], blocks <= ceil((window - 1) / size) + 1
    hidden: torch.Tensor  # [rows, blocks * block_size], True = masked

    @classmethod
    def build(
        cls, table: torch.Tensor, context_lens: torch.Tensor, window: int, block_size: int
    ) -> DecodeWindow:
        count = min(table.shape[1], -(-(window - 1) // block_size) + 1)
        first = (context_lens - window).clamp_min(0) // block_size  # [rows]
        last = (context_lens - 1) // block_size  # -1 for a padding row (context 0)
        steps = torch.arange(count, device=table.device)
        # Past a row's last block the index repeats it (never a pad entry, which may be a
        # placeholder block); the keys there lie past the context and are masked.
        index = torch.minimum(first[:, None] + steps, last[:, None]).clamp_min(0)
        keys = torch.arange(count * block_size, device=table.device)
        positions = first[:, None] * block_size + keys  # of the keys as laid out, unclamped
        hidden = (positions >= context_lens[:, None]) | (
            positions < (context_lens - window)[:, None]
        )
        return cls(table.gather(1, index), hidden)


def build_metadata(
    chunks: list[SequenceChunk],
    block_size: int,
    device: torch.device,
    positions: torch.Tensor | None = None,
) -> AttentionMetadata:
    """Metadata for ``chunks``, which must list every decode (num_new == 1, num_computed > 0)
    before any prefill chunk. ``positions`` may pass the step's positions tensor when it is
    already built (every KV group shares it). A table's ``NULL_BLOCK`` entries (a sliding
    group's blocks before its window) become block 0 in the tensors: no kernel reads a
    block before a layer's window, and the torch kernels mask what they gather there."""
    slots: list[int] = []
    for chunk in chunks:
        slots += _chunk_slots(chunk, block_size)
    if positions is None:
        positions = torch.tensor(
            [p for c in chunks for p in range(c.num_computed, c.num_computed + c.num_new)],
            dtype=torch.long,
            device=device,
        )
    num_decodes = 0
    while num_decodes < len(chunks) and _is_decode(chunks[num_decodes]):
        num_decodes += 1
    table, lengths = _decode_tables(chunks[:num_decodes], block_size, device)
    prefill_chunks = chunks[num_decodes:]
    return AttentionMetadata(
        slots=torch.tensor(slots, dtype=torch.long, device=device),
        positions=positions,
        num_decodes=num_decodes,
        decode_block_table=table,
        decode_context_lens=lengths,
        prefills=_prefill_spans(chunks, num_decodes, block_size, device),
        prefill_tables=_prefill_tables(prefill_chunks, block_size, device),
    )


def build_grouped_metadata(
    chunks_by_group: list[list[SequenceChunk]],
    layer_groups: tuple[int, ...],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """One ``build_metadata`` per KV group (``chunks_by_group[g]`` reads group g's block
    tables), linked so each layer finds its group's (``for_layer``)."""
    first = build_metadata(chunks_by_group[0], block_size, device)
    if len(chunks_by_group) == 1:
        return first
    metas = [first] + [
        build_metadata(chunks, block_size, device, first.positions)
        for chunks in chunks_by_group[1:]
    ]
    first.layer_groups = layer_groups
    first.group_metas = metas
    return first


def _chunk_slots(chunk: SequenceChunk, block_size: int) -> list[int]:
    """Flat cache slots of a chunk's new tokens, a block's run at a time."""
    slots: list[int] = []
    position, end = chunk.num_computed, chunk.num_computed + chunk.num_new
    while position < end:
        index, offset = divmod(position, block_size)
        run = min(end - position, block_size - offset)
        base = chunk.block_ids[index] * block_size
        slots += range(base + offset, base + offset + run)
        position += run
    return slots


def _is_decode(chunk: SequenceChunk) -> bool:
    return chunk.num_new == 1 and chunk.num_computed > 0


def _decode_tables(
    decodes: list[SequenceChunk], block_size: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Padded block tables (pad = the row's first block) and context lengths."""
    if not decodes:
        return None, None
    context = [c.num_computed + 1 for c in decodes]
    max_blocks = -(-max(context) // block_size)
    table: list[int] = []
    for chunk, ctx in zip(decodes, context, strict=True):
        used = chunk.block_ids[: -(-ctx // block_size)]
        table.extend(used + [used[0]] * (max_blocks - len(used)))
    lengths = torch.tensor(context, dtype=torch.long, device=device)
    block_table = torch.tensor(table, dtype=torch.long, device=device).view(len(decodes), -1)
    return block_table.clamp_(min=0), lengths


def _prefill_spans(
    chunks: list[SequenceChunk], num_decodes: int, block_size: int, device: torch.device
) -> list[PrefillSpan]:
    spans: list[PrefillSpan] = []
    start = sum(c.num_new for c in chunks[:num_decodes])
    for chunk in chunks[num_decodes:]:
        end = start + chunk.num_new
        context = chunk.num_computed + chunk.num_new
        blocks = chunk.block_ids[: -(-context // block_size)]
        spans.append(
            PrefillSpan(
                start=start,
                end=end,
                num_computed=chunk.num_computed,
                block_ids=torch.tensor(blocks, dtype=torch.long, device=device).clamp_(min=0),
            )
        )
        start = end
    return spans


def _prefill_tables(
    chunks: list[SequenceChunk], block_size: int, device: torch.device
) -> PrefillTables | None:
    if not chunks:
        return None
    used = [c.block_ids[: -(-(c.num_computed + c.num_new) // block_size)] for c in chunks]
    width = max(len(blocks) for blocks in used)
    table = [blocks + [blocks[0]] * (width - len(blocks)) for blocks in used]
    starts = [0]
    for chunk in chunks:
        starts.append(starts[-1] + chunk.num_new)
    return PrefillTables(
        block_table=torch.tensor(table, dtype=torch.long, device=device).clamp_(min=0),
        query_starts=torch.tensor(starts, dtype=torch.long, device=device),
        num_computed=torch.tensor(
            [c.num_computed for c in chunks], dtype=torch.long, device=device
        ),
    )
