"""A fixed pool of KV blocks: reference counts, an LRU free queue, and the prefix-cache map.

Every block is in exactly one of three states:

- **used**: ``ref_count > 0``; referenced by one or more block tables; not in the free queue.
- **cached-free**: ``ref_count == 0`` and it still carries a content hash; it sits in the
  free queue *and* in the hash map, so a later request with the same prefix can revive it.
- **free**: ``ref_count == 0``, no hash; in the free queue only.

Eviction is lazy: a cached-free block keeps its contents until ``allocate`` pops it from the
head of the free queue, and only then is its hash dropped. The free queue is a doubly linked
list so that a cache hit can pull a block out of its middle in O(1).

Models with several KV groups (engine/kv/groups.py) share one pool of equal pages: a
block belongs to the group that allocated it until it is reused, and the pool keeps
used and cached-free counts per group (O(1) stats, as for the totals).

Pure Python, no torch: the pool hands out block ids; the runner owns the tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

BlockHash = bytes
# Called with (block id, hash) when a cached block's contents are about to be reused: the
# tiered prefix cache (engine/kv/tiers.py) demotes them to a lower tier.
EvictHook = Callable[[int, "BlockHash"], None]
# Called with a hash the pool no longer holds (evicted or withdrawn): the KV event
# recorder (engine/kv/events.py) announces the removal.
ForgetHook = Callable[["BlockHash"], None]


class KVBlock:
    """One block's metadata. ``prev_free``/``next_free`` link it into the free queue."""

    __slots__ = ("block_hash", "block_id", "group", "next_free", "prev_free", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.group = 0  # the KV group that allocated it last
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        hashed = self.block_hash is not None
        return f"KVBlock(id={self.block_id}, ref={self.ref_count}, hashed={hashed})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order (head = evicted first).

    Sentinel head and tail nodes keep every operation branch-free and O(1).
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.size = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        block.prev_free = last
        block.next_free = self._tail
        last.next_free = block
        self._tail.prev_free = block
        self.size += 1

    def popleft_many(self, count: int) -> list[KVBlock]:
        """Unlink the first ``count`` blocks (``count <= size``) in one pass."""
        taken = []
        node = self._head.next_free
        for _ in range(count):
            assert node is not None and node is not self._tail, "free queue is empty"
            taken.append(node)
            node = node.next_free
        assert node is not None
        self._head.next_free = node
        node.prev_free = self._head
        for block in taken:
            block.prev_free = block.next_free = None
        self.size -= count
        return taken

    def extend(self, blocks: list[KVBlock]) -> None:
        """Append ``blocks`` at the tail, in order, relinking the tail once."""
        if not blocks:
            return
        last = self._tail.prev_free
        assert last is not None
        for block in blocks:
            block.prev_free = last
            last.next_free = block
            last = block
        last.next_free = self._tail
        self._tail.prev_free = last
        self.size += len(blocks)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        assert block is not None and block is not self._tail, "free queue is empty"
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.size -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def __reversed__(self) -> Iterator[KVBlock]:
        """Most recently freed first (the block-map page finds cached blocks there)."""
        node = self._tail.prev_free
        while node is not None and node is not self._head:
            yield node
            node = node.prev_free


class BlockPool:
    """``num_blocks`` blocks with ref counts, a free queue and (optionally) a prefix cache.

    Counters ``num_used`` and ``num_shared_refs`` (sum of ``ref_count - 1`` over used
    blocks) are maintained incrementally so stats snapshots cost O(1).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, num_groups: int = 1) -> None:
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_shared_refs = 0
        self.num_cached_free = 0
        # Per KV group: blocks in use, and free blocks still holding a cached prefix.
        self.used_by_group = [0] * num_groups
        self.cached_by_group = [0] * num_groups
        self.on_evict: EvictHook | None = None
        self.on_forget: ForgetHook | None = None

    # -- queries -----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free plus cached-free)."""
        return self.free_queue.size

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.free_queue.size

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    # -- allocation ----------------------------------------------------------------------

    def allocate(self, count: int, group: int = 0) -> list[int]:
        """Take ``count`` blocks from the head of the free queue (evicting cached contents)
        for KV group ``group``."""
        if count > self.free_queue.size:
            raise ValueError(f"cannot allocate {count} blocks: only {self.free_queue.size} free")
        ids = []
        for block in self.free_queue.popleft_many(count):
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            block.group = group
            ids.append(block.block_id)
        self.used_by_group[group] += count
        return ids

    def allocate_per_group(self, count: int, num_groups: int) -> list[int]:
        """``count`` blocks for each of groups 0..num_groups-1 in one pass: group 0's
        first, then group 1's, and so on."""
        if count * num_groups > self.free_queue.size:
            raise ValueError(f"cannot allocate {count * num_groups} blocks")
        ids = []
        taken = self.free_queue.popleft_many(count * num_groups)
        for index, block in enumerate(taken):
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            block.group = index // count
            ids.append(block.block_id)
        for group in range(num_groups):
            self.used_by_group[group] += count
        return ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a prefix-cache hit or a fork)."""
        blocks = self.blocks
        for block_id in block_ids:
            block = blocks[block_id]
            if block.ref_count == 0:
                self.free_queue.remove(block)
                self.used_by_group[block.group] += 1
                if block.block_hash is not None:
                    self.num_cached_free -= 1
                    self.cached_by_group[block.group] -= 1
            else:
                self.num_shared_refs += 1
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order.

        Blocks whose count reaches zero join the tail of the free queue in that order, so
        callers pass a table tail-first: the shared head of a prefix is evicted last.
        """
        blocks = self.blocks
        released = []
        for block_id in block_ids:
            block = blocks[block_id]
            assert block.ref_count > 0, f"double free of {block}"
            block.ref_count -= 1
            if block.ref_count == 0:
                released.append(block)
                self.used_by_group[block.group] -= 1
                if block.block_hash is not None:
                    self.num_cached_free += 1
                    self.cached_by_group[block.group] += 1
            else:
                self.num_shared_refs -= 1
        self.free_queue.extend(released)

    # -- prefix cache ----------------------------------------------------------------------

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a used, full block under ``block_hash``. False when caching is off, the
        block already has a hash, or another block already holds that content."""
        block = self.blocks[block_id]
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return False
        assert block.ref_count > 0, f"caching unreferenced {block}"
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def uncache(self, block_id: int, block_hash: BlockHash) -> None:
        """Drop ``block_hash`` from the map if ``block_id`` still holds it (its contents
        turned out to be invalid); the block keeps its place and references."""
        block = self.blocks[block_id]
        if block.block_hash != block_hash:
            return
        del self.cached[block_hash]
        block.block_hash = None
        if block.ref_count == 0:
            self.num_cached_free -= 1
            self.cached_by_group[block.group] -= 1
        if self.on_forget is not None:
            self.on_forget(block_hash)

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        if self.on_evict is not None:
            self.on_evict(block.block_id, block.block_hash)
        del self.cached[block.block_hash]
        if self.on_forget is not None:
            self.on_forget(block.block_hash)
        block.block_hash = None
        self.num_cached_free -= 1
        self.cached_by_group[block.group] -= 1

    # -- invariants ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert every block is in exactly one state and the counters are exact."""
        in_queue: set[int] = set()
        for block in self.free_queue:
            assert block.block_id not in in_queue, f"{block} twice in the free queue"
            assert block.ref_count == 0, f"{block} is in the free queue but referenced"
            in_queue.add(block.block_id)
        assert len(in_queue) == self.free_queue.size, "free queue size is wrong"
        shared = cached_free = 0
        used_by_group = [0] * len(self.used_by_group)
        cached_by_group = [0] * len(self.cached_by_group)
        for block in self.blocks:
            if block.ref_count == 0:
                assert block.block_id in in_queue, f"{block} is lost (unreferenced, not free)"
                cached_free += block.block_hash is not None
                cached_by_group[block.group] += block.block_hash is not None
            else:
                assert block.prev_free is None and block.next_free is None, f"{block} linked"
                shared += block.ref_count - 1
                used_by_group[block.group] += 1
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"{block} hash not mapped"
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
        assert shared == self.num_shared_refs, "shared reference counter drifted"
        assert cached_free == self.num_cached_free, "cached-free counter drifted"
        assert used_by_group == self.used_by_group, "per-group used counters drifted"
        assert cached_by_group == self.cached_by_group, "per-group cached counters drifted"
        assert self.num_used + self.num_free == self.num_blocks
