"""engine/kv/block_map.py: the block-map capture agrees with the pools, block for block."""

from __future__ import annotations

import json
import time
from pathlib import Path

from engine.config import CacheConfig, SchedulerConfig
from engine.kv import accounting
from engine.kv.accounting import KVShape
from engine.kv.block_map import (
    DISK_TIER,
    HOST_TIER,
    PREEMPTED,
    RUNNING,
    SWAPPED,
    WAITING,
    BlockMapProbe,
    encode,
    expand_ranges,
    id_ranges,
    kv_shape_facts,
)
from engine.kv.disk_store import DiskFingerprint, DiskStore
from engine.kv.tiers import TieredPrefixCache
from engine.outputs import RunnerOutput
from engine.request import SamplingParams
from engine.scheduler import Scheduler
from tests.unit.fakes import make_group

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, kv_dtype="float32")


def make_scheduler(blocks: int, host: int = 0, **kwargs: object) -> Scheduler:
    cache = CacheConfig(num_device_blocks=blocks, block_size=4, num_host_blocks=host, watermark=0)
    defaults: dict[str, object] = {"max_model_len": 256, "max_num_batched_tokens": 64}
    defaults.update(kwargs)
    return Scheduler(SchedulerConfig(**defaults), cache, SHAPE)  # type: ignore[arg-type]


def step(sched: Scheduler) -> None:
    out = sched.schedule()
    sched.update(out, RunnerOutput({r.request_id: 1 for r in out.scheduled if r.sample}))
    sched.check_integrity()


def decode_states(snapshot: dict, pool_name: str = "device") -> dict[int, str | int]:
    """What the page computes: block -> "free" | "cached" | ref count (from the tables)."""
    pool = next(p for p in snapshot["pools"] if p["name"] == pool_name)
    states: dict[int, str | int] = dict.fromkeys(range(pool["num_blocks"]), "free")
    for block_id in expand_ranges(pool["cached_lru"]):
        states[block_id] = "cached"
    for row in snapshot["requests"]:
        if row["pool"] == pool_name:
            for block_id in expand_ranges(row["ranges"]):
                held = states[block_id]
                states[block_id] = held + 1 if isinstance(held, int) else 1
    return states


def pool_states(sched: Scheduler) -> dict[int, str | int]:
    out: dict[int, str | int] = {}
    for block in sched.kv.device.blocks:
        if block.ref_count:
            out[block.block_id] = block.ref_count
        else:
            out[block.block_id] = "cached" if block.block_hash is not None else "free"
    return out


def snapshot_rows(body: bytes) -> list[dict]:
    rows: list[dict] = json.loads(body)["requests"]
    return rows


def test_id_ranges_round_trip_ascending_descending_and_single_runs() -> None:
    ids = [4, 5, 6, 9, 8, 7, 12, 20, 21, 3]
    assert id_ranges(ids) == [4, 6, 9, 7, 12, 12, 20, 21, 3, 3]
    assert expand_ranges(id_ranges(ids)) == ids
    assert id_ranges([]) == [] and expand_ranges([]) == []


def test_snapshot_decodes_to_the_pool_states_with_shared_and_cached_blocks() -> None:
    sched = make_scheduler(blocks=32)
    prompt = list(range(17))  # 4 full blocks + 1 token
    sched.add_request(make_group("a", prompt, SamplingParams(max_tokens=50)))
    step(sched)  # a computed its prompt: its 4 full blocks are cached
    sched.add_request(make_group("b", prompt, SamplingParams(max_tokens=50)))
    sched.add_request(make_group("c", [90, 91, 92, 93, 94], SamplingParams(max_tokens=1)))
    step(sched)  # b shares a's 4 prefix blocks; c finishes: its full block is cached-free
    snapshot = encode(BlockMapProbe().capture(sched))
    states = decode_states(snapshot)
    assert states == pool_states(sched)
    assert sum(1 for s in states.values() if s == 2) == 4  # the shared prefix
    assert "cached" in states.values()
    rows = {r["id"]: r for r in snapshot["requests"]}
    assert rows["b"]["prefix_hit_tokens"] == 16
    assert rows["a"]["state"] == RUNNING
    assert expand_ranges(rows["a"]["ranges"]) == sched.kv.block_table("a")
    tokens = rows["a"]["kv_tokens"]
    assert rows["a"]["payload_bytes"] == accounting.payload_bytes(SHAPE, tokens)
    assert rows["a"]["allocated_bytes"] == accounting.allocated_bytes(
        SHAPE, len(sched.kv.block_table("a")), 4
    )
    totals = snapshot["totals"]
    assert totals["running"] == 2 and totals["device"]["used"] == sched.kv.device.num_used


def test_cached_blocks_are_listed_in_eviction_order() -> None:
    sched = make_scheduler(blocks=16)
    for name, base in (("x", 0), ("y", 100)):
        sched.add_request(make_group(name, list(range(base, base + 9)), SamplingParams(1)))
        step(sched)
    capture = BlockMapProbe().capture(sched)
    expected = [b.block_id for b in sched.kv.device.free_queue if b.block_hash is not None]
    assert list(capture.pools[0].cached_lru) == expected
    assert len(expected) == 4  # two full blocks each, freed tail first


def test_prefix_cache_tiers_are_pools_of_cached_blocks(tmp_path: Path) -> None:
    """Evicted device prefixes land in the host tier, its evictions on disk; the page draws
    both tiers with their cached blocks in eviction order."""
    sched = make_scheduler(blocks=4)
    entry = accounting.disk_entry_bytes(SHAPE, 4)
    disk = DiskStore(tmp_path, 10 * entry, DiskFingerprint("m", "float32", "float32", 4, 2, 2, 8))
    sched.kv.attach_tiers(TieredPrefixCache(num_host_blocks=2, disk=disk))
    for i in range(6):  # each evicts cached prefixes of the ones before it
        sched.add_request(make_group(f"r{i}", list(range(100 * i, 100 * i + 9)), SamplingParams(1)))
        out = sched.schedule()
        for op in out.tier_ops:  # what the runner does with a write to disk
            if op.target == "disk":
                disk.submit(op.block_hash, lambda: b"kv")
        sched.update(out, RunnerOutput({r.request_id: 1 for r in out.scheduled if r.sample}))
    assert disk.flush(10)
    snapshot = encode(BlockMapProbe().capture(sched))
    pools = {p["name"]: p for p in snapshot["pools"]}
    assert list(pools) == ["device", "host", HOST_TIER, DISK_TIER]
    host_tier = sched.kv.tiers.host
    assert pools[HOST_TIER]["num_blocks"] == 2
    assert expand_ranges(pools[HOST_TIER]["cached_lru"]) == [
        b.block_id for b in host_tier.free_queue if b.block_hash is not None
    ]
    assert len(expand_ranges(pools[HOST_TIER]["cached_lru"])) == 2
    assert pools[DISK_TIER]["num_blocks"] == 10
    assert expand_ranges(pools[DISK_TIER]["cached_lru"]) == list(range(disk.num_entries))
    assert disk.num_entries > 0
    disk.close()


def test_a_server_without_tiers_shows_only_its_pools() -> None:
    snapshot = encode(BlockMapProbe().capture(make_scheduler(blocks=8)))
    assert [p["name"] for p in snapshot["pools"]] == ["device", "host"]


def test_states_waiting_preempted_and_swapped_with_time_in_state() -> None:
    sched = make_scheduler(blocks=4, host=4, preemption_mode="swap")
    sched.add_request(make_group("a", list(range(8)), SamplingParams(8), arrival_time=1.0))
    sched.add_request(make_group("b", list(range(100, 108)), SamplingParams(8), arrival_time=2.0))
    step(sched)
    arrival = time.monotonic() - 5.0
    sched.add_request(make_group("w", [5, 6], arrival_time=arrival))
    step(sched)  # a needs a third block: b (latest arrival) is swapped out
    probe = BlockMapProbe()
    rows = {r["id"]: r for r in encode(probe.capture(sched))["requests"]}
    assert rows["b"]["state"] == SWAPPED and rows["b"]["pool"] == "host"
    assert expand_ranges(rows["b"]["ranges"]) == sched.kv.host_tables["b"][0]
    assert rows["w"]["state"] == WAITING and rows["w"]["time_in_state_s"] >= 5.0
    assert decode_states(encode(probe.capture(sched)), "host").values() != {"free"}

    recompute = make_scheduler(blocks=4, preemption_mode="recompute")
    recompute.add_request(make_group("a", list(range(8)), SamplingParams(8), arrival_time=1.0))
    recompute.add_request(make_group("b", list(range(9, 17)), SamplingParams(8), arrival_time=2.0))
    step(recompute)
    step(recompute)
    rows = {r["id"]: r for r in encode(BlockMapProbe().capture(recompute))["requests"]}
    assert rows["b"]["state"] == PREEMPTED and rows["b"]["blocks"] == 0


def test_snapshot_at_100k_blocks_is_compact() -> None:
    """Size of the JSON the page receives for a 100,000-block pool under a busy mix:
    256 requests of 300 tokens sharing a 64-token prefix, plus freed (cached) ones."""
    blocks = 100_000
    sched = make_scheduler(
        blocks=blocks, max_model_len=2048, max_num_seqs=512, max_num_batched_tokens=1 << 20
    )
    prefix = list(range(64))
    for i in range(256):
        tail = [1000 + i * 300 + j for j in range(236)]
        sched.add_request(make_group(f"r{i}", prefix + tail, SamplingParams(max_tokens=400)))
        if i == 0:
            step(sched)
    for i in range(200):
        sched.add_request(make_group(f"done{i}", [50_000 + i] * 41, SamplingParams(max_tokens=1)))
    step(sched)
    step(sched)
    capture = BlockMapProbe().capture(sched)
    body = json.dumps(encode(capture), separators=(",", ":")).encode()
    assert decode_states(encode(capture)) == pool_states(sched)
    # 75 blocks per request in a few consecutive runs: the size follows the requests (about
    # 300 bytes a row), not the 100,000 blocks (bench/bench_block_map.py measures more mixes).
    assert len(body) < 100 * 1024, len(body)
    assert len(body) < 400 * len(snapshot_rows(body)), len(body)


def test_a_hybrid_model_shows_each_groups_blocks_and_the_window_bound() -> None:
    """The /ui picture of a hybrid cache: a row's blocks per KV group (a sliding group
    within ceil((W - 1) / S) + 1 of them however long the sequence), the totals per group,
    and the groups in the shape facts the page plans with."""
    from engine.kv.groups import KVGroup

    window, size = 8, 4
    shape = KVShape(2, 2, 8, "float32", (KVGroup((0,), window), KVGroup((1,), None)))
    cache = CacheConfig(num_device_blocks=64, block_size=size, watermark=0)
    config = SchedulerConfig(max_model_len=256, max_num_batched_tokens=64)
    sched = Scheduler(config, cache, shape)
    sched.add_request(make_group("a", list(range(30)), SamplingParams(max_tokens=40)))
    for _ in range(20):  # the prompt, then 19 decodes: 49 tokens, six windows
        step(sched)
    snapshot = encode(BlockMapProbe().capture(sched))
    (row,) = snapshot["requests"]
    sliding, full = row["group_blocks"]
    tokens = row["kv_tokens"]
    assert tokens >= 48 and full == -(-tokens // size)
    assert 1 <= sliding <= -(-(window - 1) // size) + 1
    assert len(expand_ranges(row["ranges"])) == sliding + full
    groups = snapshot["totals"]["groups"]
    assert [g["used"] for g in groups] == [sliding, full]
    assert groups[0]["payload_bytes"] < groups[1]["payload_bytes"]
    facts = kv_shape_facts(shape, size)["groups"]
    assert [(g["window"], g["num_layers"]) for g in facts] == [(window, 1), (None, 1)]
