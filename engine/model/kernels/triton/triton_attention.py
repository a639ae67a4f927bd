"""Paged attention in Triton: one kernel for decode rows and prefill/extend chunks.

Every program owns one sequence's tile of query tokens for one KV head (all the query
heads that share it, so each K/V tile is read once per group) and, optionally, one slice
of the sequence's keys. It walks the keys in tiles straight through the block table: a
key at position ``p`` lives at ``block_table[seq, p // block_size]``, row ``p %
block_size``, so any block size (1 included) works and nothing is gathered into a padded
copy. Scores use an online softmax (running max and sum in float32); query token ``t`` of
a chunk sits at position ``seq_len - query_len + t`` and sees keys up to there (causal).

Quantized caches (int8, fp8 stored as uint8) are read in their storage type and scaled on
the fly: K's per-token scale multiplies the scores, V's multiplies the probabilities
before the second matmul, which is the same sum as dequantizing first.

Three per-layer variants, each compiled in only when used: a sliding ``window`` (a query
at position ``q`` sees keys ``(q - window, q]``; a program starts at its first token's
window, so the blocks before it, which the KV manager may have freed, are never read, and
the work is bounded by the window), logit soft-capping (``softcap * tanh(s / softcap)`` of
each scaled score, before the masks) and ``sinks`` (a per-head logit that joins the softmax
denominator: the first split starts its running max at the sink and its sum at 1).

Long decodes can be split over the context (``num_splits > 1``): each split writes an
unnormalised partial output with its max and sum, and a small reduce kernel merges them.
A split's range is derived on the device from the sequence's length, so a launch with a
fixed grid (a CUDA graph) stays correct whatever the lengths are; padded sequences of
length 0 write zeros and read nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)
# Keys per inner-loop tile and the minimum rows of a tile: tl.dot needs 16 on the GPU.
KEY_TILE = 32
MIN_ROWS = 16
PREFILL_ROWS = 64
# Storage formats of the KV cache, as the kernels see them.
KV_PLAIN, KV_INT8, KV_FP8 = 0, 1, 2


def kv_format(cache: torch.Tensor) -> int:
    """The kernels' format code for a cache tensor (fp8 is stored as uint8)."""
    if cache.dtype == torch.int8:
        return KV_INT8
    if cache.dtype == torch.uint8:
        return KV_FP8
    return KV_PLAIN


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _load_kv_tile(cache, base, offsets, mask, KV_FORMAT: tl.constexpr, DTYPE):
    """A K or V tile in ``DTYPE``: quantized values are converted, not yet scaled."""
    raw = tl.load(cache + base + offsets, mask=mask, other=0)
    if KV_FORMAT == 2:
        raw = raw.to(tl.float8e4nv, bitcast=True)
    return raw.to(DTYPE)


@triton.jit
def _key_scales(scales, scale_base, key_mask, KV_FORMAT: tl.constexpr):
    if KV_FORMAT == 0:
        return tl.full(scale_base.shape, 1.0, tl.float32)
    return tl.load(scales + scale_base, mask=key_mask, other=0.0)


@triton.jit
def _soft_cap(scores, limit):
    """``limit * tanh(scores / limit)``, as ``(1 - e) / (1 + e)`` with ``e = exp(-2|y|)``:
    ``e`` stays in [0, 1], so no score overflows it."""
    e = tl.exp(tl.abs(scores) * (-2.0 / limit))
    capped = limit * ((1.0 - e) / (1.0 + e))
    return tl.where(scores < 0, -capped, capped)


@triton.jit
def _unified_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache,
    value_cache,
    key_scales,
    value_scales,
    block_table,
    seq_lens,
    query_starts,
    partial_out,
    partial_max,
    partial_sum,
    sinks,
    scale_log2,
    window,
    softcap_log2,
    tiles_per_seq,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_head,
    stride_c_block,
    stride_c_tok,
    stride_s_head,
    stride_s_block,
    stride_table,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    KEY_TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    ONE_QUERY_PER_SEQ: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    seq = tl.program_id(0) // tiles_per_seq
    tile = tl.program_id(0) % tiles_per_seq
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if ONE_QUERY_PER_SEQ:
        query_start = seq
        query_len = 1
    else:
        query_start = tl.load(query_starts + seq)
        query_len = tl.load(query_starts + seq + 1) - query_start
    if tile * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens + seq)
    prefix = seq_len - query_len

    # Rows are (query token, query head of this KV head's group) pairs.
    rows = tl.arange(0, BLOCK_M * GROUP_P)
    token = tile * BLOCK_M + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    row_valid = (token < query_len) & (rows % GROUP_P < GROUP)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM
    q_offsets = (query_start + token) * stride_q_tok + head * stride_q_head
    query = tl.load(
        query_ptr + q_offsets[:, None] + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    compute_dtype = tl.float32 if UPCAST_DOT else query_ptr.dtype.element_ty
    query = query.to(compute_dtype)
    query_pos = prefix + token

    # Causal: this tile's last token sees keys [0, prefix + last token]; with a window its
    # first token sees none before kv_start. A split takes a KEY_TILE-aligned share of the
    # range.
    kv_end = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)
    if USE_WINDOW:
        kv_start = tl.maximum(prefix + tile * BLOCK_M - window + 1, 0)
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), KEY_TILE) * KEY_TILE
        kv_lo = kv_start + split * per_split
    else:
        per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), KEY_TILE) * KEY_TILE
        kv_lo = split * per_split
    kv_hi = tl.minimum(kv_end, kv_lo + per_split)

    if USE_SINKS:
        # The sink is one more logit of the softmax, with no value: counted once, by split 0,
        # as a running max at the sink and a sum of exp(sink - sink) = 1. A sink of -inf
        # (padding rows, other splits) weighs nothing.
        sink = tl.load(sinks + head, mask=row_valid, other=float("-inf")).to(tl.float32)
        run_max = tl.where(split == 0, sink * _LOG2E, float("-inf"))
        run_sum = tl.where(run_max > float("-inf"), 1.0, 0.0)
    else:
        run_max = tl.full([BLOCK_M * GROUP_P], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_M * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_P, HEAD_DIM_P], tl.float32)
    key_offsets = tl.arange(0, KEY_TILE)
    for start in range(kv_lo, kv_hi, KEY_TILE):
        key_pos = start + key_offsets
        key_valid = key_pos < kv_hi
        block = tl.load(
            block_table + seq * stride_table + key_pos // BLOCK_SIZE, mask=key_valid, other=0
        ).to(tl.int64)
        in_block = key_pos % BLOCK_SIZE
        base = kv_head * stride_c_head + block * stride_c_block + in_block * stride_c_tok
        scale_base = kv_head * stride_s_head + block * stride_s_block + in_block
        tile_mask = key_valid[None, :] & dim_valid[:, None]
        keys_t = _load_kv_tile(
            key_cache, base[None, :], dims[:, None], tile_mask, KV_FORMAT, compute_dtype
        )
        scores = tl.dot(query, keys_t, input_precision=DOT_PRECISION)
        scores *= _key_scales(key_scales, scale_base, key_valid, KV_FORMAT)[None, :] * scale_log2
        if USE_SOFTCAP:
            scores = _soft_cap(scores, softcap_log2)
        visible = key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
        if USE_WINDOW:
            visible &= key_pos[None, :] > query_pos[:, None] - window
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        # A row that has seen no key yet keeps -inf: shift by 0 instead (no inf - inf).
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - shift[:, None])
        alpha = tl.exp2(run_max - shift)
        run_sum = run_sum * alpha + tl.sum(probs, axis=1)
        run_max = new_max
        probs *= _key_scales(value_scales, scale_base, key_valid, KV_FORMAT)[None, :]
        values = _load_kv_tile(
            value_cache,
            base[:, None],
            dims[None, :],
            key_valid[:, None] & dim_valid[None, :],
            KV_FORMAT,
            compute_dtype,
        )
        acc = acc * alpha[:, None] + tl.dot(
            probs.to(compute_dtype), values, input_precision=DOT_PRECISION
        )

    store_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(run_sum > 0, run_sum, 1.0)[:, None]
        o_offsets = (query_start + token) * stride_o_tok + head * stride_o_head
        tl.store(
            out_ptr + o_offsets[:, None] + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        # Partials are [tokens, heads, NUM_SPLITS(, HEAD_DIM_P)], contiguous.
        num_heads = tl.num_programs(1) * GROUP
        slot = ((query_start + token) * num_heads + head) * NUM_SPLITS + split
        tl.store(partial_max + slot, run_max, mask=row_valid)
        tl.store(partial_sum + slot, run_sum, mask=row_valid)
        tl.store(partial_out + slot[:, None] * HEAD_DIM_P + dims[None, :], acc, mask=store_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    partial_out,
    partial_max,
    partial_sum,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    first = (token * tl.num_programs(1) + head) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    maxes = tl.load(partial_max + first + splits)
    sums = tl.load(partial_sum + first + splits)
    overall = tl.max(maxes, axis=0)
    overall = tl.where(overall == float("-inf"), 0.0, overall)
    weights = tl.exp2(maxes - overall)  # an empty split (-inf) weighs 0
    total = tl.sum(weights * sums, axis=0)
    dims = tl.arange(0, HEAD_DIM_P)
    parts = tl.load(
        partial_out + (first + splits)[:, None] * HEAD_DIM_P + dims[None, :],
        mask=(dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    merged = tl.sum(parts * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + token * stride_o_tok + head * stride_o_head + dims,
        merged.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@dataclass
class SplitWorkspace:
    """Float32 scratch for split-context partials: ``out`` is ``[tokens, heads, splits,
    head_dim_p]``, ``max``/``sum`` ``[tokens, heads, splits]``. Preallocate one for the
    largest batch when the launch is captured in a CUDA graph."""

    out: torch.Tensor
    max: torch.Tensor
    sum: torch.Tensor

    @classmethod
    def allocate(
        cls, tokens: int, heads: int, splits: int, head_dim: int, device: torch.device
    ) -> SplitWorkspace:
        padded = padded_head_dim(head_dim)
        return cls(
            out=torch.empty(tokens, heads, splits, padded, dtype=torch.float32, device=device),
            max=torch.empty(tokens, heads, splits, dtype=torch.float32, device=device),
            sum=torch.empty(tokens, heads, splits, dtype=torch.float32, device=device),
        )

    def fits(self, tokens: int, heads: int, splits: int) -> bool:
        return self.max.shape[0] >= tokens and self.max.shape[1:] == (heads, splits)


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int, max_splits: int = 16
) -> int:
    """Context splits for a decode batch: enough programs to fill the device when there are
    few (sequence, KV head) pairs, never slices shorter than ~4 key tiles. A power of two."""
    programs = max(1, num_seqs * num_kv_heads)
    by_occupancy = -(-2 * num_sms // programs)
    by_length = max(1, max_context // (4 * KEY_TILE))
    splits = max(1, min(max_splits, by_occupancy, by_length))
    return 1 << (splits.bit_length() - 1)


def unified_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    query_starts: torch.Tensor | None = None,
    max_query_len: int = 1,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    num_splits: int = 1,
    workspace: SplitWorkspace | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend every query row to its sequence's paged context; returns ``out``.

    ``query`` and ``out`` are ``[tokens, heads, head_dim]`` (any token/head strides, the
    last dimension contiguous). Caches are ``[kv_heads, blocks, block_size, head_dim]``,
    scales (int8/fp8 caches) ``[kv_heads, blocks, block_size]``. Sequence ``i`` has
    ``seq_lens[i]`` keys (its new tokens included, already written) in the blocks listed
    by ``block_table[i]``. With ``query_starts`` (``[seqs + 1]`` row offsets) sequence
    ``i`` owns rows ``[query_starts[i], query_starts[i+1])``, at most ``max_query_len``;
    without it row ``i`` is sequence ``i``'s one decode token.

    ``window`` > 0: a query at position ``q`` sees keys ``(q - window, q]`` only, and the
    table's entries for blocks wholly before its window are never read (they may be
    placeholders). ``softcap`` > 0 caps every scaled score ``s`` to ``softcap * tanh(s /
    softcap)``. ``sinks`` (float32 ``[heads]``) adds ``exp(sinks[h])`` to head ``h``'s
    softmax denominator.
    """
    tokens, heads, head_dim = query.shape
    kv_heads, _, block_size, _ = key_cache.shape
    num_seqs = block_table.shape[0]
    group = heads // kv_heads
    group_p = triton.next_power_of_2(group)
    one_query = query_starts is None
    block_m = _block_m(group_p, one_query)
    tiles = 1 if one_query else triton.cdiv(max_query_len, block_m)
    if num_splits > 1 and (workspace is None or not workspace.fits(tokens, heads, num_splits)):
        workspace = SplitWorkspace.allocate(tokens, heads, num_splits, head_dim, query.device)
    if num_splits == 1:
        workspace = None
    # Without splits the partial pointers are never read: pass ``out`` as a placeholder.
    partial = (workspace.out, workspace.max, workspace.sum) if workspace else (out, out, out)
    scales = key_scale if key_scale is not None else key_cache
    upcast = interpreting() or query.dtype == torch.float32
    _unified_attention_kernel[(num_seqs * tiles, kv_heads, num_splits)](
        out,
        query,
        key_cache,
        value_cache,
        scales,
        value_scale if value_scale is not None else value_cache,
        block_table,
        seq_lens,
        query_starts if query_starts is not None else seq_lens,
        *partial,
        sinks if sinks is not None else seq_lens,  # a placeholder pointer without sinks
        scale * LOG2E,
        window,
        softcap * LOG2E,
        tiles,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *key_cache.stride()[:3],
        *(scales.stride()[:2] if key_scale is not None else (0, 0)),
        block_table.stride(0),
        GROUP=group,
        GROUP_P=group_p,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=padded_head_dim(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        KEY_TILE=KEY_TILE,
        NUM_SPLITS=num_splits,
        ONE_QUERY_PER_SEQ=one_query,
        KV_FORMAT=kv_format(key_cache),
        UPCAST_DOT=upcast,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        USE_WINDOW=window > 0,
        USE_SOFTCAP=softcap > 0,
        USE_SINKS=sinks is not None,
    )
    if num_splits > 1:
        _merge_splits_kernel[(tokens, heads)](
            out,
            *partial,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_P=padded_head_dim(head_dim),
            NUM_SPLITS=num_splits,
        )
    return out


def padded_head_dim(head_dim: int) -> int:
    """The head dimension as the kernels tile it: a power of two, at least 16 (tl.dot)."""
    return max(MIN_ROWS, triton.next_power_of_2(head_dim))


def _block_m(group_p: int, one_query: bool) -> int:
    """Query tokens per tile: enough rows for tl.dot, more for a prefill chunk."""
    rows = MIN_ROWS if one_query else PREFILL_ROWS
    return max(1, rows // group_p)
