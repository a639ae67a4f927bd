"""KV manager: allocate_slots, prefix hits, caching generated blocks, fork + CoW, swap."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig
from engine.kv.manager import KVCacheManager
from engine.request import Request, SamplingParams


def make_manager(blocks: int = 8, block_size: int = 4, host: int = 0) -> KVCacheManager:
    return KVCacheManager(
        CacheConfig(num_device_blocks=blocks, block_size=block_size, num_host_blocks=host)
    )


def make_request(rid: str, prompt: list[int], salt: str | None = None) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=16), cache_salt=salt)


def compute(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Allocate and mark ``num_tokens`` more tokens computed, as a step would."""
    assert kv.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens += num_tokens
    kv.cache_computed_blocks(request)


def test_allocate_slots_rounds_up_to_blocks_and_returns_only_new_ones() -> None:
    kv = make_manager()
    req = make_request("a", list(range(10)))
    assert kv.allocate_slots(req, 5) == [0, 1]
    req.num_computed_tokens = 5
    assert kv.allocate_slots(req, 3) == []  # fits in the second block
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 2) == [2]
    assert kv.block_table("a") == [0, 1, 2]
    kv.check_integrity()


def test_allocate_slots_returns_none_without_side_effects_when_full() -> None:
    kv = make_manager(blocks=2)
    req = make_request("a", list(range(12)))
    assert kv.allocate_slots(req, 12) is None
    assert kv.device.num_free == 2
    assert kv.allocate_slots(req, 8, reserve=1) is None  # the watermark must stay free
    assert kv.allocate_slots(req, 8) == [0, 1]
    kv.check_integrity()


def test_prefix_hit_is_capped_so_the_last_token_is_computed() -> None:
    kv = make_manager()
    first = make_request("a", list(range(8)))
    compute(kv, first, 8)
    same = make_request("b", list(range(8)))
    # 8 tokens = 2 full cached blocks, but the last token must be computed: 1 block hit.
    assert kv.find_cached_prefix(same).num_blocks == 1
    longer = make_request("c", [*range(8), 99])
    hit = kv.find_cached_prefix(longer)
    assert hit.tables[0] == kv.block_table("a")
    assert kv.allocate_slots(longer, 1, hit) == [2]
    assert kv.block_table("c") == [0, 1, 2]
    assert kv.device.ref_count(0) == 2
    kv.check_integrity()


def test_prefix_hit_stops_at_the_first_divergent_block_and_respects_the_salt() -> None:
    kv = make_manager()
    compute(kv, make_request("a", list(range(12))), 12)
    diverges = make_request("b", [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 12])
    assert kv.find_cached_prefix(diverges).num_blocks == 1
    salted = make_request("c", list(range(13)), salt="other-tenant")
    assert kv.find_cached_prefix(salted).num_blocks == 0


def test_freed_blocks_stay_cached_and_are_evicted_tail_first() -> None:
    kv = make_manager(blocks=4)
    req = make_request("a", list(range(12)))
    compute(kv, req, 12)
    kv.free(req)
    assert kv.device.num_cached_free == 3
    order = [b.block_id for b in kv.device.free_queue]
    assert order == [3, 2, 1, 0]  # the head block (0) is evicted last
    again = make_request("b", [*range(12), 5])
    assert kv.find_cached_prefix(again).num_blocks == 3
    kv.check_integrity()


def test_generated_tokens_become_cacheable_once_their_block_is_full() -> None:
    kv = make_manager()
    req = make_request("a", [1, 2, 3])
    compute(kv, req, 3)
    for token in (4, 5, 6):  # decode: sample then compute the sampled token
        req.append_output_token(token)
        compute(kv, req, 1)
    # Blocks [1,2,3,4] and [5,6,...] -- only the first is full and computed.
    next_turn = make_request("b", [1, 2, 3, 4, 5, 6, 7])
    assert kv.find_cached_prefix(next_turn).tables[0] == [kv.block_table("a")[0]]


def test_fork_shares_blocks_and_copy_on_write_separates_the_partial_block() -> None:
    kv = make_manager()
    parent = make_request("p", list(range(6)))
    compute(kv, parent, 6)
    child = make_request("c", list(range(6)))
    kv.fork(parent, child)
    assert kv.block_table("c") == kv.block_table("p") == [0, 1]
    assert kv.device.num_shared_refs == 2
    kv.check_integrity()
    child.num_computed_tokens = 5  # recompute the last prompt token
    new = kv.allocate_slots(child, 1)
    assert new == [2]
    assert kv.take_copies() == [(1, 2)]
    assert kv.block_table("c") == [0, 2]
    assert kv.device.ref_count(1) == 1  # the parent, the last holder, writes in place
    parent.append_output_token(7)
    assert kv.allocate_slots(parent, 1) == []
    assert kv.take_copies() == []
    kv.check_integrity()


def test_fork_at_a_block_boundary_copies_the_full_shared_block() -> None:
    kv = make_manager()
    parent = make_request("p", list(range(8)))
    compute(kv, parent, 8)
    child = make_request("c", list(range(8)))
    kv.fork(parent, child)
    child.num_computed_tokens = 7
    assert kv.allocate_slots(child, 1) == [2]
    assert kv.take_copies() == [(1, 2)]
    kv.check_integrity()


def test_swap_out_and_in_round_trip() -> None:
    kv = make_manager(blocks=4, host=4)
    req = make_request("a", list(range(6)))
    compute(kv, req, 6)
    assert kv.can_swap_out(req)
    out = kv.swap_out(req)
    assert out == [(0, 0), (1, 1)]
    assert kv.block_table("a") == [] and kv.host_tables["a"] == [[0, 1]]
    assert kv.device.num_used == 0 and kv.host.num_used == 2
    kv.check_integrity()
    assert kv.can_swap_in(req)
    back = kv.swap_in(req)
    assert [host for host, _ in back] == [0, 1]
    assert kv.block_table("a") == [dev for _, dev in back]
    assert kv.host.num_used == 0
    kv.check_integrity()


def test_swap_out_saves_the_source_of_a_copy_made_in_the_same_step() -> None:
    kv = make_manager(blocks=6, host=4)
    parent = make_request("p", list(range(6)))
    compute(kv, parent, 6)
    child = make_request("c", list(range(6)))
    kv.fork(parent, child)
    child.num_computed_tokens = 5
    kv.allocate_slots(child, 1)  # copy (1 -> 2) pending for this step
    pairs = kv.swap_out(child)
    assert pairs == [(0, 0), (1, 1)]  # block 2 is not filled yet: save block 1 instead
    assert kv.take_copies() == []
    kv.check_integrity()


def test_swap_out_needs_host_room() -> None:
    kv = make_manager(blocks=4, host=1)
    req = make_request("a", list(range(6)))
    compute(kv, req, 6)
    assert not kv.can_swap_out(req)


def test_free_releases_device_and_host_and_ignores_unknown_requests() -> None:
    kv = make_manager(blocks=4, host=4)
    req = make_request("a", list(range(6)))
    compute(kv, req, 6)
    kv.swap_out(req)
    kv.free(req)
    kv.free(make_request("never-seen", [1]))
    assert kv.host.num_used == 0 and kv.device.num_used == 0
    kv.check_integrity()


def test_integrity_check_catches_a_ref_count_that_does_not_match_the_tables() -> None:
    kv = make_manager()
    compute(kv, make_request("a", list(range(6))), 6)
    kv.tables["a"][0].append(5)  # a table entry the pool does not know about
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_freeing_a_request_withdraws_its_pending_copies() -> None:
    kv = make_manager()
    parent = make_request("p", list(range(6)))
    compute(kv, parent, 6)
    child = make_request("c", list(range(6)))
    kv.fork(parent, child)
    child.num_computed_tokens = 5
    kv.allocate_slots(child, 1)  # copy pending
    kv.free(child)  # preempted (recompute) in the same step
    assert kv.take_copies() == []
    assert kv.block_table("p") == [0, 1] and kv.device.num_used == 2
    kv.check_integrity()
