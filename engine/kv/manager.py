"""Per-request block tables, one per KV group, over a device pool and a host (offload) pool.

The manager answers one question for the scheduler -- "can this request get slots for
``k`` more tokens?" -- and keeps the bookkeeping that follows from the answer: prefix-cache
lookups and registration, copy-on-write for shared blocks, forks for ``n > 1``, and swapping
whole block tables between device and host. It never touches tensors: copies and swaps
come out as ``(src, dst)`` block-id pairs for the runner.

KV groups (engine/kv/groups.py): a model whose layers keep different histories has one
block table per group, all over the same pool. A sliding-window group releases the blocks
that fall wholly before its window as a request advances (``NULL_BLOCK`` takes their place
in the table; registered ones stay in the pool as cached blocks a later prefix hit can
revive), so it holds at most ceil((W - 1) / S) + 1 blocks per request while decoding. A
block is cached under its prefix hash and its group (``group_key``). The scheduler never
learns what a window is: it asks for slots and reads tables. A model of one group is
exactly the single-table manager it always was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import CacheConfig
from engine.kv.accounting import blocks_for_tokens
from engine.kv.block_pool import BlockHash, BlockPool
from engine.kv.events import MEDIUM_DEVICE, KVEventRecorder
from engine.kv.groups import KVGroup
from engine.kv.hashing import extend_block_hashes
from engine.kv.prefix import AttentionKind, hit_length, kinds_of
from engine.kv.tiers import TieredPrefixCache, TierHit
from engine.outputs import NULL_BLOCK, TierOp
from engine.request import Request

BlockPair = tuple[int, int]
Tables = list[list[int]]


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a group's block: the block hash, tagged past group 0 (so a
    model of one group keys its blocks exactly as before groups existed)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


@dataclass
class PrefixHit:
    """A request's cached prefix: ``num_blocks`` leading blocks need no compute.
    ``tables[g]`` lists group g's blocks for indexes ``0 .. num_blocks - 1``: a device block
    id, or ``NULL_BLOCK`` where the group does not need it (before its window) or where a
    tier holds it (``loads``: (block index, group, where), in block order)."""

    num_blocks: int
    tables: Tables
    loads: list[tuple[int, int, TierHit]] = field(default_factory=list)

    @classmethod
    def none(cls, num_groups: int) -> PrefixHit:
        return cls(0, [[] for _ in range(num_groups)])


class KVCacheManager:
    """Block tables for live requests. ``tables[rid][g]`` holds group g's device block ids
    (the runner reads them by reference); ``host_tables`` the host copies of swapped-out
    requests, in the same shape."""

    def __init__(self, cache_config: CacheConfig, groups: Sequence[KVGroup] = ()) -> None:
        self.block_size = cache_config.block_size
        self.enable_caching = cache_config.enable_prefix_caching
        self.groups: tuple[KVGroup, ...] = tuple(groups) or (KVGroup((0,)),)
        self.num_groups = len(self.groups)
        self.kinds: tuple[AttentionKind, ...] = kinds_of([g.window for g in self.groups])
        self._sliding = tuple(kind for kind in self.kinds if kind.window is not None)
        # Prefix-cache key suffix per group (see group_key).
        self._key_suffix = [group_key(b"", group) for group in range(self.num_groups)]
        self.device = BlockPool(
            cache_config.num_device_blocks, self.enable_caching, num_groups=self.num_groups
        )
        self.host = BlockPool(cache_config.num_host_blocks, enable_caching=False)
        self.tables: dict[str, Tables] = {}
        self.host_tables: dict[str, Tables] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # Per sliding kind, the leading blocks each request already released, and the
        # first computed-token count at which one more falls out of some window.
        self._released: dict[str, list[int]] = {}
        self._release_at: dict[str, int] = {}
        # Copy-on-write pairs emitted since the last take_copies(), per request, so that a
        # request freed or swapped out in the same step can withdraw its own.
        self._copies: dict[str, list[BlockPair]] = {}
        # Host and disk tiers below the device prefix cache (attach_tiers); None when off.
        self.tiers: TieredPrefixCache | None = None
        # Where registrations and evictions are announced (attach_events); None when off.
        self.events: KVEventRecorder | None = None

    # -- queries ---------------------------------------------------------------------------

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        tables = self.tables.get(request_id)
        return tables[group] if tables else []

    def block_tables(self, request_id: str) -> Tables:
        """The request's block tables, one per group, shared by reference (read-only):
        what a scheduled step hands the runner. The request must hold device blocks."""
        return self.tables[request_id]

    def has_tables(self, request_id: str) -> bool:
        """Whether the request holds device block tables (running or loading)."""
        return request_id in self.tables

    def has_host_tables(self, request_id: str) -> bool:
        """Whether the request is swapped out to the host pool."""
        return request_id in self.host_tables

    def uses_host_blocks(self, request_id: str, host_blocks: set[int]) -> bool:
        """Whether the swapped-out request holds any of ``host_blocks``."""
        tables = self.host_tables.get(request_id, ())
        return any(not host_blocks.isdisjoint(table) for table in tables)

    @property
    def num_free_blocks(self) -> int:
        """Device blocks free for allocation (cached ones included: they can be evicted)."""
        return self.device.num_free

    def num_blocks(self, request_id: str) -> int:
        """Device blocks the request holds, over every group (a sliding group's released
        leading entries are its only NULL ones once a request runs)."""
        tables = self.tables.get(request_id)
        if tables is None:
            return 0
        held = sum(len(table) for table in tables)
        released = self._released.get(request_id)
        if released:
            held -= sum(
                count * len(kind.groups)
                for count, kind in zip(released, self._sliding, strict=True)
            )
        return held

    def swap_in_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Device blocks a swapped-out request needs to come back and compute
        ``num_new_tokens`` more tokens."""
        needed = blocks_for_tokens(request.num_computed_tokens + num_new_tokens, self.block_size)
        return sum(
            len(table) - table.count(NULL_BLOCK) + max(0, needed - len(table))
            for table in self.host_tables[request.request_id]
        )

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Most blocks a sequence holds (every group) while it grows to ``num_tokens``."""
        return sum(group.max_blocks(num_tokens, self.block_size) for group in self.groups)

    # -- prefix cache ------------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """The longest cached prefix every group serves from the device (see
        engine/kv/prefix.py). Capped so that at least the last token is computed (the step
        that samples needs its logits). Only full blocks are ever cached."""
        if not self.enable_caching:
            return PrefixHit.none(self.num_groups)
        limit = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, limit)
        lookup = self.device.cached

        def on_device(group: int, index: int) -> bool:
            return group_key(hashes[index], group) in lookup

        num_blocks = hit_length(self.kinds, limit, self.block_size, on_device)
        return PrefixHit(num_blocks, self._hit_tables(hashes, num_blocks, set()))

    def _hit_tables(
        self, hashes: list[BlockHash], num_blocks: int, missing: set[tuple[int, int]]
    ) -> Tables:
        """Per group, the device blocks of a ``num_blocks`` hit (NULL before each group's
        window and at the (index, group) pairs in ``missing``)."""
        lookup = self.device.cached
        position = num_blocks * self.block_size
        tables = []
        for group_index, group in enumerate(self.groups):
            first = group.first_needed_block(position, self.block_size)
            table = [NULL_BLOCK] * first
            for index in range(first, num_blocks):
                if (index, group_index) in missing:
                    table.append(NULL_BLOCK)
                else:
                    table.append(lookup[group_key(hashes[index], group_index)].block_id)
            tables.append(table)
        return tables

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        done = self._num_cached_blocks.get(rid, 0)
        if num_full <= done:
            return
        tables = self.tables[rid]
        hashes = self._block_hashes(request, num_full)
        tiers = self.tiers
        cache_block = self.device.cache_block
        for table, suffix in zip(tables, self._key_suffix, strict=True):
            registered = []
            for index in range(done, num_full):
                block_id = table[index]
                if block_id == NULL_BLOCK:
                    continue
                key = hashes[index] + suffix
                if cache_block(block_id, key):
                    registered.append(index)
                    if tiers is not None:
                        tiers.note_registered(block_id, key)
            if self.events is not None and registered:
                self._announce(request, hashes, suffix, registered)
        self._num_cached_blocks[rid] = num_full

    def _announce(
        self, request: Request, hashes: list[BlockHash], suffix: bytes, indexes: list[int]
    ) -> None:
        """Report newly registered blocks of one group to the event recorder, one event
        per run of consecutive block indexes."""
        assert self.events is not None
        size = self.block_size
        tokens = request.all_token_ids
        start = 0
        for end in range(1, len(indexes) + 1):
            if end < len(indexes) and indexes[end] == indexes[end - 1] + 1:
                continue
            first, last = indexes[start], indexes[end - 1]
            self.events.stored(
                [hashes[i] + suffix for i in range(first, last + 1)],
                hashes[first - 1] + suffix if first else None,
                tokens[first * size : (last + 1) * size],
                request.cache_salt if first == 0 else None,
            )
            start = end

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < num_blocks:
            extend_block_hashes(
                hashes, request.all_token_ids, num_blocks, self.block_size, request.prefix_key
            )
        return hashes

    # -- tiers below the device ------------------------------------------------------------------

    def attach_tiers(self, tiers: TieredPrefixCache) -> None:
        """Evicted device prefix blocks now demote into ``tiers``; admissions look there too."""
        if not self.enable_caching or not tiers.enabled:
            return
        self.tiers = tiers
        self.device.on_evict = tiers.demote

    def attach_events(self, events: KVEventRecorder) -> None:
        """Announce every prefix-cache change from now on to ``events``: device
        registrations and removals, and the tiers' (engine/kv/events.py)."""
        self.events = events
        self.device.on_forget = lambda key: events.removed(MEDIUM_DEVICE, key)
        if self.tiers is not None:
            self.tiers.attach_events(events)

    def find_tier_prefix(self, request: Request, device_hit: PrefixHit) -> PrefixHit | None:
        """A longer prefix than ``device_hit`` when the tiers hold what the device lacks
        (same cap: the last token is always computed); None otherwise. Its ``loads`` name
        the blocks to copy back."""
        tiers = self.tiers
        if tiers is None:
            return None
        limit = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, limit)
        lookup = self.device.cached
        found: dict[tuple[int, int], TierHit | None] = {}

        def anywhere(group: int, index: int) -> bool:
            key = group_key(hashes[index], group)
            if key in lookup:
                return True
            if (index, group) not in found:
                found[(index, group)] = tiers.find(key)
            return found[(index, group)] is not None

        num_blocks = hit_length(self.kinds, limit, self.block_size, anywhere)
        if num_blocks <= device_hit.num_blocks:
            return None
        position = num_blocks * self.block_size
        loads = []
        for index in range(num_blocks):
            for group_index, group in enumerate(self.groups):
                if index < group.first_needed_block(position, self.block_size):
                    continue
                if group_key(hashes[index], group_index) in lookup:
                    continue
                anywhere(group_index, index)  # every needed block was asked; this is cached
                where = found[(index, group_index)]
                assert where is not None, "the hit length counted a block no tier holds"
                loads.append((index, group_index, where))
        missing = {(index, group) for index, group, _ in loads}
        return PrefixHit(num_blocks, self._hit_tables(hashes, num_blocks, missing), loads)

    def count_tier_lookup(self, request: Request, num_device_hits: int) -> None:
        """Count an admitted request's lookup below the device (hits and misses per tier):
        each group's chain of blocks after the device hit, up to its first miss."""
        if self.tiers is None:
            return
        limit = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, limit)[num_device_hits:limit]
        for group in range(self.num_groups):
            self.tiers.count_lookup([group_key(h, group) for h in hashes])

    def start_load(self, request: Request, hit: PrefixHit, reserve: int) -> bool:
        """Take the hit's device blocks plus fresh blocks for its ``loads`` and plan their
        copies; False (nothing taken) when the blocks do not fit above ``reserve``."""
        assert self.tiers is not None and hit.loads
        found = [where for _, _, where in hit.loads]
        # Allocating may evict device blocks whose demotion would reuse a found host block.
        self.tiers.pin(found)
        if self.allocate_slots(request, 0, hit, reserve=reserve) is None:
            self.tiers.unpin(found)
            return False
        tables = self.tables[request.request_id]
        targets = [tables[group][index] for index, group, _ in hit.loads]
        self.tiers.plan_loads(request.request_id, found, targets)
        return True

    def finish_load(self, request: Request, intact: int, hit: PrefixHit) -> int:
        """A tier load of which only the first ``intact`` copies (in ``hit.loads`` order)
        arrived: the longest prefix the request's own tables now serve, in blocks (all of
        ``hit`` when every copy arrived). Blocks from the first failed copy on do not
        count; a sliding group gets fresh blocks where the recompute from there writes
        into entries the hit had left empty, and when the pool has none the request drops
        its blocks and starts over (0)."""
        if intact >= len(hit.loads):
            return hit.num_blocks
        rid = request.request_id
        failed = hit.loads[intact][0]
        tables = self.tables[rid]

        def held(group: int, index: int) -> bool:
            return index < failed and tables[group][index] != NULL_BLOCK

        served = hit_length(self.kinds, hit.num_blocks, self.block_size, held)
        if self._sliding and not self._refill_windows(rid, tables, served * self.block_size):
            self.free(request)
            return 0
        return served

    def _refill_windows(self, rid: str, tables: Tables, start: int) -> bool:
        """Fresh blocks in the empty entries a recompute from ``start`` writes (sliding
        groups); False, with nothing taken, when the pool cannot give them."""
        holes = [
            (group, index)
            for kind in self._sliding
            for group in kind.groups
            for index in range(kind.first_needed_block(start, self.block_size), len(tables[group]))
            if tables[group][index] == NULL_BLOCK
        ]
        if len(holes) > self.device.num_free:
            return False
        for group, index in holes:
            (tables[group][index],) = self.device.allocate(1, group)
        self._set_released(
            rid, [kind.first_needed_block(start, self.block_size) for kind in self._sliding]
        )
        return True

    def take_tier_ops(self) -> list[TierOp]:
        """The tier loads and stores planned since the last call, for this step's output;
        [] without tiers."""
        if self.tiers is None:
            return []
        return self.tiers.take_ops()

    def write_ahead(self, window: int) -> list[TierOp]:
        """Host-tier copies of the cached blocks the next ``window`` allocations would
        evict, to run beside this step's forward (engine/kv/tiers.py); [] without tiers."""
        if self.tiers is None:
            return []
        self.tiers.write_ahead(self.device, window)
        return self.tiers.take_writes_ahead()

    def persist_ops(self) -> list[TierOp]:
        """Tier stores that put every cached block on disk (for shutdown)."""
        if self.tiers is None:
            return []
        cached = [(block.block_id, h) for h, block in self.device.cached.items()]
        return self.tiers.persist_ops(cached)

    # -- allocation ---------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit: PrefixHit | None = None,
        reserve: int = 0,
    ) -> list[int] | None:
        """Give the request room for ``num_new_tokens`` more tokens; None when it does not fit.

        ``hit`` (from ``find_cached_prefix`` or ``find_tier_prefix``, only for a request that
        holds no blocks yet) is taken first and counts as computed; blocks it must load get
        fresh ids. Blocks a sliding group no longer reads are released first. Shared blocks
        the new tokens would write into are copied first (copy-on-write; the last holder
        writes in place). ``reserve`` blocks must stay free afterwards (the admission
        watermark). Returns the newly allocated block ids (copies included), group by group.
        """
        rid = request.request_id
        tables = self.tables.get(rid)
        if tables is not None:
            assert hit is None, "prefix hits only for a request without blocks"
            computed = request.num_computed_tokens
            if self._sliding and computed >= self._release_at[rid]:
                self._release_outside_window(rid, tables, computed)
            if self._fits_in_own_block(tables, computed, num_new_tokens):
                return []
            if computed % self.block_size == 0 and computed // self.block_size >= len(tables[0]):
                return self._append_blocks(tables, computed + num_new_tokens, reserve)
        hit_blocks = hit.num_blocks if hit is not None else 0
        start = request.num_computed_tokens + hit_blocks * self.block_size
        needed = blocks_for_tokens(start + num_new_tokens, self.block_size)
        pool = self.device
        blocks = pool.blocks
        if tables is None:
            assert hit is None or len(hit.tables) == self.num_groups
            current = hit.tables if hit is not None else [[] for _ in self.groups]
        else:
            current = tables
        first_write = start // self.block_size
        num_fresh = 0
        to_copy: list[list[int]] = []
        revived = 0
        for group, table in enumerate(current):
            length = len(table)
            num_fresh += max(0, needed - length)
            to_copy.append(
                [
                    index
                    for index in range(first_write, min(length, needed))
                    if table[index] != NULL_BLOCK and blocks[table[index]].ref_count > 1
                ]
                if first_write < length
                else []
            )
            if tables is None:
                num_fresh += sum(1 for block_id in table if block_id == NULL_BLOCK)
                num_fresh -= self.groups[group].first_needed_block(start, self.block_size)
                revived += sum(
                    1
                    for block_id in table
                    if block_id != NULL_BLOCK and not blocks[block_id].ref_count
                )
        num_copies = sum(len(indices) for indices in to_copy)
        if num_fresh + num_copies + revived > pool.num_free - reserve:
            return None
        if tables is None:
            tables = [list(table) for table in current]
            self.tables[rid] = tables
            if self._sliding:
                self._set_released(
                    rid, [kind.first_needed_block(start, self.block_size) for kind in self._sliding]
                )
            for table in tables:
                pool.touch(block_id for block_id in table if block_id != NULL_BLOCK)
            new_ids = self._fill_loads(tables, hit.loads if hit is not None else ())
        else:
            new_ids = []
        for group, indices in enumerate(to_copy):
            if indices:
                new_ids += self._copy_on_write(rid, tables[group], indices, group)
        for group, table in enumerate(tables):
            missing = needed - len(table)
            if missing > 0:
                fresh = pool.allocate(missing, group)
                table.extend(fresh)
                new_ids.extend(fresh)
        return new_ids

    def _append_blocks(self, tables: Tables, end: int, reserve: int) -> list[int] | None:
        """The next fast path: the new tokens start a fresh block, so nothing is shared or
        copied; every group (all one length) gets the same number of fresh blocks, taken
        in one pass over the pool."""
        missing = blocks_for_tokens(end, self.block_size) - len(tables[0])
        if missing * self.num_groups > self.device.num_free - reserve:
            return None
        fresh = self.device.allocate_per_group(missing, self.num_groups)
        for group, table in enumerate(tables):
            table += fresh[group * missing : (group + 1) * missing]
        return fresh

    def _fill_loads(self, tables: Tables, loads: Sequence[tuple[int, int, TierHit]]) -> list[int]:
        """Fresh device blocks in the table slots a tier load will fill."""
        new_ids = []
        for index, group, _ in loads:
            (block_id,) = self.device.allocate(1, group)
            tables[group][index] = block_id
            new_ids.append(block_id)
        return new_ids

    def _fits_in_own_block(self, tables: Tables, start: int, num_new: int) -> bool:
        """The fast path of most decode steps: the new tokens land in one block the request
        already holds alone, so nothing is allocated or copied. Group 0 answers for every
        group: all tables have one entry per block of the sequence (NULL before a window),
        and the block being written is never before a window and is shared only by forks,
        which share every group's (prefix hits share full blocks only, and a hit request
        writes from a block boundary); tests/unit/test_hybrid_kv.py would see a write into
        a block another request reads."""
        first = start // self.block_size
        if (start + num_new - 1) // self.block_size != first:
            return False
        table = tables[0]
        return first < len(table) and self.device.blocks[table[first]].ref_count == 1

    def _set_released(self, rid: str, released: list[int]) -> None:
        """Record each sliding kind's released leading blocks, and when the next goes."""
        self._released[rid] = released
        self._release_at[rid] = min(
            (count + 1) * self.block_size + kind.window - 1  # type: ignore[operator]
            for count, kind in zip(released, self._sliding, strict=True)
        )

    def _release_outside_window(self, rid: str, tables: Tables, start: int) -> None:
        """Free, in every sliding group, the blocks wholly before the window of a query at
        ``start`` (tail of the free queue, oldest first: cached ones stay revivable)."""
        released = list(self._released[rid])
        dropped: list[int] = []
        for slot, kind in enumerate(self._sliding):
            first = kind.first_needed_block(start, self.block_size)
            done = released[slot]
            if first <= done:
                continue
            nulls = [NULL_BLOCK] * (first - done)
            for group in kind.groups:  # entries from ``done`` on hold blocks (no NULL)
                table = tables[group]
                dropped += table[done:first]
                table[done:first] = nulls
            released[slot] = first
        self.device.free(dropped)
        self._set_released(rid, released)

    def _copy_on_write(
        self, rid: str, table: list[int], indices: list[int], group: int
    ) -> list[int]:
        copies = self._copies.setdefault(rid, [])
        new_ids = []
        for index in indices:
            src = table[index]
            (dst,) = self.device.allocate(1, group)
            self.device.free([src])
            table[index] = dst
            copies.append((src, dst))
            new_ids.append(dst)
        return new_ids

    def trim(self, request: Request) -> None:
        """Give back the blocks past the request's computed tokens: the slots of draft
        tokens the model rejected (speculative decoding). They were allocated for this
        step's drafts, hold nothing computed and were never registered in the prefix
        cache (only computed full blocks are), so they simply return to the pool."""
        tables = self.tables.get(request.request_id)
        if tables is None:
            return
        keep = blocks_for_tokens(request.num_computed_tokens, self.block_size)
        for table in tables:
            if len(table) > keep:
                extra = table[keep:]
                del table[keep:]
                self.device.free(reversed(extra))

    def take_copies(self) -> list[BlockPair]:
        """Copy-on-write pairs emitted since the last call, for the scheduler output."""
        pairs = [pair for pairs in self._copies.values() for pair in pairs]
        self._copies.clear()
        return pairs

    def fork(self, parent: Request, child: Request) -> None:
        """Share every block of ``parent`` with ``child`` (ref counts up, nothing copied)."""
        pid, cid = parent.request_id, child.request_id
        tables = self.tables[pid]
        for table in tables:
            self.device.touch(block_id for block_id in table if block_id != NULL_BLOCK)
        self.tables[cid] = [list(table) for table in tables]
        self._hashes[cid] = list(self._hashes.get(pid, ()))
        self._num_cached_blocks[cid] = self._num_cached_blocks.get(pid, 0)
        if pid in self._released:
            self._set_released(cid, list(self._released[pid]))

    def free(self, request: Request) -> None:
        """Release everything the request holds. Tail blocks go to the free queue first so
        a shared head is evicted last. Unknown requests are ignored."""
        rid = request.request_id
        tables = self.tables.pop(rid, None)
        if tables:
            for table in tables:
                self.device.free(b for b in reversed(table) if b != NULL_BLOCK)
        host_tables = self.host_tables.pop(rid, None)
        if host_tables:
            for table in host_tables:
                self.host.free(b for b in table if b != NULL_BLOCK)
        self._hashes.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        self._copies.pop(rid, None)
        self._released.pop(rid, None)
        self._release_at.pop(rid, None)

    # -- offload -------------------------------------------------------------------------------

    def can_swap_out(self, request: Request) -> bool:
        return self.num_blocks(request.request_id) <= self.host.num_free

    def swap_out(self, request: Request) -> list[BlockPair]:
        """Move the request's device blocks to host blocks; returns (device, host) pairs."""
        rid = request.request_id
        tables = self.tables.pop(rid)
        # A block copied on write in this same step is not filled until after the swap
        # runs, so save the still-intact source instead and withdraw the copy.
        source_of = {dst: src for src, dst in self._copies.pop(rid, ())}
        pairs: list[BlockPair] = []
        host_tables = []
        for table in tables:
            held = [b for b in table if b != NULL_BLOCK]
            host_ids = iter(self.host.allocate(len(held)))
            host_table = [b if b == NULL_BLOCK else next(host_ids) for b in table]
            pairs += [
                (source_of.get(dev, dev), host)
                for dev, host in zip(table, host_table, strict=True)
                if dev != NULL_BLOCK
            ]
            self.device.free(reversed(held))
            host_tables.append(host_table)
        self.host_tables[rid] = host_tables
        return pairs

    def can_swap_in(self, request: Request, reserve: int = 0) -> bool:
        need = _held(self.host_tables.get(request.request_id, ()))
        return need <= self.device.num_free - reserve

    def swap_in(self, request: Request) -> list[BlockPair]:
        """Bring a swapped-out request back to fresh device blocks; (host, device) pairs."""
        rid = request.request_id
        host_tables = self.host_tables.pop(rid)
        pairs: list[BlockPair] = []
        tables = []
        for group, host_table in enumerate(host_tables):
            held = [b for b in host_table if b != NULL_BLOCK]
            device_ids = iter(self.device.allocate(len(held), group))
            table = [b if b == NULL_BLOCK else next(device_ids) for b in host_table]
            pairs += [(h, d) for h, d in zip(host_table, table, strict=True) if h != NULL_BLOCK]
            self.host.free(held)
            tables.append(table)
        self.tables[rid] = tables
        self._num_cached_blocks[rid] = 0
        self.cache_computed_blocks(request)
        return pairs

    # -- invariants ----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert both pools are consistent, every ref count equals the number of block
        tables that reference the block, every block serves the group whose table holds
        it, and groups of one kind move in lock step."""
        self.device.check_integrity()
        self.host.check_integrity()
        refs = [0] * self.device.num_blocks
        blocks = self.device.blocks
        for rid, tables in self.tables.items():
            assert len(tables) == self.num_groups, f"{rid}: one table per group"
            for group, table in enumerate(tables):
                for block_id in table:
                    if block_id != NULL_BLOCK:
                        refs[block_id] += 1
                        assert blocks[block_id].group == group, f"{rid}: block of another group"
            lengths = {len(table) for table in tables}
            assert len(lengths) == 1, f"{rid}: groups out of step"
        for block in blocks:
            assert block.ref_count == refs[block.block_id], (
                f"{block}: {refs[block.block_id]} table references"
            )
        host_refs = [0] * self.host.num_blocks
        for rid, host_tables in self.host_tables.items():
            assert rid not in self.tables, f"{rid} is both on device and swapped out"
            for table in host_tables:
                for block_id in table:
                    if block_id != NULL_BLOCK:
                        host_refs[block_id] += 1
        for block in self.host.blocks:
            assert block.ref_count == host_refs[block.block_id], f"host {block} refs"
        if self.tiers is not None:
            self.tiers.check_integrity()


def _held(tables: Sequence[list[int]]) -> int:
    return sum(len(table) - table.count(NULL_BLOCK) for table in tables)
