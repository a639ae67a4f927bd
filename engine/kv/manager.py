"""Per-request block tables over a device pool and a host (offload) pool.

The manager answers one question for the scheduler -- "can this request get slots for
``k`` more tokens?" -- and keeps the bookkeeping that follows from the answer: prefix-cache
lookups and registration, copy-on-write for shared blocks, forks for ``n > 1``, and swapping
whole block tables between device and host. It never touches tensors: copies and swaps
come out as ``(src, dst)`` block-id pairs for the runner.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import CacheConfig
from engine.kv.accounting import blocks_for_tokens
from engine.kv.block_pool import BlockHash, BlockPool
from engine.kv.hashing import extend_block_hashes
from engine.kv.tiers import TieredPrefixCache, TierHit
from engine.outputs import TierOp
from engine.request import Request

BlockPair = tuple[int, int]


class KVCacheManager:
    """Block tables for live requests. ``tables`` hold device block ids (the runner reads
    them by reference); ``host_tables`` hold the host copies of swapped-out requests."""

    def __init__(self, cache_config: CacheConfig) -> None:
        self.block_size = cache_config.block_size
        self.enable_caching = cache_config.enable_prefix_caching
        self.device = BlockPool(cache_config.num_device_blocks, self.enable_caching)
        self.host = BlockPool(cache_config.num_host_blocks, enable_caching=False)
        self.tables: dict[str, list[int]] = {}
        self.host_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # Copy-on-write pairs emitted since the last take_copies(), per request, so that a
        # request freed or swapped out in the same step can withdraw its own.
        self._copies: dict[str, list[BlockPair]] = {}
        # Host and disk tiers below the device prefix cache (attach_tiers); None when off.
        self.tiers: TieredPrefixCache | None = None

    # -- queries ---------------------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def num_blocks(self, request_id: str) -> int:
        return len(self.tables.get(request_id, ()))

    # -- prefix cache ------------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Device blocks holding the longest cached prefix of the request's tokens.

        Capped so that at least the last token is computed (the step that samples needs
        its logits). Only full blocks are ever cached.
        """
        if not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        hits = []
        for block_hash in hashes[:max_blocks]:
            block = self.device.lookup(block_hash)
            if block is None:
                break
            hits.append(block.block_id)
        return hits

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        done = self._num_cached_blocks.get(rid, 0)
        if num_full <= done:
            return
        table = self.tables[rid]
        hashes = self._block_hashes(request, num_full)
        for index in range(done, num_full):
            if self.device.cache_block(table[index], hashes[index]) and self.tiers is not None:
                self.tiers.note_registered(table[index], hashes[index])
        self._num_cached_blocks[rid] = num_full

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < num_blocks:
            extend_block_hashes(
                hashes, request.all_token_ids, num_blocks, self.block_size, request.cache_salt
            )
        return hashes

    # -- tiers below the device ------------------------------------------------------------------

    def attach_tiers(self, tiers: TieredPrefixCache) -> None:
        """Evicted device prefix blocks now demote into ``tiers``; admissions look there too."""
        if not self.enable_caching or not tiers.enabled:
            return
        self.tiers = tiers
        self.device.on_evict = tiers.demote

    def find_tier_prefix(self, request: Request, num_device_hits: int) -> list[TierHit]:
        """The blocks right after the device hit that a lower tier holds (same cap as
        ``find_cached_prefix``: the last token is always computed)."""
        if self.tiers is None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        return self.tiers.match(hashes[num_device_hits:max_blocks])

    def count_tier_lookup(self, request: Request, num_device_hits: int) -> None:
        """Count an admitted request's lookup below the device (hits and misses per tier)."""
        if self.tiers is None:
            return
        max_blocks = (request.num_tokens - 1) // self.block_size
        self.tiers.count_lookup(self._block_hashes(request, max_blocks)[num_device_hits:max_blocks])

    def start_load(
        self, request: Request, device_hits: Sequence[int], found: Sequence[TierHit], reserve: int
    ) -> bool:
        """Take the device hits plus fresh blocks for ``found`` and plan their loads;
        False (nothing taken) when the blocks do not fit above ``reserve``."""
        assert self.tiers is not None and found
        # Allocating may evict device blocks whose demotion would reuse a found host block.
        self.tiers.pin(found)
        new_ids = self.allocate_slots(
            request, len(found) * self.block_size, device_hits, reserve=reserve
        )
        if new_ids is None:
            self.tiers.unpin(found)
            return False
        self.tiers.plan_loads(request.request_id, found, new_ids)
        return True

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
        cached_blocks: Sequence[int] = (),
        reserve: int = 0,
    ) -> list[int] | None:
        """Give the request room for ``num_new_tokens`` more tokens; None when it does not fit.

        ``cached_blocks`` (a prefix hit from ``find_cached_prefix``, only for a request that
        holds no blocks yet) are taken first and count as computed. Shared blocks the new
        tokens would write into are copied first (copy-on-write; the last holder writes in
        place). ``reserve`` blocks must stay free afterwards (the admission watermark).
        Returns the newly allocated block ids (copies included).
        """
        rid = request.request_id
        pool = self.device
        block_size = self.block_size
        table = self.tables.get(rid)
        if table is None:
            table = []  # stored only once the allocation succeeds
        elif not cached_blocks and self._fits_in_own_block(request, table, num_new_tokens):
            return []
        assert not cached_blocks or not table, "prefix hits only for a request without blocks"
        start = request.num_computed_tokens + len(cached_blocks) * block_size
        needed = blocks_for_tokens(start + num_new_tokens, block_size)
        num_fresh = max(0, needed - len(table) - len(cached_blocks))
        blocks = pool.blocks
        to_copy = [
            index
            for index in range(start // block_size, min(len(table), needed))
            if blocks[table[index]].ref_count > 1
        ]
        revived = sum(1 for block_id in cached_blocks if blocks[block_id].ref_count == 0)
        if num_fresh + len(to_copy) + revived > pool.num_free - reserve:
            return None
        self.tables[rid] = table
        if cached_blocks:
            pool.touch(cached_blocks)
            table.extend(cached_blocks)
        new_ids = self._copy_on_write(rid, table, to_copy) if to_copy else []
        if num_fresh:
            fresh = pool.allocate(num_fresh)
            table.extend(fresh)
            new_ids.extend(fresh)
        return new_ids

    def _fits_in_own_block(self, request: Request, table: list[int], num_new: int) -> bool:
        """The fast path of most decode steps: the new tokens land in one block the request
        already holds alone, so nothing is allocated or copied."""
        start = request.num_computed_tokens
        first = start // self.block_size
        last = (start + num_new - 1) // self.block_size
        return first == last < len(table) and self.device.blocks[table[first]].ref_count == 1

    def _copy_on_write(self, rid: str, table: list[int], indices: list[int]) -> list[int]:
        copies = self._copies.setdefault(rid, [])
        new_ids = []
        for index in indices:
            src = table[index]
            (dst,) = self.device.allocate(1)
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
        table = self.tables.get(request.request_id)
        if table is None:
            return
        keep = blocks_for_tokens(request.num_computed_tokens, self.block_size)
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
        table = self.tables[parent.request_id]
        self.device.touch(table)
        self.tables[child.request_id] = list(table)
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, ()))
        self._num_cached_blocks[child.request_id] = self._num_cached_blocks.get(
            parent.request_id, 0
        )

    def free(self, request: Request) -> None:
        """Release everything the request holds. Tail blocks go to the free queue first so
        a shared head is evicted last. Unknown requests are ignored."""
        rid = request.request_id
        table = self.tables.pop(rid, None)
        if table:
            self.device.free(reversed(table))
        host_table = self.host_tables.pop(rid, None)
        if host_table:
            self.host.free(host_table)
        self._hashes.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        self._copies.pop(rid, None)

    # -- offload -------------------------------------------------------------------------------

    def can_swap_out(self, request: Request) -> bool:
        return self.num_blocks(request.request_id) <= self.host.num_free

    def swap_out(self, request: Request) -> list[BlockPair]:
        """Move the request's device blocks to host blocks; returns (device, host) pairs."""
        rid = request.request_id
        table = self.tables.pop(rid)
        host_ids = self.host.allocate(len(table))
        # A block copied on write in this same step is not filled until after the swap
        # runs, so save the still-intact source instead and withdraw the copy.
        source_of = {dst: src for src, dst in self._copies.pop(rid, ())}
        pairs = [(source_of.get(dev, dev), host) for dev, host in zip(table, host_ids, strict=True)]
        self.device.free(reversed(table))
        self.host_tables[rid] = host_ids
        return pairs

    def can_swap_in(self, request: Request, reserve: int = 0) -> bool:
        need = len(self.host_tables.get(request.request_id, ()))
        return need <= self.device.num_free - reserve

    def swap_in(self, request: Request) -> list[BlockPair]:
        """Bring a swapped-out request back to fresh device blocks; (host, device) pairs."""
        rid = request.request_id
        host_ids = self.host_tables.pop(rid)
        device_ids = self.device.allocate(len(host_ids))
        self.host.free(host_ids)
        self.tables[rid] = device_ids
        self._num_cached_blocks[rid] = 0
        self.cache_computed_blocks(request)
        return list(zip(host_ids, device_ids, strict=True))

    # -- invariants ----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert both pools are consistent and every ref count equals the number of block
        tables that reference the block."""
        self.device.check_integrity()
        self.host.check_integrity()
        refs = [0] * self.device.num_blocks
        for table in self.tables.values():
            for block_id in table:
                refs[block_id] += 1
        for block in self.device.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"{block}: {refs[block.block_id]} table references"
            )
        host_refs = [0] * self.host.num_blocks
        for rid, host_table in self.host_tables.items():
            assert rid not in self.tables, f"{rid} is both on device and swapped out"
            for block_id in host_table:
                host_refs[block_id] += 1
        for block in self.host.blocks:
            assert block.ref_count == host_refs[block.block_id], f"host {block} refs"
        if self.tiers is not None:
            self.tiers.check_integrity()
