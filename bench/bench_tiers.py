"""Load back vs recompute, per KV block, on this CPU: is a prefix-cache tier worth it?

For a prefix of ``--blocks`` blocks, times (interleaved repeats, medians):

- recompute: one prefill forward of the prefix's tokens (what a miss costs);
- host load: the tier ops that copy the blocks from the host tier into device blocks;
- disk load: read + verify (checksum) + copy from the disk tier (files in the page cache:
  a warm disk; a cold read adds the device's latency per block).

    PYTHONPATH=. python bench/bench_tiers.py [--model PATH] [--blocks 16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from engine.builder import build_engine
from engine.config import EngineArgs
from engine.outputs import ScheduledRequest, SchedulerOutput, TierOp
from engine.request import SamplingParams


def median_ms(fn: Callable[[], object], samples: list[float]) -> None:
    start = time.perf_counter()
    fn()
    samples.append((time.perf_counter() - start) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kernels", default="auto", choices=["auto", "native", "torch"])
    args = parser.parse_args()
    blocks, size = args.blocks, args.block_size
    with tempfile.TemporaryDirectory() as disk_dir:
        built = build_engine(
            EngineArgs(
                model=args.model,
                device="cpu",
                dtype=args.dtype,
                block_size=size,
                num_kv_blocks=4 * blocks,
                max_model_len=blocks * size,
                swap_space_gib=0.0,
                kv_cache_host_gib=0.5,
                kv_cache_disk_dir=disk_dir,
                kv_cache_disk_gib=1.0,
                kernels=args.kernels,
            )
        )
        core = built.core
        io = core.tier_io
        assert io is not None
        tokens = [100 + i % 1000 for i in range(blocks * size)]
        table = list(range(blocks))
        prefill = ScheduledRequest(
            request_id="bench",
            token_ids=tokens,
            num_computed_tokens=0,
            block_tables=[table],
            sample=False,
            sampling_params=SamplingParams(),
            prompt_token_ids=tokens,
            output_token_ids=[],
        )
        keys = [i.to_bytes(16, "big") for i in range(blocks)]
        core.runner.execute(SchedulerOutput(scheduled=[prefill]))  # warm up, fill blocks
        io.apply([TierOp("device", b, "host", b, keys[b]) for b in table])
        io.apply([TierOp("device", b, "disk", -1, keys[b]) for b in table], wait_for_disk=True)
        assert io.disk is not None and io.disk.flush(60)
        host_ops = [TierOp("host", b, "device", blocks + b, keys[b], "r") for b in table]
        disk_ops = [TierOp("disk", -1, "device", 2 * blocks + b, keys[b], "r") for b in table]
        results: dict[str, list[float]] = {"recompute": [], "host load": [], "disk load": []}
        for _ in range(args.repeats):
            median_ms(
                lambda: core.runner.execute(SchedulerOutput(scheduled=[prefill])),
                results["recompute"],
            )
            median_ms(lambda: io.apply(host_ops), results["host load"])
            median_ms(lambda: io.apply(disk_ops), results["disk load"])
        assert io.apply(disk_ops) == {"r": blocks}, "every disk block verified and loaded"
        io.close()
    recompute = statistics.median(results["recompute"]) / blocks
    print(
        f"model {built.model_name}, {built.dtype}, {args.kernels} kernels, "
        f"KV {built.kv_shape.kv_dtype}, "
        f"block {size} tokens = {built.plan.bytes_per_block / 1024:.0f} KiB, "
        f"prefix {blocks} blocks, {args.repeats} interleaved repeats, "
        f"load avg {os.getloadavg()[0]:.1f}"
    )
    for name, samples in results.items():
        per_block = statistics.median(samples) / blocks
        print(
            f"  {name:<10} {per_block:8.3f} ms/block  ({recompute / per_block:5.1f}x vs recompute)"
        )


if __name__ == "__main__":
    main()
