"""KV events (engine/kv/events.py, engine/kv/event_publisher.py): what the cache announces
as it stores, demotes and drops blocks, and the bytes vLLM's decoders read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from engine.config import CacheConfig, KVEventsConfig
from engine.kv.event_publisher import WireEncoder
from engine.kv.events import (
    MEDIUM_DEVICE,
    MEDIUM_DISK,
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventRecorder,
    external_hash,
)
from engine.kv.groups import KVGroup
from engine.kv.manager import KVCacheManager
from engine.kv.tiers import TieredPrefixCache
from engine.request import Request, SamplingParams
from tests.unit.test_kv_tiers import FINGERPRINT, store

BLOCK = 4


def manager(blocks: int = 8, groups: tuple[KVGroup, ...] = ()) -> KVCacheManager:
    kv = KVCacheManager(CacheConfig(num_device_blocks=blocks, block_size=BLOCK), groups)
    kv.attach_events(KVEventRecorder(BLOCK, kv.groups))
    return kv


def request(rid: str, prompt: list[int], salt: str | None = None) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4), cache_salt=salt)


def compute(kv: KVCacheManager, req: Request, num_tokens: int) -> None:
    assert kv.allocate_slots(req, num_tokens) is not None
    req.num_computed_tokens += num_tokens
    kv.cache_computed_blocks(req)


def take(kv: KVCacheManager) -> list[Any]:
    assert kv.events is not None
    return kv.events.take()


def hashes_of(kv: KVCacheManager, rid: str) -> list[int]:
    return [external_hash(h) for h in kv._hashes[rid]]


def test_stored_blocks_carry_their_tokens_and_chain_to_their_parent() -> None:
    kv = manager()
    prompt = list(range(100, 114))  # 3 full blocks and 2 tokens
    first = request("a", prompt)
    compute(kv, first, len(prompt))
    (event,) = take(kv)
    assert isinstance(event, BlockStored)
    assert event.block_hashes == tuple(hashes_of(kv, "a"))
    assert event.parent_block_hash is None
    assert event.token_ids == tuple(prompt[:12])
    assert (event.block_size, event.medium, event.group_idx) == (BLOCK, MEDIUM_DEVICE, 0)
    assert event.kv_cache_spec_kind == "full_attention" and event.extra_keys is None
    # Decoding fills the fourth block: one more event, chained to the third.
    for token in (7, 8):
        first.append_output_token(token)
        compute(kv, first, 1)
    (more,) = take(kv)
    assert isinstance(more, BlockStored)
    assert more.parent_block_hash == event.block_hashes[-1]
    assert more.token_ids == (112, 113, 7, 8)
    # A second request on the same prefix stores nothing the pool already holds.
    second = request("b", [*prompt[:12], 1, 2, 3, 4, 5])
    hit = kv.find_cached_prefix(second)
    assert kv.allocate_slots(second, 5, hit) is not None
    second.num_computed_tokens = 17
    kv.cache_computed_blocks(second)
    (only_new,) = take(kv)
    assert isinstance(only_new, BlockStored)
    assert only_new.parent_block_hash == event.block_hashes[-1]
    assert only_new.token_ids == (1, 2, 3, 4)


def test_eviction_in_a_tiny_pool_is_a_removal() -> None:
    kv = manager(blocks=3)
    first = request("a", list(range(12)))
    compute(kv, first, 12)
    stored = take(kv)[0].block_hashes
    kv.free(first)
    second = request("b", list(range(50, 58)))
    compute(kv, second, 8)  # two fresh blocks: the LRU two of the three cached ones go
    events = take(kv)
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(removed) == 1  # consecutive removals are merged
    # A table is freed tail first, so the tail blocks were evicted first.
    assert removed[0].block_hashes == (stored[2], stored[1])
    assert removed[0].medium == MEDIUM_DEVICE


def test_a_cache_salt_rides_in_the_first_blocks_extra_keys() -> None:
    kv = manager()
    compute(kv, request("a", list(range(9)), salt="tenant-a"), 9)
    (event,) = take(kv)
    assert isinstance(event, BlockStored)
    assert event.extra_keys == (("tenant-a",), None)


def test_sliding_groups_announce_their_group_and_window() -> None:
    groups = (KVGroup((0,)), KVGroup((1,), window=4))
    kv = manager(blocks=16, groups=groups)
    compute(kv, request("a", list(range(13))), 13)
    events = take(kv)
    by_group = {e.group_idx: e for e in events if isinstance(e, BlockStored)}
    assert by_group[0].kv_cache_spec_kind == "full_attention"
    assert by_group[1].kv_cache_spec_kind == "sliding_window"
    assert by_group[1].kv_cache_spec_sliding_window == 4
    # Same prefix, same hashes: the group is a field, not part of the hash.
    assert by_group[1].block_hashes == by_group[0].block_hashes[-len(by_group[1].block_hashes) :]


def test_tier_moves_change_the_medium(tmp_path: Path) -> None:
    kv = manager(blocks=3)
    disk = store(tmp_path, capacity=10**6)
    kv.attach_tiers(TieredPrefixCache(num_host_blocks=1, disk=disk))
    assert kv.events is not None
    kv.attach_events(kv.events)  # now the tiers report too
    first = request("a", list(range(12)))
    compute(kv, first, 12)
    stored = take(kv)[0].block_hashes
    keys = list(kv._hashes["a"])
    kv.free(first)
    compute(kv, request("b", list(range(50, 58))), 8)  # evicts two of a's blocks
    assert kv.tiers is not None
    for op in kv.tiers.take_ops():  # what the runner does with the disk stores
        if op.target == "disk":
            disk.submit(op.block_hash, lambda: b"payload")
    assert disk.flush(10)
    events = take(kv)
    moves = [
        (type(e).__name__, e.medium, e.block_hashes)
        for e in events
        if isinstance(e, BlockStored | BlockRemoved)
    ]
    tail, middle = (stored[2],), (stored[1],)
    # The tail block goes to the host tier; the next one pushes it on to disk.
    assert ("BlockStored", MEDIUM_HOST, tail) in moves
    assert ("BlockRemoved", MEDIUM_DEVICE, tail) in moves
    assert ("BlockStored", MEDIUM_HOST, middle) in moves
    assert ("BlockRemoved", MEDIUM_HOST, tail) in moves
    assert ("BlockStored", MEDIUM_DISK, tail) in moves
    # A tier store carries the tokens and parent the device store announced.
    on_disk = next(e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_DISK)
    assert on_disk.token_ids == (8, 9, 10, 11)
    assert on_disk.parent_block_hash == stored[1]
    assert kv.events.holds(keys[2]) == {MEDIUM_DISK}
    assert kv.events.holds(keys[1]) == {MEDIUM_HOST}
    assert kv.events.holds(keys[0]) == {MEDIUM_DEVICE}


def test_cleared_forgets_every_block() -> None:
    kv = manager()
    compute(kv, request("a", list(range(8))), 8)
    assert kv.events is not None
    key = kv._hashes["a"][0]
    assert kv.events.holds(key) == {MEDIUM_DEVICE}
    kv.events.cleared()
    events = take(kv)
    assert isinstance(events[-1], AllBlocksCleared)
    assert kv.events.holds(key) == frozenset()


def test_a_stuck_publisher_drops_events_instead_of_growing_without_bound() -> None:
    recorder = KVEventRecorder(BLOCK, max_pending=2)
    for i in range(5):
        recorder.stored([i.to_bytes(16, "big")], None, [1, 2, 3, 4])
    assert len(recorder.take()) == 2 and recorder.dropped == 3


# -- the wire --------------------------------------------------------------------------------


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredV(VllmEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemovedV(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksClearedV(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmEventBatch(VllmBatch):
    events: list[BlockStoredV | BlockRemovedV | AllBlocksClearedV]


def test_the_wire_is_what_vllm_decoders_read() -> None:
    big = 2**64 - 1  # the largest hash: msgpack's uint64
    events = [
        BlockStored((big, 7), None, tuple(range(8)), 4, MEDIUM_DEVICE, 0, "full_attention"),
        BlockRemoved((7,), MEDIUM_HOST, 0),
        AllBlocksCleared(),
    ]
    payload = WireEncoder().batch(events, ts=12.5)
    decoded = msgspec.msgpack.Decoder(VllmEventBatch).decode(payload)
    assert decoded.ts == 12.5 and decoded.data_parallel_rank == 0
    stored, removed, cleared = decoded.events
    assert isinstance(stored, BlockStoredV) and stored.block_hashes == [big, 7]
    assert stored.token_ids == list(range(8)) and stored.medium == "GPU"
    assert stored.lora_id is None and stored.group_idx == 0
    assert isinstance(removed, BlockRemovedV) and removed.medium == "CPU"
    assert isinstance(cleared, AllBlocksClearedV)
    # The raw layout: a positional batch, events as maps tagged by "type", defaults left out.
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 12.5 and raw[2] == 0
    assert list(raw[1][0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "group_idx",
        "kv_cache_spec_kind",
    ]
    assert raw[1][2] == {"type": "AllBlocksCleared"}


def test_the_config_is_vllms_json() -> None:
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6001",'
        ' "replay_endpoint": "tcp://*:6002", "topic": "kv", "buffer_steps": 5}'
    )
    assert config.publishes and config.endpoint == "tcp://*:6001"
    assert not KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "null"}'
    ).publishes
    with pytest.raises(ValueError, match="endpont"):
        KVEventsConfig.from_json('{"endpont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig(publisher="kafka")
    assert FINGERPRINT  # the disk tier helpers above come from test_kv_tiers
