"""The tiered prefix cache's planner (engine/kv/tiers.py) and disk store
(engine/kv/disk_store.py), without a model: ops, ordering, LRU, headers, faults."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest

from engine.config import CacheConfig
from engine.kv.accounting import (
    DISK_ENTRY_HEADER_BYTES,
    KVShape,
    disk_entry_bytes,
    plan_tiers,
)
from engine.kv.disk_store import SUFFIX, DiskFingerprint, DiskStore
from engine.kv.manager import KVCacheManager
from engine.kv.tiers import TieredPrefixCache
from engine.outputs import TierOp

FINGERPRINT = DiskFingerprint("m", "float32", "float32", 4, 2, 2, 8)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def store(path: Path, capacity: int = 10_000, **kwargs: int) -> DiskStore:
    return DiskStore(path, capacity, FINGERPRINT, **kwargs)


def write(disk: DiskStore, key: bytes, payload: bytes) -> None:
    assert disk.submit(key, lambda: payload)
    assert disk.flush(10)


# -- planner ------------------------------------------------------------------------------


def test_device_eviction_demotes_to_host_and_host_eviction_to_disk(tmp_path: Path) -> None:
    disk = store(tmp_path)
    tiers = TieredPrefixCache(num_host_blocks=2, disk=disk)
    tiers.demote(5, h(1))
    tiers.demote(6, h(2))
    tiers.demote(7, h(3))  # the host is full: its LRU block (h1) goes to disk first
    ops = tiers.take_ops()
    kinds = [(op.source, op.target, op.block_hash) for op in ops]
    assert kinds == [
        ("device", "host", h(1)),
        ("device", "host", h(2)),
        ("host", "disk", h(1)),
        ("device", "host", h(3)),
    ]
    # h3 reuses h1's host block, and the disk op reading it comes before the overwrite.
    assert ops[2].source_block == ops[3].target_block == ops[0].target_block
    assert tiers.host.lookup(h(1)) is None
    tiers.check_integrity()


def test_match_walks_host_then_disk_and_stops_at_the_first_gap(tmp_path: Path) -> None:
    disk = store(tmp_path)
    write(disk, h(2), b"x" * 8)
    tiers = TieredPrefixCache(num_host_blocks=4, disk=disk)
    tiers.demote(0, h(1))
    tiers.demote(1, h(3))
    tiers.take_ops()
    hits = tiers.match([h(1), h(2), h(3), h(4), h(3)])
    assert [(hit.tier, hit.block_hash) for hit in hits] == [
        ("host", h(1)),
        ("disk", h(2)),
        ("host", h(3)),
    ]
    tiers.count_lookup([h(1), h(2), h(3), h(4), h(3)])
    assert (tiers.counters["host"].hits, tiers.counters["host"].misses) == (2, 2)
    assert (tiers.counters["disk"].hits, tiers.counters["disk"].misses) == (1, 1)
    tiers.pin(hits)
    tiers.plan_loads("r", hits, [10, 11, 12])
    loads = tiers.take_ops()
    assert [(op.source, op.target_block, op.request_id) for op in loads] == [
        ("host", 10, "r"),
        ("disk", 11, "r"),
        ("host", 12, "r"),
    ]
    assert all(isinstance(op, TierOp) and op.is_load for op in loads)


def test_a_block_already_on_host_is_refreshed_not_copied_again() -> None:
    tiers = TieredPrefixCache(num_host_blocks=2)
    tiers.demote(0, h(1))
    tiers.demote(1, h(2))
    tiers.take_ops()
    tiers.demote(2, h(1))  # same content again: no copy; h1 becomes most recent
    assert tiers.take_ops() == []
    tiers.demote(3, h(3))  # evicts h2, the least recent
    assert tiers.host.lookup(h(2)) is None and tiers.host.lookup(h(1)) is not None


def test_manager_demotes_evicted_device_blocks_through_the_pool_hook() -> None:
    kv = KVCacheManager(CacheConfig(num_device_blocks=2, block_size=4, watermark=0.0))
    tiers = TieredPrefixCache(num_host_blocks=4)
    kv.attach_tiers(tiers)
    (block,) = kv.device.allocate(1)
    kv.device.cache_block(block, h(9))
    kv.device.free([block])
    kv.device.allocate(2)  # reuses the cached block: its contents go to host first
    (op,) = tiers.take_ops()
    assert (op.source, op.source_block, op.target, op.block_hash) == ("device", block, "host", h(9))


def cached_free_device_blocks(kv: KVCacheManager, hashes: list[bytes]) -> list[int]:
    """Allocate, register and free one device block per hash (tail-first, like a table)."""
    blocks = kv.device.allocate(len(hashes))
    for block, block_hash in zip(blocks, hashes, strict=True):
        kv.device.cache_block(block, block_hash)
    kv.device.free(reversed(blocks))
    return blocks


def test_write_ahead_copies_the_cached_blocks_next_in_line_once() -> None:
    # Registered directly in the pool, not through cache_computed_blocks: no write-through.
    kv = KVCacheManager(CacheConfig(num_device_blocks=8, block_size=4, watermark=0.0))
    tiers = TieredPrefixCache(num_host_blocks=4)
    kv.attach_tiers(tiers)
    blocks = cached_free_device_blocks(kv, [h(1), h(2), h(3)])
    # Free queue: 5 plain-free blocks, then the cached ones, last block of the table first.
    assert kv.write_ahead(window=5) == [], "nothing cached within the first 5"
    ops = kv.write_ahead(window=7)
    assert [(op.source, op.source_block, op.target, op.block_hash) for op in ops] == [
        ("device", blocks[2], "host", h(3)),
        ("device", blocks[1], "host", h(2)),
    ]
    assert kv.write_ahead(window=8) == [
        TierOp("device", blocks[0], "host", ops[-1].target_block + 1, h(1))
    ], "h3 and h2 are on host already: only h1 is copied"
    # Evicting written-ahead blocks moves nothing inside the step.
    kv.device.allocate(8)
    assert tiers.take_ops() == []
    assert all(tiers.host.lookup(x) is not None for x in (h(1), h(2), h(3)))
    tiers.check_integrity()


def test_a_block_evicted_before_its_write_ahead_is_copied_in_the_step() -> None:
    kv = KVCacheManager(CacheConfig(num_device_blocks=2, block_size=4, watermark=0.0))
    tiers = TieredPrefixCache(num_host_blocks=4)
    kv.attach_tiers(tiers)
    (block,) = cached_free_device_blocks(kv, [h(7)])
    kv.device.allocate(2)  # freed and evicted between two write-aheads
    (op,) = tiers.take_ops()
    assert (op.source, op.source_block, op.target) == ("device", block, "host")


def test_a_host_eviction_by_a_write_ahead_is_stored_to_disk_before_the_copy(
    tmp_path: Path,
) -> None:
    tiers = TieredPrefixCache(num_host_blocks=1, disk=store(tmp_path))
    kv = KVCacheManager(CacheConfig(num_device_blocks=4, block_size=4, watermark=0.0))
    kv.attach_tiers(tiers)
    cached_free_device_blocks(kv, [h(1)])
    first = kv.write_ahead(window=4)
    cached_free_device_blocks(kv, [h(2)])  # reuses a plain-free block; h1 stays cached
    ops = kv.write_ahead(window=4)
    kinds = [(op.source, op.target, op.block_hash) for op in ops]
    assert kinds == [("host", "disk", h(1)), ("device", "host", h(2))]
    assert ops[0].source_block == ops[1].target_block == first[0].target_block
    assert tiers.take_ops() == [], "nothing of it runs inside the step"


def test_write_through_copies_each_registered_block_once_while_it_is_in_use() -> None:
    kv = KVCacheManager(CacheConfig(num_device_blocks=4, block_size=4, watermark=0.0))
    tiers = TieredPrefixCache(num_host_blocks=8)
    kv.attach_tiers(tiers)
    held, evicted = kv.device.allocate(2)
    for block, block_hash in ((held, h(1)), (evicted, h(2))):
        kv.device.cache_block(block, block_hash)
        tiers.note_registered(block, block_hash)
    kv.device.free([evicted])
    kv.device.allocate(3)  # evicts h2 before any write-ahead: copied in the step
    assert [op.block_hash for op in tiers.take_ops()] == [h(2)]
    (op,) = kv.write_ahead(window=0)  # h2's block holds something else now: skipped
    assert (op.source_block, op.target, op.block_hash) == (held, "host", h(1))
    assert kv.device.ref_count(held) == 1, "copied while still in use"
    tiers.note_registered(held, h(1))
    assert kv.write_ahead(window=0) == [], "once"


def test_a_block_already_on_disk_is_not_copied_again_at_eviction(tmp_path: Path) -> None:
    disk = store(tmp_path)
    write(disk, h(1), b"x" * 16)  # written through earlier, passed on by the host's LRU
    tiers = TieredPrefixCache(num_host_blocks=2, disk=disk)
    tiers.demote(3, h(1))
    assert tiers.take_ops() == []
    assert tiers.match([h(1)])[0].tier == "disk"


def test_forget_writes_drops_the_host_entries_of_a_failed_write_ahead() -> None:
    kv = KVCacheManager(CacheConfig(num_device_blocks=4, block_size=4, watermark=0.0))
    tiers = TieredPrefixCache(num_host_blocks=4)
    kv.attach_tiers(tiers)
    cached_free_device_blocks(kv, [h(1), h(2)])
    ops = kv.write_ahead(window=4)
    assert tiers.match([h(2), h(1)]) != []
    tiers.forget_writes(ops)
    assert tiers.match([h(1)]) == [] and tiers.match([h(2)]) == []
    assert kv.device.lookup(h(1)) is not None, "the device copies stay cached"
    tiers.check_integrity()
    # The next write-ahead copies them again.
    assert len(kv.write_ahead(window=4)) == 2


def test_tier_accounting_is_single_sourced() -> None:
    shape = KVShape(2, 2, 8, "float32")
    per_block = 2 * 2 * 2 * 8 * 4 * 4  # K+V, layers, heads, head_dim, fp32, 4 tokens
    host, disk = plan_tiers(shape, 4, host_tier_bytes=10 * per_block, disk_tier_bytes=10_000)
    assert (host.name, host.num_blocks, host.token_capacity) == ("host", 10, 40)
    assert disk.num_blocks == 10_000 // (per_block + DISK_ENTRY_HEADER_BYTES)
    assert disk_entry_bytes(shape, 4) == per_block + DISK_ENTRY_HEADER_BYTES
    assert plan_tiers(shape, 4, 0, 0) == ()


# -- disk store -----------------------------------------------------------------------------


def test_disk_entries_round_trip_and_survive_a_restart(tmp_path: Path) -> None:
    disk = store(tmp_path)
    write(disk, h(1), b"payload-1")
    assert disk.read(h(1)) == b"payload-1"
    disk.close()
    again = store(tmp_path)
    assert again.contains(h(1)) and again.read(h(1)) == b"payload-1"
    assert again.used_bytes == DISK_ENTRY_HEADER_BYTES + len(b"payload-1")


def test_disk_is_an_lru_bounded_by_size(tmp_path: Path) -> None:
    entry = DISK_ENTRY_HEADER_BYTES + 100
    disk = store(tmp_path, capacity=3 * entry)
    for i in range(3):
        write(disk, h(i), bytes([i]) * 100)
    assert disk.read(h(0)) is not None  # h0 is now the most recent
    write(disk, h(3), b"z" * 100)  # evicts h1
    assert [disk.contains(h(i)) for i in range(4)] == [True, False, True, True]
    assert disk.used_bytes <= 3 * entry
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 3


def test_a_truncated_or_foreign_entry_is_never_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk = store(tmp_path)
    write(disk, h(1), b"a" * 64)
    write(disk, h(2), b"b" * 64)
    disk.close()
    path = tmp_path / f"{h(1).hex()}{SUFFIX}"
    path.write_bytes(path.read_bytes()[:-5])
    caplog.set_level(logging.WARNING)
    other = DiskStore(tmp_path, 10_000, DiskFingerprint("other", "float32", "float32", 4, 2, 2, 8))
    assert other.num_entries == 0
    same = store(tmp_path)
    assert not same.contains(h(1)) and same.read(h(2)) == b"b" * 64
    assert sum("a truncated entry" in r.getMessage() for r in caplog.records) == 1


def test_a_full_write_queue_drops_instead_of_blocking(tmp_path: Path) -> None:
    gate = threading.Event()
    disk = store(tmp_path, queue_depth=1)

    def slow() -> bytes:
        gate.wait(10)
        return b"x"

    assert disk.submit(h(1), slow)  # taken by the worker, which now waits
    accepted = [disk.submit(h(i), lambda: b"y") for i in range(2, 6)]
    assert accepted.count(True) <= 2 and disk.dropped_writes >= 2
    gate.set()
    assert disk.flush(10)


def test_disk_full_stops_writing_logs_once_and_keeps_reads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk = store(tmp_path)
    write(disk, h(1), b"kept")

    def full(path: Path, data: bytes) -> None:
        path.write_bytes(data[:3])  # a partial file, as a real ENOSPC leaves
        raise OSError(errno.ENOSPC, "No space left on device")

    disk.write_file = full  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING)
    disk.submit(h(2), lambda: b"lost")
    disk.flush(10)
    assert not disk.writable and not disk.submit(h(3), lambda: b"never")
    assert disk.read(h(1)) == b"kept" and not disk.contains(h(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{h(1).hex()}{SUFFIX}"]
    assert sum("no more blocks are written" in r.getMessage() for r in caplog.records) == 1


def test_an_uncreatable_directory_disables_writes(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    disk = store(blocker / "kv")
    assert not disk.writable and not disk.submit(h(1), lambda: b"x")


def test_a_found_host_block_is_not_overwritten_while_its_load_is_planned() -> None:
    tiers = TieredPrefixCache(num_host_blocks=2)
    tiers.demote(0, h(1))
    tiers.demote(1, h(2))
    tiers.take_ops()
    hits = tiers.match([h(1)])  # h1 is the least recently used host block
    tiers.pin(hits)
    tiers.demote(2, h(3))  # allocating the load's device blocks evicts device blocks
    tiers.demote(3, h(4))
    tiers.plan_loads("r", hits, [7])
    ops = tiers.take_ops()
    pinned = hits[0].host_block
    assert all(op.target_block != pinned for op in ops if op.target == "host")
    assert ops[-1] == TierOp("host", pinned, "device", 7, h(1), "r")
    assert tiers.host.lookup(h(1)) is not None
    tiers.check_integrity()


# -- disk store: clean-up at start-up, rejections by reason, durability (issue 42) --------


def entry_path(directory: Path, key: bytes) -> Path:
    return directory / f"{key.hex()}{SUFFIX}"


def test_start_up_deletes_damaged_entries_and_crashed_writes(tmp_path: Path) -> None:
    disk = store(tmp_path)
    for i in range(1, 6):
        write(disk, h(i), bytes([i]) * 64)
    disk.close()
    paths = [entry_path(tmp_path, h(i)) for i in range(1, 6)]
    truncated, flipped, empty, bad_header, intact = paths
    truncated.write_bytes(truncated.read_bytes()[:-5])
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0x01
    flipped.write_bytes(bytes(data))
    empty.write_bytes(b"")
    bad_header.write_bytes(b"XXXXXXXX" + bad_header.read_bytes()[8:])
    leftovers = [tmp_path / f".{h(i).hex()}{SUFFIX}.tmp" for i in (7, 8)]
    for path in leftovers:
        path.write_bytes(b"half a block")

    again = store(tmp_path)
    # Headers and lengths are read at start-up: those files are gone before it returns.
    assert not any(p.exists() for p in (truncated, empty, bad_header, *leftovers))
    assert again.removed_temp_files == 2
    # Checksums are the writer's idle work; the flipped payload goes once it is checked.
    assert again.wait_verified(10)
    assert not flipped.exists()
    rejected = again.rejected_entries
    assert (rejected["truncated"], rejected["checksum"], rejected["empty"]) == (1, 1, 1)
    assert rejected["header"] == 1 and sum(rejected.values()) == 4
    assert again.read(h(5)) == bytes([5]) * 64
    assert again.num_entries == 1 and again.used_bytes == DISK_ENTRY_HEADER_BYTES + 64
    assert sorted(p.name for p in tmp_path.iterdir()) == [intact.name]


def test_a_corrupt_entry_found_by_a_read_is_deleted_and_counted_once(tmp_path: Path) -> None:
    disk = store(tmp_path)
    write(disk, h(1), b"a" * 64)
    assert disk.wait_verified(10)
    path = entry_path(tmp_path, h(1))
    data = bytearray(path.read_bytes())
    data[DISK_ENTRY_HEADER_BYTES] ^= 0xFF
    path.write_bytes(bytes(data))
    assert disk.read(h(1)) is None and disk.read(h(1)) is None
    assert not path.exists() and disk.used_bytes == 0
    assert disk.rejected_entries["checksum"] == 1


def test_foreign_entries_count_against_the_bound_and_are_evicted_first(tmp_path: Path) -> None:
    entry = DISK_ENTRY_HEADER_BYTES + 64
    mine = store(tmp_path)
    write(mine, h(1), b"a" * 64)
    write(mine, h(2), b"b" * 64)
    mine.close()
    other_fingerprint = DiskFingerprint("other", "float32", "float32", 4, 2, 2, 8)
    other = DiskStore(tmp_path, 3 * entry, other_fingerprint)
    assert other.num_entries == 0 and other.used_bytes == 2 * entry
    assert other.rejected_entries["fingerprint"] == 2
    assert entry_path(tmp_path, h(1)).exists()  # not deleted while there is room
    write(other, h(3), b"c" * 64)
    write(other, h(4), b"d" * 64)  # needs room: a foreign entry goes, not an own one
    assert other.used_bytes <= 3 * entry and other.num_entries == 2
    assert len([p for p in tmp_path.glob(f"*{SUFFIX}")]) == 3


def test_a_block_is_fsynced_before_the_rename_that_publishes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real fsync and rename run; the spy records which file each one touched."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: os.PathLike[str], dst: os.PathLike[str]) -> None:
        events.append(("replace", str(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    disk = store(tmp_path)
    write(disk, h(1), b"a" * 64)
    disk.close()
    # The temporary name is the writer's own (engine/kv/disk_shared.py): take it from the
    # rename that published the block.
    (tmp,) = [name for kind, name in events if kind == "replace"]
    assert Path(tmp).name.startswith(f".{h(1).hex()}{SUFFIX}.") and tmp.endswith(".tmp")
    assert events.index(("fsync", tmp)) < events.index(("replace", tmp))
    assert events[-1] == ("fsync", str(tmp_path))  # then the directory, once idle
