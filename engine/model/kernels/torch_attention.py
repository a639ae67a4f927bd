"""Paged attention in eager PyTorch: the reference every other backend is checked against,
and where they defer for what their kernels do not take.

Every ``AttentionParams`` is implemented exactly (scale, sliding window, soft-cap, sinks).
Decode rows are attended in one batched matmul over their gathered, padded block tables:
torch's CPU ``scaled_dot_product_attention`` costs milliseconds per single-token call, a
bmm + softmax over ``[kv_heads, batch, group, tokens]`` costs microseconds. Prefill chunks
run one request at a time (SDPA where there is no soft-cap or sink), gathering the earlier
context from the cache when a chunk does not start at position 0. A sliding layer gathers
only the blocks that hold keys inside some query's window, so its work is bounded by the
window and blocks wholly before it are never read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.kernels.metadata import AttentionMetadata, PrefillSpan, VarlenTables
from engine.model.kernels.params import AttentionParams
from engine.model.runtime.kv_cache import PagedKVCache
from engine.model.spec import ModelSpec


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
    layer: int,
    query: torch.Tensor,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    params: AttentionParams,
) -> torch.Tensor:
    """Decode attention: gather the block tables, then two batched matmuls.

    ``query`` is ``[num_decodes, heads, head_dim]``; returns ``[num_decodes, heads * head_dim]``.
    """
    table, hidden = _decode_keys(meta, params.window, cache.block_size)
    batch, heads, head_dim = query.shape
    keys, values = cache.gather(layer, table.reshape(-1))
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    # One flat batch of (kv head, request) pairs: [kv_heads * batch, group, head_dim] queries
    # against [kv_heads * batch, tokens, head_dim] keys. Explicit 3-D bmm avoids the extra
    # copies matmul makes for 4-D operands.
    keys = keys.view(kv_heads * batch, -1, head_dim)
    values = values.view(kv_heads * batch, -1, head_dim)
    grouped = query.view(batch, kv_heads, group, head_dim).transpose(0, 1) * params.scale
    scores = torch.bmm(grouped.reshape(kv_heads * batch, group, head_dim), keys.transpose(1, 2))
    scores = _soft_cap(scores, params.softcap).view(kv_heads, batch, group, -1)
    scores.masked_fill_(hidden[:, None, :], float("-inf"))
    sinks = None if params.sinks is None else params.sinks.view(kv_heads, 1, group, 1)
    probs = _softmax(scores, sinks).to(values.dtype).view(kv_heads * batch, group, -1)
    out = torch.bmm(probs, values).view(kv_heads, batch, group, head_dim)
    return out.transpose(0, 1).reshape(batch, heads * head_dim)


def _decode_keys(
    meta: AttentionMetadata, window: int | None, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block table to gather and the mask of the keys it yields that no row sees."""
    table = meta.decode_block_table
    assert table is not None
    keys = table.shape[1] * block_size
    if window is None or keys <= window:  # no row's context reaches past its window
        return table, meta.decode_padding(keys)
    sliding = meta.decode_window(window, block_size)
    return sliding.block_table, sliding.hidden


def prefill_attention_torch(
    layer: int,
    qkv: torch.Tensor,
    spec: ModelSpec,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    params: AttentionParams,
) -> torch.Tensor:
    """Prefill attention, one chunk at a time. Returns ``[prefill rows, heads * head_dim]``."""
    query, key, value = split_heads(qkv, spec)
    parts = [
        _span_attention(layer, query, key, value, cache, span, params) for span in meta.prefills
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def varlen_attention_torch(
    layer: int,
    qkv: torch.Tensor,
    spec: ModelSpec,
    cache: PagedKVCache,
    tables: VarlenTables,
    params: AttentionParams,
) -> torch.Tensor:
    """Every sequence of a varlen step (after ``write_kv``), one at a time: what a backend
    whose varlen kernel lacks a parameter defers to. Reads the tables on the host."""
    query, key, value = split_heads(qkv, spec)
    starts = tables.query_starts.tolist()
    lengths = tables.seq_lens.tolist()
    size = cache.block_size
    parts = []
    for index, context in enumerate(lengths):
        start, end = starts[index], starts[index + 1]
        if context == 0:  # a padding row: attends nothing
            parts.append(qkv.new_zeros(end - start, spec.q_size))
            continue
        blocks = tables.block_table[index, : -(-context // size)]
        span = PrefillSpan(start, end, context - (end - start), blocks)
        parts.append(_span_attention(layer, query, key, value, cache, span, params))
    return torch.cat(parts, dim=0)


def _span_attention(
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    span: PrefillSpan,
    params: AttentionParams,
) -> torch.Tensor:
    """Rows ``[span.start, span.end)`` attend causally to the ``span.num_computed`` cached
    tokens before them and to each other; ``[rows, heads * head_dim]``."""
    rows = span.end - span.start
    context = span.num_computed + rows
    q = query[span.start : span.end].transpose(0, 1).unsqueeze(0)
    first = _first_key(span.num_computed, params.window, cache.block_size)
    if span.num_computed == 0 and cache.holds_exact_kv:
        # The whole context is this chunk: use the fresh K/V, no cache read needed. (A
        # quantized or narrower cache is read back instead, so that a prompt attends to the
        # same keys whether its prefix was computed now or found in the prefix cache.)
        k = key[span.start : span.end].transpose(0, 1).unsqueeze(0)
        v = value[span.start : span.end].transpose(0, 1).unsqueeze(0)
    else:
        keys, values = cache.gather(layer, span.block_ids[first // cache.block_size :])
        k = keys[:, : context - first].unsqueeze(0)
        v = values[:, : context - first].unsqueeze(0)
    mask = _visible(span.num_computed, context, first, params.window, q.device)
    if params.softcap is None and params.sinks is None:
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=params.scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    else:
        causal = mask if mask is not None else _visible_always(rows, q.device)
        out = _explicit_attention(q, k, v, causal, params)
    return out[0].transpose(0, 1).reshape(rows, -1)


def _first_key(num_computed: int, window: int | None, block_size: int) -> int:
    """The first key position a chunk starting at ``num_computed`` needs, rounded down to
    its block: 0 without a window; else the first query's window start."""
    if window is None or num_computed == 0:
        return 0
    return max(0, num_computed - window + 1) // block_size * block_size


def _visible(
    num_computed: int, context: int, first: int, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """``[rows, context - first]``, True where query ``num_computed + i`` sees key
    ``first + j``; None for a fresh chunk with full attention (SDPA's own causal mask)."""
    if num_computed == 0 and window is None:
        return None
    query_pos = torch.arange(num_computed, context, device=device).unsqueeze(1)
    key_pos = torch.arange(first, context, device=device).unsqueeze(0)
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    return visible


def _visible_always(rows: int, device: torch.device) -> torch.Tensor:
    return torch.ones(rows, rows, dtype=torch.bool, device=device).tril()


def _explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    params: AttentionParams,
) -> torch.Tensor:
    """Attention as transformers' eager path computes it: ``q k^T * scale``, soft-cap,
    mask, softmax in float32 (with the sinks in its denominator), ``p v``.
    ``q`` ``[1, heads, rows, d]``, ``k``/``v`` ``[1, kv_heads, keys, d]``."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * params.scale
    scores = _soft_cap(scores, params.softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    sinks = None if params.sinks is None else params.sinks.view(1, -1, 1, 1)
    return torch.matmul(_softmax(scores, sinks).to(v.dtype), v)


def _soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    if softcap is None:
        return scores
    return torch.tanh(scores / softcap) * softcap


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Float32 softmax over the last dim; each sink (broadcast over the last dim) joins
    the denominator as one more logit and is dropped from the result."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    logits = scores.to(torch.float32)
    sink_column = sinks.to(torch.float32).expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([logits, sink_column], dim=-1), dim=-1)[..., :-1]
