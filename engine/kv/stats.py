"""Counters and the ``EngineStats`` snapshot built from the block pools.

The byte figures come from ``accounting`` so metrics agree with ``kvserve plan``:
payload (logical K/V of live tokens), allocated (used blocks, padding included) and shared
(extra references to blocks several sequences hold).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv.accounting import KVShape, bytes_per_block, group_payload_bytes
from engine.kv.block_pool import BlockPool
from engine.kv.manager import KVCacheManager
from engine.outputs import EngineStats, GroupStats, PoolStats


@dataclass
class StatsCounters:
    """Monotonic counters the scheduler bumps; published as ``*_total`` fields."""

    preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0


@dataclass(frozen=True)
class QueueSizes:
    """Request counts and the live-token sum at the moment of the snapshot."""

    running: int
    waiting: int
    swapped: int
    live_tokens: int
    loading: int = 0
    # Per KV group: the running requests' tokens the group's attention still reads.
    retained_tokens: tuple[int, ...] = ()
    # LoRA adapters (by name) of the running and of the queued requests.
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()


def pool_stats(pool: BlockPool) -> PoolStats:
    """Occupancy of one pool; ``cached`` is the free blocks that still hold a prefix."""
    cached = pool.num_cached_free
    return PoolStats(
        total=pool.num_blocks, used=pool.num_used, free=pool.num_free - cached, cached=cached
    )


def snapshot(
    kv: KVCacheManager, shape: KVShape, counters: StatsCounters, queues: QueueSizes
) -> EngineStats:
    """An immutable ``EngineStats`` (counters copied, so later steps do not mutate it)."""
    per_block = bytes_per_block(shape, kv.block_size)
    retained = queues.retained_tokens or (queues.live_tokens,) * kv.num_groups
    payloads = [
        group_payload_bytes(shape, group, tokens)
        for group, tokens in zip(shape.groups, retained, strict=True)
    ]
    return EngineStats(
        device_blocks=pool_stats(kv.device),
        host_blocks=pool_stats(kv.host),
        block_size=kv.block_size,
        num_running=queues.running,
        num_waiting=queues.waiting,
        num_swapped=queues.swapped,
        live_tokens=queues.live_tokens,
        payload_bytes=sum(payloads),
        allocated_bytes=kv.device.num_used * per_block,
        shared_bytes=kv.device.num_shared_refs * per_block,
        preemptions_total=dict(counters.preemptions),
        blocks_swapped_out_total=counters.blocks_swapped_out,
        blocks_swapped_in_total=counters.blocks_swapped_in,
        prefix_cache_queries_total=counters.prefix_queries,
        prefix_cache_hits_total=counters.prefix_hits,
        prompt_tokens_total=counters.prompt_tokens,
        generation_tokens_total=counters.generation_tokens,
        steps_total=counters.steps,
        spec_drafts_total=counters.spec_drafts,
        spec_draft_tokens_total=counters.spec_draft_tokens,
        spec_accepted_tokens_total=counters.spec_accepted_tokens,
        spec_emitted_tokens_total=counters.spec_emitted_tokens,
        tiers=kv.tiers.stats(shape, kv.block_size) if kv.tiers is not None else (),
        num_loading=queues.loading,
        groups=group_stats(kv, shape, payloads) if shape.is_hybrid else (),
        running_lora_adapters=queues.running_loras,
        waiting_lora_adapters=queues.waiting_loras,
    )


def group_stats(kv: KVCacheManager, shape: KVShape, payloads: list[int]) -> tuple[GroupStats, ...]:
    """Blocks and bytes per KV group, from the pool's per-group counters (O(groups))."""
    per_block = bytes_per_block(shape, kv.block_size)
    pool = kv.device
    return tuple(
        GroupStats(
            label=group.label,
            window=group.window,
            num_layers=len(group.layers),
            used_blocks=pool.used_by_group[index],
            cached_blocks=pool.cached_by_group[index],
            payload_bytes=payloads[index],
            allocated_bytes=pool.used_by_group[index] * per_block,
        )
        for index, group in enumerate(shape.groups)
    )
