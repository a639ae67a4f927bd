"""Quantized KV caches (int8, fp8 with per-token-head scales): bounded logit error with
either kernel backend, and pool sizes exactly as engine/kv/accounting.py counts them."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.kv import accounting
from engine.model.loader import model_from_reference
from engine.model.runtime.kv_cache import KVPool, KVPoolLayout
from tests.model.engine_helpers import greedy, make_core, run_all
from tests.model.paged import BlockTables, make_cache, run_step

# Max |logit error| relative to the logits' spread, decode through the quantized cache.
RELATIVE_BOUND = {"int8": 0.05, "fp8": 0.2, "bfloat16": 0.03, "float16": 0.005}


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16", "int8", "fp8"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_pool_bytes_match_accounting(kv_dtype, block_size):
    shape = accounting.KVShape(num_layers=3, num_kv_heads=2, head_dim=8, kv_dtype=kv_dtype)
    pool = KVPool(KVPoolLayout(shape, num_blocks=7, block_size=block_size), torch.device("cpu"))
    assert pool.nbytes == accounting.allocated_bytes(shape, 7, block_size)


def decode_logits(model, kv_dtype: str, prompts, steps: int) -> torch.Tensor:
    """Prefill (first chunk in full precision, second chunk reading the cache), then
    ``steps`` batched greedy-free decode steps with fixed tokens; all logits stacked."""
    cache = make_cache(model, num_blocks=128, block_size=4, kv_dtype=kv_dtype)
    tables = BlockTables(128, seed=1)
    blocks = [tables.allocate(len(p) + steps, 4) for p in prompts]
    half = [len(p) // 2 for p in prompts]
    run_step(model, cache, [p[:h] for p, h in zip(prompts, half, strict=True)], [0, 0], blocks)
    outputs = [
        run_step(model, cache, [p[h:] for p, h in zip(prompts, half, strict=True)], half, blocks)
    ]
    lengths = [len(p) for p in prompts]
    for step in range(steps):
        outputs.append(run_step(model, cache, [[3 + step], [7 + step]], lengths, blocks))
        lengths = [n + 1 for n in lengths]
    return torch.cat(outputs)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bfloat16", "float16"])
def test_quantized_cache_logit_error_is_bounded(tiny_llama_factory, kernels, kv_dtype):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    model = model_from_reference(reference).replace(kernels=kernels)
    prompts = [[5, 9, 17, 33, 65, 129, 7, 3, 2, 1, 99, 100], [11, 12, 13, 14, 15, 16]]
    exact = decode_logits(model, "float32", prompts, steps=8)
    approx = decode_logits(model, kv_dtype, prompts, steps=8)
    error = (approx - exact).abs().max().item()
    spread = exact.std().item()
    assert 0 < error < RELATIVE_BOUND[kv_dtype] * spread, (error, spread)
    # The quantized cache still ranks the top token the same almost everywhere.
    agree = (approx.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agree >= 0.9


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_swap_and_recompute_preserve_quantized_blocks_and_scales(
    tiny_llama_factory, kernels, kv_dtype
):
    """Greedy tokens with a quantized cache are the same with and without preemption:
    swaps move values and scales together."""
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    model = model_from_reference(reference).replace(kernels=kernels)
    prompts = {"a": [5, 9, 17, 33, 65, 129, 7, 3, 2, 1], "b": [42] * 15, "c": [8, 9, 10]}
    params = {rid: greedy(10) for rid in prompts}
    roomy = make_core(model, CacheConfig(num_device_blocks=64, block_size=2), kv_dtype=kv_dtype)
    expected = run_all(roomy, prompts, params)
    for mode in ("swap", "recompute"):
        scheduler = SchedulerConfig(max_model_len=32, preemption_mode=mode, swap_min_tokens=1)
        cache = CacheConfig(num_device_blocks=14, block_size=2, num_host_blocks=64, watermark=0)
        tight = make_core(model, cache, scheduler, kv_dtype=kv_dtype)
        assert run_all(tight, prompts, params) == expected
        assert sum(tight.stats().preemptions_total.values()) > 0
