"""Size of the /ui snapshot and the engine-thread capture time for a 100,000-block pool.

Real Scheduler and KV manager (no model: a constant-token runner), block size 16:

- ``busy``: 256 running requests of 300 prompt tokens sharing a 64-token prefix, 200
  finished ones whose blocks stay cached;
- ``full``: the pool nearly full: 1,000 requests of 1,590 tokens, then half of them
  finished and replaced (their tables come back from the free queue, reversed);
- ``worst``: one table of 50,000 blocks holding every other block id (no two consecutive:
  each block costs a whole range), encoded directly.

    python bench/bench_block_map.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import CacheConfig, SchedulerConfig
from engine.kv.accounting import KVShape
from engine.kv.block_map import BlockMapProbe, encode, id_ranges
from engine.outputs import RunnerOutput
from engine.request import Request, SamplingParams
from engine.scheduler import Scheduler

BLOCKS = 100_000
SHAPE = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, kv_dtype="bfloat16")


def scheduler() -> Scheduler:
    cache = CacheConfig(num_device_blocks=BLOCKS, block_size=16, watermark=0.0)
    config = SchedulerConfig(max_model_len=4096, max_num_seqs=2048, max_num_batched_tokens=1 << 22)
    return Scheduler(config, cache, SHAPE)


def add(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int) -> None:
    sched.add_request([Request(rid, prompt, SamplingParams(max_tokens=max_tokens), (0,))])


def step(sched: Scheduler) -> None:
    out = sched.schedule()
    sched.update(out, RunnerOutput({r.request_id: 1 for r in out.scheduled if r.sample}))


def busy() -> Scheduler:
    sched = scheduler()
    prefix = list(range(64))
    for i in range(256):
        add(sched, f"r{i}", prefix + [1000 + i * 300 + j for j in range(236)], 400)
        if i == 0:
            step(sched)
    for i in range(200):
        add(sched, f"done{i}", [500_000 + i] * 161, 1)
    step(sched)
    step(sched)
    return sched


def full() -> Scheduler:
    sched = scheduler()
    for i in range(1000):
        add(sched, f"a{i}", [10_000 * i + j for j in range(1590)], 2 if i % 2 else 400)
    for _ in range(3):
        step(sched)  # the odd ones finish: their blocks go back to the free queue
    for i in range(500):
        add(sched, f"b{i}", [20_000_000 + 10_000 * i + j for j in range(1590)], 400)
    step(sched)
    return sched


def measure(sched: Scheduler) -> dict[str, float]:
    probe = BlockMapProbe()
    times, cpu, body = [], [], b""
    for _ in range(5):
        started_cpu = time.process_time()
        capture = probe.capture(sched)
        cpu.append(time.process_time() - started_cpu)
        times.append(capture.capture_s)
        started = time.perf_counter()
        body = json.dumps(encode(capture), separators=(",", ":")).encode()
        encode_s = time.perf_counter() - started
    stats = sched.stats()
    return {
        "requests": len(sched.live_requests()),
        "used_blocks": stats.device_blocks.used,
        "cached_blocks": stats.device_blocks.cached,
        "bytes": len(body),
        "capture_wall_ms": statistics.median(times) * 1000,
        "capture_cpu_ms": statistics.median(cpu) * 1000,
        "encode_ms": encode_s * 1000,
    }


def main() -> int:
    for name, build in (("busy", busy), ("full", full)):
        print(name, measure(build()))
    worst = list(range(0, BLOCKS, 2))
    print("worst", {"held_blocks": len(worst), "ranges_bytes": len(json.dumps(id_ranges(worst)))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
