"""Paged attention over a mixed batch of decode tokens and prefill chunks.

The flattened batch is ordered decodes first, then prefill chunks. Decode rows (one new
token each) are attended in one batched matmul over their gathered, padded block tables:
torch's CPU ``scaled_dot_product_attention`` costs milliseconds per single-token call, a
bmm + softmax over ``[kv_heads, batch, group, tokens]`` costs microseconds. Prefill chunks
go to the kernels' ``prefill_attention``: the native backend attends all of a step's chunks
in one flash-style call that reads the context straight from the block tables; the torch
backend runs SDPA one request at a time, gathering the earlier context from the cache when
a chunk does not start at position 0.

Everything here is built once per step and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.model.runtime.kv_cache import PagedKVCache
from engine.model.spec import ModelSpec

if TYPE_CHECKING:
    from engine.model.kernels.base import TorchKernels


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


def paged_attention(
    layer: int,
    qkv: torch.Tensor,
    spec: ModelSpec,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
    kernels: TorchKernels,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend every row to its context.

    ``qkv`` is the rotated ``[tokens, q_size + 2 * kv_size]`` projection output.
    Returns ``[tokens, heads * head_dim]``. ``meta`` is the step's; the layer reads its KV
    group's block tables.
    """
    meta = meta.for_layer(layer)
    kernels.write_kv(cache, layer, qkv, meta.slots, spec)
    if meta.varlen is not None:  # the whole batch in one launch
        return kernels.varlen_attention(cache, layer, qkv, meta, spec, scale)
    parts: list[torch.Tensor] = []
    if meta.num_decodes:
        decodes = qkv[: meta.num_decodes]
        parts.append(kernels.decode_attention(cache, layer, decodes, meta, spec, scale))
    if meta.prefills:
        parts.append(kernels.prefill_attention(cache, layer, qkv, meta, spec, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def split_heads(
    qkv: torch.Tensor, spec: ModelSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of a qkv tensor's query ``[tokens, heads, head_dim]`` and key and value
    ``[tokens, kv_heads, head_dim]`` heads (queries, then keys, then values in each row)."""
    tokens = qkv.shape[0]
    query = qkv[:, : spec.q_size].view(tokens, spec.num_heads, spec.head_dim)
    kv = qkv[:, spec.q_size :].view(tokens, 2, spec.num_kv_heads, spec.head_dim)
    return query, kv[:, 0], kv[:, 1]


def decode_attention_torch(
    layer: int, query: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Decode attention in torch: gather the padded block tables, then two batched matmuls.

    ``query`` is ``[num_decodes, heads, head_dim]``; returns ``[num_decodes, heads * head_dim]``.
    """
    assert meta.decode_block_table is not None and meta.decode_context_lens is not None
    batch, heads, head_dim = query.shape
    keys, values = cache.gather(layer, meta.decode_block_table.view(-1))
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    # One flat batch of (kv head, request) pairs: [kv_heads * batch, group, head_dim] queries
    # against [kv_heads * batch, tokens, head_dim] keys. Explicit 3-D bmm avoids the extra
    # copies matmul makes for 4-D operands.
    keys = keys.view(kv_heads * batch, -1, head_dim)
    values = values.view(kv_heads * batch, -1, head_dim)
    grouped = query.view(batch, kv_heads, group, head_dim).transpose(0, 1) * scale
    scores = torch.bmm(grouped.reshape(kv_heads * batch, group, head_dim), keys.transpose(1, 2))
    padding = meta.decode_padding(scores.shape[-1])
    scores.view(kv_heads, batch, group, -1).masked_fill_(padding[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    out = torch.bmm(probs, values).view(kv_heads, batch, group, head_dim)
    return out.transpose(0, 1).reshape(batch, heads * head_dim)


def prefill_attention_torch(
    layer: int,
    qkv: torch.Tensor,
    spec: ModelSpec,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Prefill attention in torch: SDPA per chunk. Returns ``[prefill rows, heads * head_dim]``."""
    query, key, value = split_heads(qkv, spec)
    parts = [
        _prefill_attention(layer, query, key, value, cache, span, scale) for span in meta.prefills
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _prefill_attention(
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    span: PrefillSpan,
    scale: float,
) -> torch.Tensor:
    q = query[span.start : span.end].transpose(0, 1).unsqueeze(0)
    mask = None
    if span.num_computed == 0:
        # The whole context is this chunk: use the fresh K/V, no cache read needed.
        k = key[span.start : span.end].transpose(0, 1).unsqueeze(0)
        v = value[span.start : span.end].transpose(0, 1).unsqueeze(0)
    else:
        context = span.num_computed + (span.end - span.start)
        keys, values = cache.gather(layer, span.block_ids)
        k = keys[:, :context].unsqueeze(0)
        v = values[:, :context].unsqueeze(0)
        query_pos = torch.arange(span.num_computed, context, device=q.device).unsqueeze(1)
        mask = torch.arange(context, device=q.device).unsqueeze(0) <= query_pos
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1).reshape(span.end - span.start, -1)
