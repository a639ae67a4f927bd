"""A compact picture of the KV pools and the live requests, for the block-map page (/ui).

Two halves, so that the engine thread does as little as possible:

- ``BlockMapProbe.capture(scheduler)`` runs *on the engine thread, between two steps*
  (``AsyncEngine.probe``): the only thread that mutates scheduler and KV state, so what it
  copies is consistent. It copies block tables, the cached blocks' eviction order and a
  few numbers per request: O(used blocks + cached blocks + requests), no per-block scan.
- ``encode(capture)`` runs anywhere (the server's event loop) and builds the JSON-ready
  dict the page reads.

The encoding never lists blocks one by one. A block's state follows from the tables: its
reference count is the number of block tables that hold it (the invariant
``KVCacheManager.check_integrity`` asserts), so the map is

- per request, its block table as ranges ``[first, last, first, last, ...]`` of
  consecutive ids (``last < first`` for a descending run: tables freed tail first and
  reallocated come back reversed);
- per pool, the cached-free blocks in eviction order (head = evicted first), as ranges;
- every other block is free.

Pools: ``device``, ``host`` (swap space) and, when ``--kv-cache-host-size`` /
``--kv-cache-disk-size`` configure them, the prefix-cache tiers ``host-tier`` and
``disk-tier``, whose blocks are all cached prefixes.

Byte figures come from ``engine.kv.accounting``, the single source of KV arithmetic.
Pure Python: no torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.kv import accounting
from engine.kv.accounting import KVShape
from engine.kv.block_pool import BlockPool
from engine.kv.manager import KVCacheManager
from engine.kv.tiers import TieredPrefixCache
from engine.outputs import NULL_BLOCK, EngineStats
from engine.request import Request, RequestStatus

# Request states shown on the page. "preempted" is a waiting request that already ran and
# was preempted for recompute (its blocks were freed; it restarts from its prompt).
RUNNING, WAITING, SWAPPED, PREEMPTED = "running", "waiting", "swapped", "preempted"
# The prefix-cache tiers' pools on the page ("host" is the swap pool).
HOST_TIER, DISK_TIER = "host-tier", "disk-tier"


class SchedulerView(Protocol):
    """What the capture reads from engine.scheduler.Scheduler (read-only)."""

    kv: KVCacheManager
    kv_shape: KVShape

    def live_requests(self) -> list[Request]: ...
    def stats(self) -> EngineStats: ...


@dataclass(frozen=True)
class RequestRow:
    """One live sequence at the moment of the capture."""

    request_id: str
    group_id: str
    state: str
    priority: int
    prompt_tokens: int
    generated_tokens: int
    kv_tokens: int  # tokens whose K/V sit in the request's blocks
    pool: str  # "device", or "host" for a swapped-out request
    table: tuple[int, ...]  # every block it holds, group after group
    group_blocks: tuple[int, ...]  # how many of them each KV group holds
    prefix_hit_tokens: int
    preemptions: int
    state_since: float  # time.monotonic() when the request entered ``state`` (see StateClock)


@dataclass(frozen=True)
class PoolCapture:
    name: str
    num_blocks: int
    cached_lru: tuple[int, ...]  # cached-free block ids, head of the eviction queue first


@dataclass(frozen=True)
class BlockMapCapture:
    """A consistent copy of what the page shows, taken between two engine steps."""

    seq: int
    taken_at: float  # time.monotonic()
    capture_s: float  # engine-thread time the copy took
    block_size: int
    kv_shape: KVShape
    pools: tuple[PoolCapture, ...]
    requests: tuple[RequestRow, ...]
    stats: EngineStats


@dataclass
class StateClock:
    """When each live request entered its current state.

    Only the capture observes states, so a change is dated at the capture that first sees
    it, except where the request itself knows better: a request that never ran waits since
    its arrival, and one running without preemptions runs since its first schedule.
    Touched only on the engine thread (inside ``capture``).
    """

    _since: dict[str, tuple[str, float]] = field(default_factory=dict)

    def since(self, request: Request, state: str, now: float) -> float:
        known = self._since.get(request.request_id)
        if known is not None and known[0] == state:
            return known[1]
        start = now
        if known is None and request.num_preemptions == 0:
            if state == WAITING:
                start = request.arrival_time
            elif state == RUNNING and request.first_scheduled_time is not None:
                start = request.first_scheduled_time
        self._since[request.request_id] = (state, start)
        return start

    def forget_except(self, live_ids: Iterable[str]) -> None:
        keep = set(live_ids)
        for request_id in [rid for rid in self._since if rid not in keep]:
            del self._since[request_id]


class BlockMapProbe:
    """Captures block maps; keep one per server so time-in-state survives across captures."""

    def __init__(self) -> None:
        self._clock = StateClock()
        self._seq = 0

    def capture(self, scheduler: SchedulerView) -> BlockMapCapture:
        """Copy the scheduler's KV picture. Call only on the engine thread."""
        started = time.perf_counter()
        now = time.monotonic()
        kv = scheduler.kv
        live = scheduler.live_requests()
        rows = tuple(_request_row(r, kv, self._clock, now) for r in live)
        self._clock.forget_except(r.request_id for r in live)
        pools = (
            _pool_capture("device", kv.device),
            _pool_capture("host", kv.host),
            *_tier_captures(kv.tiers, scheduler.kv_shape, kv.block_size),
        )
        self._seq += 1
        return BlockMapCapture(
            seq=self._seq,
            taken_at=now,
            capture_s=time.perf_counter() - started,
            block_size=kv.block_size,
            kv_shape=scheduler.kv_shape,
            pools=pools,
            requests=rows,
            stats=scheduler.stats(),
        )


def request_state(request: Request) -> str:
    if request.status is RequestStatus.RUNNING:
        return RUNNING
    if request.status is RequestStatus.SWAPPED:
        return SWAPPED
    return PREEMPTED if request.num_preemptions > 0 else WAITING


def _request_row(request: Request, kv: KVCacheManager, clock: StateClock, now: float) -> RequestRow:
    rid = request.request_id
    state = request_state(request)
    on_host = state == SWAPPED
    tables = kv.host_tables.get(rid, ()) if on_host else kv.tables.get(rid, ())
    held = [[block for block in table if block != NULL_BLOCK] for table in tables]
    holds_kv = state in (RUNNING, SWAPPED)
    return RequestRow(
        request_id=rid,
        group_id=request.group_id,
        state=state,
        priority=request.priority,
        prompt_tokens=request.num_prompt_tokens,
        generated_tokens=request.num_output_tokens,
        kv_tokens=request.num_computed_tokens if holds_kv else 0,
        pool="host" if on_host else "device",
        table=tuple(block for blocks in held for block in blocks),
        group_blocks=tuple(len(blocks) for blocks in held) or (0,) * kv.num_groups,
        prefix_hit_tokens=request.num_cached_tokens,
        preemptions=request.num_preemptions,
        state_since=clock.since(request, state, now),
    )


def _pool_capture(name: str, pool: BlockPool) -> PoolCapture:
    """The cached-free blocks in eviction order. Blocks are freed to the tail of the queue,
    so the walk starts there and stops once every cached block is found: never-used
    blocks, which sit at the head of a mostly empty pool, are not visited."""
    remaining = pool.num_cached_free
    newest_first: list[int] = []
    if remaining:
        for block in reversed(pool.free_queue):
            if block.block_hash is not None:
                newest_first.append(block.block_id)
                remaining -= 1
                if not remaining:
                    break
    newest_first.reverse()
    return PoolCapture(name=name, num_blocks=pool.num_blocks, cached_lru=tuple(newest_first))


def _tier_captures(
    tiers: TieredPrefixCache | None, shape: KVShape, block_size: int
) -> list[PoolCapture]:
    """The prefix-cache tiers below the device, drawn like pools of cached blocks. The host
    tier is a ``BlockPool`` of its own; disk entries have no block ids, so the disk tier's
    cell ``i`` is its ``i``-th entry in eviction order (the disk store's LRU), out of the
    blocks ``--kv-cache-disk-size`` holds."""
    if tiers is None:
        return []
    captures = []
    if tiers.host.num_blocks:
        captures.append(_pool_capture(HOST_TIER, tiers.host))
    if tiers.disk is not None:
        capacity = accounting.disk_tier_blocks(shape, block_size, tiers.disk.capacity_bytes)
        entries = min(tiers.disk.num_entries, capacity)
        captures.append(PoolCapture(DISK_TIER, capacity, tuple(range(entries))))
    return captures


# -- encoding ---------------------------------------------------------------------------------


def id_ranges(block_ids: Sequence[int]) -> list[int]:
    """``[first, last, first, last, ...]``: maximal runs of ids stepping by +1 or -1.

    ``[4, 5, 6, 9, 8, 7, 12]`` -> ``[4, 6, 9, 7, 12, 12]``.
    """
    out: list[int] = []
    count = len(block_ids)
    index = 0
    while index < count:
        first = block_ids[index]
        end = index + 1
        if end < count and abs(block_ids[end] - first) == 1:
            step = block_ids[end] - first
            while end < count and block_ids[end] - block_ids[end - 1] == step:
                end += 1
        out += (first, block_ids[end - 1])
        index = end
    return out


def expand_ranges(ranges: Sequence[int]) -> list[int]:
    """The inverse of ``id_ranges`` (the page does the same in JavaScript)."""
    ids: list[int] = []
    for first, last in zip(ranges[::2], ranges[1::2], strict=True):
        step = 1 if last >= first else -1
        ids.extend(range(first, last + step, step))
    return ids


def kv_shape_facts(shape: KVShape, block_size: int) -> dict[str, Any]:
    """The per-token arithmetic the page's planner evaluates, from ``accounting``."""
    return {
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "kv_dtype": shape.kv_dtype,
        "element_bytes": shape.element_bytes,
        "scale_bytes": accounting.SCALE_BYTES if shape.is_quantized else 0,
        "bytes_per_token": accounting.bytes_per_token(shape),
        "bytes_per_block": accounting.bytes_per_block(shape, block_size),
        "block_size": block_size,
        "page_layers": shape.page_layers,
        "groups": [
            {"label": group.label, "window": group.window, "num_layers": len(group.layers)}
            for group in shape.groups
        ],
    }


def encode(capture: BlockMapCapture) -> dict[str, Any]:
    """The JSON-ready snapshot the page reads (see the module docstring for the format)."""
    shape, block_size, now = capture.kv_shape, capture.block_size, capture.taken_at
    return {
        "seq": capture.seq,
        "capture_ms": round(capture.capture_s * 1000, 3),
        "block_size": block_size,
        "pools": [
            {"name": p.name, "num_blocks": p.num_blocks, "cached_lru": id_ranges(p.cached_lru)}
            for p in capture.pools
        ],
        "requests": [_encode_row(r, shape, block_size, now) for r in capture.requests],
        "totals": _totals(capture.stats),
    }


def _encode_row(row: RequestRow, shape: KVShape, block_size: int, now: float) -> dict[str, Any]:
    return {
        "id": row.request_id,
        "group": row.group_id,
        "state": row.state,
        "priority": row.priority,
        "prompt_tokens": row.prompt_tokens,
        "generated_tokens": row.generated_tokens,
        "kv_tokens": row.kv_tokens,
        "pool": row.pool,
        "blocks": len(row.table),
        "group_blocks": list(row.group_blocks),
        "ranges": id_ranges(row.table),
        "payload_bytes": accounting.payload_bytes(shape, row.kv_tokens),
        "allocated_bytes": accounting.allocated_bytes(shape, len(row.table), block_size),
        "prefix_hit_tokens": row.prefix_hit_tokens,
        "preemptions": row.preemptions,
        "time_in_state_s": round(max(0.0, now - row.state_since), 3),
    }


def _totals(stats: EngineStats) -> dict[str, Any]:
    """The same-instant ``EngineStats`` figures /metrics exports, for the page's counters."""
    device, host = stats.device_blocks, stats.host_blocks
    return {
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "swapped": stats.num_swapped,
        "device": {
            "total": device.total,
            "used": device.used,
            "free": device.free,
            "cached": device.cached,
        },
        "host": {"total": host.total, "used": host.used, "free": host.free, "cached": host.cached},
        "live_tokens": stats.live_tokens,
        "payload_bytes": stats.payload_bytes,
        "allocated_bytes": stats.allocated_bytes,
        "shared_bytes": stats.shared_bytes,
        "generation_tokens_total": stats.generation_tokens_total,
        "prompt_tokens_total": stats.prompt_tokens_total,
        "steps_total": stats.steps_total,
        "groups": [
            {
                "label": group.label,
                "used": group.used_blocks,
                "cached": group.cached_blocks,
                "payload_bytes": group.payload_bytes,
                "allocated_bytes": group.allocated_bytes,
            }
            for group in stats.groups
        ],
    }
