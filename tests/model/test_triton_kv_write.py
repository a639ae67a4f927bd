"""The Triton KV write stores exactly what the torch reference (``PagedKVCache.write``)
stores, for every cache dtype; under TRITON_INTERPRET on the CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.model.triton_setup import DEVICE  # isort: skip  (sets TRITON_INTERPRET first)
from engine.kv.accounting import KVShape
from engine.model.kernels.triton.triton_kv_write import write_kv
from engine.model.runtime.kv_cache import KVPool, KVPoolLayout, PagedKVCache

HEADS, KV_HEADS = 4, 2


def make_cache(kv_dtype: str, block_size: int, head_dim: int, num_blocks: int) -> PagedKVCache:
    shape = KVShape(1, KV_HEADS, head_dim, kv_dtype)
    pool = KVPool(KVPoolLayout(shape, num_blocks, block_size), DEVICE)
    return PagedKVCache(pool, torch.float32)


def fused_qkv(tokens: int, head_dim: int, dtype: torch.dtype, pad: int = 0) -> torch.Tensor:
    """A [tokens, q + 2 kv] qkv whose rows sit ``pad`` columns apart in memory (strided)."""
    width = (HEADS + 2 * KV_HEADS) * head_dim
    generator = torch.Generator().manual_seed(tokens * 31 + head_dim)
    wide = torch.randn(tokens, width + pad, generator=generator) * 3
    wide[0, HEADS * head_dim] = 0.5  # a value exactly between two int8 steps after scaling
    return wide.to(dtype=dtype, device=DEVICE)[:, :width]


def cache_bytes(cache: PagedKVCache) -> list[torch.Tensor]:
    return [t.cpu() for t in cache.pool.tensors()]


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16", "int8", "fp8"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("head_dim", [16, 24])
def test_write_matches_torch_reference_bit_for_bit(kv_dtype, block_size, head_dim):
    dtype = torch.float32 if kv_dtype in ("float32", "int8", "fp8") else getattr(torch, kv_dtype)
    num_blocks = 64 // block_size + 2
    qkv = fused_qkv(11, head_dim, dtype, pad=8)
    # Scattered slots, one of them inside a partly filled block; -1 marks a padding row.
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(3))
    slots = slots[:11].to(DEVICE)
    slots[4] = -1
    expected = make_cache(kv_dtype, block_size, head_dim, num_blocks)
    kept = slots >= 0
    kv = qkv[kept, HEADS * head_dim :].reshape(-1, 2, KV_HEADS, head_dim)
    expected.write(0, kv[:, 0], kv[:, 1], slots[kept])
    actual = make_cache(kv_dtype, block_size, head_dim, num_blocks)
    key, value = actual.layer(0)
    key_scale, value_scale = actual.layer_scales(0)
    write_kv(qkv, slots, key, value, HEADS, key_scale, value_scale)
    for got, want in zip(cache_bytes(actual), cache_bytes(expected), strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_write_touches_only_the_given_slots():
    cache = make_cache("bfloat16", 4, 16, 8)
    for tensor in cache.pool.tensors():
        tensor.fill_(7)
    qkv = fused_qkv(3, 16, torch.bfloat16)
    slots = torch.tensor([5, -1, 30], device=DEVICE)
    key, value = cache.layer(0)
    write_kv(qkv, slots, key, value, HEADS)
    flat_key = key.reshape(KV_HEADS, -1, 16).cpu()
    written = torch.zeros(flat_key.shape[1], dtype=torch.bool)
    written[[5, 30]] = True
    assert (flat_key[:, ~written] == 7).all()
    assert torch.equal(
        flat_key[:, 30], qkv[2, HEADS * 16 : (HEADS + KV_HEADS) * 16].cpu().view(2, 16)
    )
