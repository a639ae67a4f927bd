"""Block pool: states, ref counts, LRU eviction order, lazy eviction, O(1) middle removal."""

from __future__ import annotations

import pytest

from engine.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock
from engine.kv.hashing import extend_block_hashes, hash_block


def free_order(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue]


def test_fresh_pool_is_all_free() -> None:
    pool = BlockPool(4)
    assert (pool.num_free, pool.num_used, pool.num_cached_free) == (4, 0, 0)
    assert free_order(pool) == [0, 1, 2, 3]
    pool.check_integrity()


def test_allocate_takes_from_the_head_and_free_appends_in_given_order() -> None:
    pool = BlockPool(5)
    ids = pool.allocate(3)
    assert ids == [0, 1, 2]
    assert pool.num_used == 3
    pool.free(reversed(ids))  # tail first, as the manager frees a table
    assert free_order(pool) == [3, 4, 2, 1, 0]
    pool.check_integrity()


def test_allocate_more_than_free_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.allocate(3)


def test_shared_refs_are_counted_and_released() -> None:
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.touch([block, block])
    assert pool.ref_count(block) == 3
    assert pool.num_shared_refs == 2
    pool.free([block])
    pool.free([block])
    assert pool.num_shared_refs == 0 and pool.num_used == 1
    pool.free([block])
    assert pool.num_used == 0
    pool.check_integrity()


def test_double_free_is_an_invariant_violation() -> None:
    pool = BlockPool(1)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([block])


def test_cached_block_survives_free_and_is_revived_from_the_middle() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3)
    digest = hash_block(None, [1, 2])
    assert pool.cache_block(ids[1], digest)
    pool.free(reversed(ids))
    assert pool.num_cached_free == 1
    assert free_order(pool) == [3, 2, 1, 0]
    hit = pool.lookup(digest)
    assert hit is not None and hit.block_id == ids[1]
    pool.touch([hit.block_id])  # O(1) removal from the middle of the queue
    assert free_order(pool) == [3, 2, 0]
    assert pool.num_cached_free == 0 and pool.ref_count(ids[1]) == 1
    pool.check_integrity()


def test_eviction_is_lazy_and_least_recently_freed_first() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"a" * 16)
    pool.cache_block(b, b"b" * 16)
    pool.free([b, a])  # b freed first: evicted first
    assert pool.lookup(b"a" * 16) is not None and pool.lookup(b"b" * 16) is not None
    (reused,) = pool.allocate(1)
    assert reused == b
    assert pool.lookup(b"b" * 16) is None  # evicted only now
    assert pool.lookup(b"a" * 16) is not None
    pool.check_integrity()


def test_duplicate_content_is_not_cached_twice() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, b"x" * 16)
    assert not pool.cache_block(b, b"x" * 16)
    assert not pool.cache_block(a, b"y" * 16)  # already hashed
    pool.check_integrity()


def test_caching_disabled_never_caches() -> None:
    pool = BlockPool(1, enable_caching=False)
    (a,) = pool.allocate(1)
    assert not pool.cache_block(a, b"x" * 16)
    assert pool.lookup(b"x" * 16) is None


def test_integrity_check_catches_a_lost_block() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.blocks[a].ref_count = 0  # unreferenced but not in the free queue
    with pytest.raises(AssertionError, match="lost"):
        pool.check_integrity()


def test_free_queue_remove_from_middle() -> None:
    blocks = [KVBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3]
    assert queue.popleft().block_id == 0
    assert queue.size == 2


def test_hashes_chain_and_salt_isolates_tenants() -> None:
    tokens = list(range(8))
    plain: list[bytes] = []
    extend_block_hashes(plain, tokens, 2, 4)
    salted: list[bytes] = []
    extend_block_hashes(salted, tokens, 2, 4, extra="tenant-a")
    assert plain[0] == hash_block(None, [0, 1, 2, 3])
    assert plain[1] == hash_block(plain[0], [4, 5, 6, 7])
    assert plain[1] != hash_block(None, [4, 5, 6, 7])  # same tokens, other prefix
    assert salted[0] != plain[0] and salted[1] != plain[1]
