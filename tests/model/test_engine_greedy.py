"""Greedy outputs through the real scheduler are token-identical to transformers,
with either kernel backend (the ``kernels`` fixture)."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.model.loader import model_from_reference
from tests.model.engine_helpers import greedy, make_core, reference_greedy, run_all

PROMPTS = {
    "a": [5, 9, 17, 33, 65, 129, 7, 3, 2, 1, 99, 100, 101],
    "b": [11, 12],
    "c": [200, 150, 100, 50, 25, 12, 6, 3],
    "d": [42] * 21,
}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tiny_llama_factory, kernels):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2, tie_embeddings=True)
    expected = {rid: reference_greedy(reference, p, MAX_TOKENS) for rid, p in PROMPTS.items()}
    return model_from_reference(reference).replace(kernels=kernels), expected


def params_for(prompts):
    return {rid: greedy(MAX_TOKENS) for rid in prompts}


@pytest.mark.parametrize("block_size", [1, 4, 7, 16])
def test_concurrent_mixed_lengths(tiny, block_size):
    model, expected = tiny
    core = make_core(model, CacheConfig(num_device_blocks=512, block_size=block_size))
    assert run_all(core, PROMPTS, params_for(PROMPTS)) == expected


@pytest.mark.parametrize("budget", [3, 8])
def test_chunked_prefill(tiny, budget):
    model, expected = tiny
    scheduler = SchedulerConfig(max_num_batched_tokens=budget, max_model_len=64)
    core = make_core(model, CacheConfig(num_device_blocks=256, block_size=4), scheduler)
    assert run_all(core, PROMPTS, params_for(PROMPTS)) == expected


def test_prefix_cache_hits(tiny):
    model, expected = tiny
    core = make_core(model, CacheConfig(num_device_blocks=256, block_size=4))
    run_all(core, {"a": PROMPTS["a"]}, params_for(["a"]))
    again = {"a2": PROMPTS["a"], "d2": PROMPTS["d"]}
    outputs = run_all(core, again, params_for(again))
    assert core.stats().prefix_cache_hits_total > 0
    assert outputs == {"a2": expected["a"], "d2": expected["d"]}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_tiny_block_budget(tiny, mode):
    model, expected = tiny
    scheduler = SchedulerConfig(max_model_len=64, preemption_mode=mode, swap_min_tokens=1)
    cache = CacheConfig(num_device_blocks=20, block_size=2, num_host_blocks=64, watermark=0.0)
    core = make_core(model, cache, scheduler)
    outputs = run_all(core, PROMPTS, params_for(PROMPTS))
    stats = core.stats()
    assert sum(stats.preemptions_total.values()) > 0, stats.preemptions_total
    if mode == "swap":
        assert stats.blocks_swapped_out_total > 0 and stats.blocks_swapped_in_total > 0
    assert outputs == expected
