"""The runner with several KV groups: each layer reads its group's block tables and its
slot of a shared page.

Two full-attention groups of one layer each keep the same history as one group of both,
so greedy tokens must equal transformers' through every path that moves blocks (prefix
hits, chunked prefill, recompute and swap preemption): any layer reading another group's
table or slot, or a block copied in one group only, changes them."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.kv.groups import KVGroup
from engine.model.loader import model_from_reference
from tests.model.engine_helpers import greedy, make_core, reference_greedy, run_all

PROMPTS = {
    "a": [5, 9, 17, 33, 65, 129, 7, 3, 2, 1, 99, 100, 101, 5, 9, 17, 33],
    "b": [5, 9, 17, 33, 65, 129, 7, 3, 2, 1, 11, 12],
    "c": [200, 150, 100, 50, 25, 12, 6, 3],
}
MAX_TOKENS = 10
SPLIT = (KVGroup((0,)), KVGroup((1,)))


@pytest.fixture(scope="module")
def tiny(tiny_llama_factory, kernels):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2, tie_embeddings=True)
    expected = {rid: reference_greedy(reference, p, MAX_TOKENS) for rid, p in PROMPTS.items()}
    return model_from_reference(reference).replace(kernels=kernels), expected


def test_the_pool_holds_one_slot_per_group_layer(tiny):
    model, _ = tiny
    core = make_core(model, CacheConfig(num_device_blocks=16, block_size=4), groups=SPLIT)
    pool = core.runner.device_pool  # type: ignore[attr-defined]
    assert pool.key.shape[0] == 1  # one layer per group: a page of one slot
    assert core.scheduler.kv.num_groups == 2


@pytest.mark.parametrize(
    ("cache", "scheduler"),
    [
        (CacheConfig(num_device_blocks=256, block_size=4), SchedulerConfig()),
        (
            CacheConfig(num_device_blocks=256, block_size=3),
            SchedulerConfig(max_num_batched_tokens=5),
        ),
        (
            CacheConfig(num_device_blocks=32, block_size=2, num_host_blocks=64, watermark=0.0),
            SchedulerConfig(max_model_len=64, preemption_mode="swap", swap_min_tokens=1),
        ),
        (
            CacheConfig(num_device_blocks=32, block_size=2, watermark=0.0),
            SchedulerConfig(max_model_len=64, preemption_mode="recompute"),
        ),
    ],
    ids=["plain", "chunked", "swap", "recompute"],
)
def test_two_full_groups_give_the_tokens_of_one(tiny, cache, scheduler):
    model, expected = tiny
    core = make_core(model, cache, scheduler, groups=SPLIT)
    first = {"a": PROMPTS["a"]}
    outputs = run_all(core, first, {"a": greedy(MAX_TOKENS)})
    # Then the rest, after "a" cached its blocks in both groups: "b" shares its head.
    rest = {rid: p for rid, p in PROMPTS.items() if rid != "a"}
    outputs |= run_all(core, rest, {rid: greedy(MAX_TOKENS) for rid in rest})
    assert outputs == expected
    stats = core.stats()
    assert stats.prefix_cache_hits_total > 0
    if scheduler.preemption_mode != "auto":
        assert stats.preemptions_total[scheduler.preemption_mode] > 0
