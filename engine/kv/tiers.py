"""The tiered prefix cache: where evicted prefix blocks go, and how they come back.

    device pool --evict--> host tier --evict--> disk tier (optional)
         ^                     |                    |
         +------- load --------+-------- load ------+

One interface, ``TieredPrefixCache``, for the KV manager:

- ``write_ahead(device_pool, window)``: copy device blocks to the host tier *before* they
  are evicted: every block registered since the last call (``note_registered``:
  write-through) and the cached ones next in line for eviction (their host copy may have
  aged out since). The runner does these copies on a writer thread beside the step's
  forward (``take_writes_ahead()``), so the eviction itself is bookkeeping. Registered
  blocks are full and never written again, and a cached-free block is in no block table,
  so the forward cannot write one while it is read.
- ``demote(device_block, hash)``: the device pool is about to reuse a cached block. Already
  written ahead: the host copy becomes most recent, nothing moves. Otherwise (evictions
  outran the write-ahead window, or there is no host tier) its contents are copied down in
  the step, to the host tier or to disk. The host tier is itself a ``BlockPool`` with an
  LRU free queue and a hash map, so its own evictions demote to disk the same way.
- ``match(hashes)``: the leading run of ``hashes`` some tier holds (host first, then disk).
- ``plan_loads(request_id, hits, device_blocks)``: copy those blocks back into freshly
  allocated device blocks.
- ``take_ops()``: the step's moves, in order, for ``SchedulerOutput.tier_ops``.
- ``forget_writes(ops)``: a write-ahead that failed; its host entries are dropped.

It decides and never moves bytes: the runner applies the ops (engine/model/tier_io.py)
and reports which loads succeeded. The host tier is its own pool, split from the swap
pool (``--swap-space``), so preemption by swap never competes with cached prefixes and a
swap never overwrites a tier block in the step that demotes into it. Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

from engine.kv.accounting import KVShape, bytes_per_block, disk_tier_blocks
from engine.kv.block_pool import BlockHash, BlockPool
from engine.kv.events import MEDIUM_DISK, MEDIUM_HOST, KVEventRecorder
from engine.outputs import TierOp, TierStats

HOST = "host"
DISK = "disk"
DEVICE = "device"


class DiskIndex(Protocol):
    """What the planner needs from the disk store (engine/kv/disk_store.py)."""

    capacity_bytes: int
    # Called with a hash the store published, adopted from a peer process sharing its
    # directory, or lost: from its writer thread, or the thread whose lookup found it.
    on_stored: Callable[[BlockHash], None] | None
    on_removed: Callable[[BlockHash], None] | None

    def contains(self, block_hash: BlockHash) -> bool: ...
    def contains_or_pending(self, block_hash: BlockHash) -> bool: ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def num_entries(self) -> int: ...

    @property
    def dropped_writes(self) -> int: ...

    @property
    def rejected_entries(self) -> dict[str, int]: ...

    @property
    def removed_temp_files(self) -> int: ...


@dataclass
class TierCounters:
    """Monotonic counters of one tier: the planner counts lookups, the runner bytes."""

    hits: int = 0
    misses: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    dropped_writes: int = 0
    failed_loads: int = 0
    # Blocks stored into the tier inside a step (not written ahead beside the forward).
    in_step_stores: int = 0


@dataclass(frozen=True)
class TierHit:
    """A prefix block found below the device: in the host tier (``host_block``) or on
    disk (``host_block`` -1)."""

    tier: str
    block_hash: BlockHash
    host_block: int = -1


class TieredPrefixCache:
    """Host and disk tiers below the device prefix cache; see the module docstring."""

    def __init__(self, num_host_blocks: int, disk: DiskIndex | None = None) -> None:
        self.host = BlockPool(num_host_blocks, enable_caching=True)
        self.host.on_evict = self._demote_from_host
        self.disk = disk
        self.counters: dict[str, TierCounters] = {}
        if num_host_blocks:
            self.counters[HOST] = TierCounters()
        if disk is not None:
            self.counters[DISK] = TierCounters()
        self._ops: list[TierOp] = []
        self._writes_ahead: list[TierOp] = []
        # Write-through (``note_registered``): device blocks registered since the last
        # write-ahead, copied by the next one.
        self._registered: list[tuple[int, BlockHash]] = []
        # Where a host eviction's disk store goes: the list of the copy that evicted it, so
        # the store reads the host block before that copy overwrites it.
        self._host_evictions = self._ops
        self.events: KVEventRecorder | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.counters)

    def attach_events(self, events: KVEventRecorder) -> None:
        """Announce what the host and disk tiers take and lose (engine/kv/events.py)."""
        self.events = events
        self.host.on_forget = lambda key: events.removed(MEDIUM_HOST, key)
        if self.disk is not None:
            self.disk.on_stored = lambda key: events.copied(MEDIUM_DISK, key)
            self.disk.on_removed = lambda key: events.removed(MEDIUM_DISK, key)

    # -- demotion ---------------------------------------------------------------------------

    def demote(self, device_block: int, block_hash: BlockHash) -> None:
        """A cached device block is about to be reused: keep its contents a tier down
        (nothing to copy when a tier already holds them)."""
        on_disk = self.disk is not None and self.disk.contains_or_pending(block_hash)
        if self.host.num_free:  # zero when off, or while every host block is pinned
            held = self.host.lookup(block_hash)
            if held is not None:
                self._refresh(held.block_id)
                return
            if on_disk:  # written through, then passed on by the host tier's LRU
                return
            host_block = self._take_host_block(block_hash)
            self._ops.append(TierOp(DEVICE, device_block, HOST, host_block, block_hash))
        elif self.disk is not None and not on_disk:
            self._ops.append(TierOp(DEVICE, device_block, DISK, -1, block_hash))

    def note_registered(self, device_block: int, block_hash: BlockHash) -> None:
        """A device block was just registered in the prefix cache (its tokens computed):
        the next ``write_ahead`` copies it to the host tier (write-through). A host tier
        smaller than the device pool passes what it cannot keep on to disk, by its LRU."""
        if self.host.num_blocks:
            self._registered.append((device_block, block_hash))

    def write_ahead(self, device: BlockPool, window: int) -> None:
        """Copy to the host tier, beside the step's forward, the device blocks it lacks
        among: every block registered since the last call, and the cached blocks in the
        first ``window`` of the device free queue (the next allocations evict from there;
        their first copy may have aged out of the host tier since).

        Call after the step's allocations. A registered block is full and the forward
        only writes past a sequence's computed tokens; a cached-free one is in no block
        table: nothing in the step writes either, so the copies can run beside it. Each
        block is copied once while the host tier holds it. The host blocks are registered
        now; ``take_writes_ahead`` hands out the copies.
        """
        registered, self._registered = self._registered, []
        if not self.host.num_blocks:
            return
        # Registered blocks evicted since (their hash changed) are skipped below; the free
        # queue is walked only when it holds cached blocks at all.
        candidates = registered + [
            (block.block_id, block.block_hash)
            for block in islice(device.free_queue, window if device.num_cached_free else 0)
            if block.block_hash is not None
        ]
        self._host_evictions = self._writes_ahead
        try:
            for block_id, block_hash in candidates:
                if device.blocks[block_id].block_hash != block_hash:
                    continue
                if self.host.lookup(block_hash) is not None:
                    continue
                if not self.host.num_free:  # every host block pinned by a load
                    break
                host_block = self._take_host_block(block_hash)
                self._writes_ahead.append(TierOp(DEVICE, block_id, HOST, host_block, block_hash))
        finally:
            self._host_evictions = self._ops

    def _take_host_block(self, block_hash: BlockHash) -> int:
        """A host block registered under ``block_hash``, cached-free at the LRU tail."""
        (host_block,) = self.host.allocate(1)  # may demote the LRU host block to disk
        self.host.cache_block(host_block, block_hash)
        self.host.free([host_block])
        if self.events is not None:
            self.events.copied(MEDIUM_HOST, block_hash)
        return host_block

    def _demote_from_host(self, host_block: int, block_hash: BlockHash) -> None:
        if self.disk is not None and not self.disk.contains_or_pending(block_hash):
            self._host_evictions.append(TierOp(HOST, host_block, DISK, -1, block_hash))

    def _refresh(self, host_block: int) -> None:
        """Move a host block to the most-recently-used end of the host LRU."""
        self.host.touch([host_block])
        self.host.free([host_block])

    def persist_ops(self, device_cached: Sequence[tuple[int, BlockHash]]) -> list[TierOp]:
        """Stores that put every cached block (device and host) on disk, for shutdown:
        what a restarted server can then serve. Empty without a disk tier."""
        if self.disk is None:
            return []
        ops = [
            TierOp(DEVICE, block_id, DISK, -1, block_hash)
            for block_id, block_hash in device_cached
            if not self.disk.contains_or_pending(block_hash)
        ]
        seen = {op.block_hash for op in ops}
        for block_hash, block in self.host.cached.items():
            if block_hash not in seen and not self.disk.contains_or_pending(block_hash):
                ops.append(TierOp(HOST, block.block_id, DISK, -1, block_hash))
        return ops

    # -- lookup and load ----------------------------------------------------------------------

    def match(self, hashes: Sequence[BlockHash]) -> list[TierHit]:
        """The leading run of ``hashes`` found in the tiers (each block host first)."""
        hits = []
        for block_hash in hashes:
            hit = self.find(block_hash)
            if hit is None:
                break
            hits.append(hit)
        return hits

    def find(self, block_hash: BlockHash) -> TierHit | None:
        """Where a tier holds ``block_hash`` (host first), or None."""
        held = self.host.lookup(block_hash) if self.host.num_blocks else None
        if held is not None:
            return TierHit(HOST, block_hash, held.block_id)
        if self.disk is not None and self.disk.contains(block_hash):
            return TierHit(DISK, block_hash)
        return None

    def count_lookup(self, hashes: Sequence[BlockHash]) -> None:
        """Count an admission's lookup below the device: each block the walk reached is
        asked of the host tier, then (if missing there) of disk; the walk ends at the first
        block no tier holds, a miss for every tier asked."""
        for block_hash in hashes:
            hit = self.find(block_hash)
            tiers = [HOST, DISK] if hit is None else [HOST] if hit.tier == HOST else [HOST, DISK]
            for tier in tiers:
                counters = self.counters.get(tier)
                if counters is None:
                    continue
                if hit is not None and hit.tier == tier:
                    counters.hits += 1
                else:
                    counters.misses += 1
            if hit is None:
                return

    def pin(self, hits: Sequence[TierHit]) -> None:
        """Keep the hits' host blocks from being evicted (and overwritten by a demotion)
        while device blocks are allocated for them; ``plan_loads`` or ``unpin`` releases."""
        self.host.touch(hit.host_block for hit in hits if hit.tier == HOST)

    def unpin(self, hits: Sequence[TierHit]) -> None:
        """Release pinned host blocks to the most-recently-used end of the host LRU."""
        self.host.free(hit.host_block for hit in hits if hit.tier == HOST)

    def plan_loads(
        self, request_id: str, hits: Sequence[TierHit], device_blocks: Sequence[int]
    ) -> None:
        """Copy each (pinned) hit into its device block, same order, for ``request_id``."""
        self.unpin(hits)
        for hit, device_block in zip(hits, device_blocks, strict=True):
            source_block = hit.host_block if hit.tier == HOST else -1
            self._ops.append(
                TierOp(hit.tier, source_block, DEVICE, device_block, hit.block_hash, request_id)
            )

    def take_ops(self) -> list[TierOp]:
        """The moves to apply before the step's forward, in order."""
        ops, self._ops = self._ops, []
        self._host_evictions = self._ops
        return ops

    def take_writes_ahead(self) -> list[TierOp]:
        """The write-ahead copies (and the disk stores of the host blocks they reuse), in
        order, to run beside the step's forward and finish before the next step."""
        ops, self._writes_ahead = self._writes_ahead, []
        return ops

    def forget_writes(self, ops: Sequence[TierOp]) -> None:
        """Write-ahead copies that failed: the host blocks they were to fill hold nothing
        usable, so their hashes are dropped (the device blocks are still cached)."""
        for op in ops:
            if op.target == HOST:
                self.host.uncache(op.target_block, op.block_hash)

    # -- observation --------------------------------------------------------------------------

    def stats(self, shape: KVShape, block_size: int) -> tuple[TierStats, ...]:
        per_block = bytes_per_block(shape, block_size)
        out = []
        if HOST in self.counters:
            used = self.host.num_cached_free
            out.append(
                _tier_stats(
                    HOST,
                    self.counters[HOST],
                    capacity_blocks=self.host.num_blocks,
                    used_blocks=used,
                    used_bytes=used * per_block,
                    capacity_bytes=self.host.num_blocks * per_block,
                )
            )
        if self.disk is not None and DISK in self.counters:
            disk = _tier_stats(
                DISK,
                self.counters[DISK],
                capacity_blocks=disk_tier_blocks(shape, block_size, self.disk.capacity_bytes),
                used_blocks=self.disk.num_entries,
                used_bytes=self.disk.used_bytes,
                capacity_bytes=self.disk.capacity_bytes,
                dropped_writes=self.disk.dropped_writes,
            )
            out.append(
                dataclasses.replace(
                    disk,
                    rejected_entries_total=tuple(sorted(self.disk.rejected_entries.items())),
                    removed_temp_files_total=self.disk.removed_temp_files,
                )
            )
        return tuple(out)

    def check_integrity(self) -> None:
        """The host tier's pool adds up and holds no referenced block between steps."""
        self.host.check_integrity()
        assert self.host.num_used == 0, "a host tier block is referenced between steps"
        assert self.host.num_cached_free == len(self.host.cached)


def _tier_stats(
    name: str,
    counters: TierCounters,
    *,
    capacity_blocks: int,
    used_blocks: int,
    used_bytes: int,
    capacity_bytes: int,
    dropped_writes: int = 0,
) -> TierStats:
    return TierStats(
        name=name,
        capacity_blocks=capacity_blocks,
        used_blocks=used_blocks,
        used_bytes=used_bytes,
        capacity_bytes=capacity_bytes,
        hits_total=counters.hits,
        misses_total=counters.misses,
        stored_bytes_total=counters.stored_bytes,
        loaded_bytes_total=counters.loaded_bytes,
        load_seconds_total=counters.load_seconds,
        dropped_writes_total=counters.dropped_writes + dropped_writes,
        failed_loads_total=counters.failed_loads,
        in_step_stores_total=counters.in_step_stores,
    )
