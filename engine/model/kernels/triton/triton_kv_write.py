"""The KV write in Triton: each new token's key and value heads into its paged cache slot.

One program per (token, KV head) reads the head straight out of the fused qkv row and
stores it at ``slot // block_size, slot % block_size`` of the layer's
``[kv_heads, blocks, block_size, head_dim]`` cache. Quantized caches get the same values
``PagedKVCache.write`` computes: a float32 scale of ``absmax / quant_max`` per (token,
head) and the head divided by it, rounded half to even and clamped (int8) or converted
to float8 e4m3 (fp8, stored as uint8). A negative slot is skipped, so a padded batch (a
CUDA graph's) writes nothing for its padding rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.kernels.triton.triton_attention import KV_FP8, KV_INT8, kv_format, padded_head_dim

_QUANT_MAX = {KV_INT8: 127.0, KV_FP8: 448.0}


@triton.jit
def _round_half_even(x):
    rounded = tl.floor(x + 0.5)
    tie = (rounded - x) == 0.5
    odd = (rounded - 2.0 * tl.floor(rounded * 0.5)) != 0.0
    return tl.where(tie & odd, rounded - 1.0, rounded)


@triton.jit
def _round_to_e4m3(x):
    """``x`` rounded half to even onto the float8 e4m3 grid, still in float32.

    Why by hand: the final conversion is then exact, whatever the backend's rounding (the
    Triton 3.9 interpreter drops the carry when a mantissa rounds up into the next power
    of two: 125.4 became 64, not 128)."""
    bits = x.to(tl.int32, bitcast=True)
    # Keep 3 of float32's 23 mantissa bits: add just under half of the dropped part, plus
    # the kept part's lowest bit (ties to even), then clear the dropped bits.
    lowest_kept = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lowest_kept) & -0x100000).to(tl.float32, bitcast=True)
    # Below e4m3's smallest normal (2^-6) the grid is fixed: multiples of 2^-9.
    subnormal = _round_half_even(x * 512.0) / 512.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _store_head(
    cache,
    scales,
    cache_offset,
    scale_offset,
    head,
    dims,
    dim_valid,
    KV_FORMAT: tl.constexpr,
    QUANT_MAX: tl.constexpr,
):
    if KV_FORMAT == 0:
        tl.store(cache + cache_offset + dims, head.to(cache.dtype.element_ty), mask=dim_valid)
    else:
        wide = head.to(tl.float32)
        absmax = tl.maximum(tl.max(tl.where(dim_valid, tl.abs(wide), 0.0), axis=0), 1e-8)
        scale = absmax / QUANT_MAX
        scaled = wide / scale
        if KV_FORMAT == 1:
            stored = tl.minimum(tl.maximum(_round_half_even(scaled), -127.0), 127.0).to(tl.int8)
        else:
            stored = _round_to_e4m3(scaled).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(cache + cache_offset + dims, stored, mask=dim_valid)
        tl.store(scales + scale_offset, scale)


@triton.jit
def _write_kv_kernel(
    qkv_ptr,
    slots_ptr,
    key_cache,
    value_cache,
    key_scales,
    value_scales,
    stride_qkv,
    key_offset,
    value_offset,
    stride_c_head,
    stride_c_block,
    stride_c_tok,
    stride_s_head,
    stride_s_block,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    QUANT_MAX: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM
    row = qkv_ptr + token.to(tl.int64) * stride_qkv + kv_head * HEAD_DIM + dims
    key = tl.load(row + key_offset, mask=dim_valid, other=0.0)
    value = tl.load(row + value_offset, mask=dim_valid, other=0.0)
    cache_offset = kv_head * stride_c_head + block * stride_c_block + in_block * stride_c_tok
    scale_offset = kv_head * stride_s_head + block * stride_s_block + in_block
    _store_head(
        key_cache,
        key_scales,
        cache_offset,
        scale_offset,
        key,
        dims,
        dim_valid,
        KV_FORMAT,
        QUANT_MAX,
    )
    _store_head(
        value_cache,
        value_scales,
        cache_offset,
        scale_offset,
        value,
        dims,
        dim_valid,
        KV_FORMAT,
        QUANT_MAX,
    )


def write_kv(
    qkv: torch.Tensor,
    slots: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_heads: int,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """Store the key/value heads of every ``qkv`` row (``[tokens, (heads + 2 * kv_heads) *
    head_dim]``, queries first, rows may be strided) at its flat ``slots`` entry of one
    layer's caches (``[kv_heads, blocks, block_size, head_dim]``; scales ``[kv_heads,
    blocks, block_size]`` for int8/fp8). Rows with a negative slot are skipped."""
    kv_heads, _, block_size, head_dim = key_cache.shape
    tokens = slots.shape[0]
    if tokens == 0:
        return
    assert qkv.stride(1) == 1, "qkv rows must be contiguous"
    fmt = kv_format(key_cache)
    quantized = key_scale is not None and value_scale is not None
    assert quantized == (fmt != 0), "int8/fp8 caches need their scales, others none"
    scale_strides = key_scale.stride()[:2] if key_scale is not None else (0, 0)
    key_offset = num_heads * head_dim
    _write_kv_kernel[(tokens, kv_heads)](
        qkv,
        slots,
        key_cache,
        value_cache,
        key_scale if key_scale is not None else key_cache,
        value_scale if value_scale is not None else value_cache,
        qkv.stride(0),
        key_offset,
        key_offset + kv_heads * head_dim,
        *key_cache.stride()[:3],
        *scale_strides,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=padded_head_dim(head_dim),
        BLOCK_SIZE=block_size,
        KV_FORMAT=fmt,
        QUANT_MAX=_QUANT_MAX.get(fmt, 1.0),
    )
