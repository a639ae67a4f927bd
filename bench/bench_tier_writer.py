"""What a copy on a second thread does to the forward beside it, on the CPU.

The tier writer (engine/model/runtime/tier_io.py) copies blocks to the host tier while the step's
forward runs. This times a forward-like stack of GEMMs (30 layers, 64 rows, SmolLM2's
widths) alone, beside a thread copying 40 blocks per iteration with torch's
``index_select``/``index_copy_`` (as ``copy_blocks`` does), and beside the same copies by
the native memcpy op (``copy_blocks_serial_``), in alternating rounds; medians.

    .venv/bin/python bench/bench_tier_writer.py
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import torch

from engine.model.kernels.native import load_native_ops

LAYERS, HEADS, DEVICE_BLOCKS, HOST_BLOCKS, BLOCK, HEAD_DIM = 30, 3, 320, 1456, 16, 64
BLOCKS_PER_STEP = 40

Pairs = list[tuple[int, int]]


def main() -> None:
    assert load_native_ops(), "needs the native ops (g++ and ninja)"
    device = torch.zeros(LAYERS, HEADS, DEVICE_BLOCKS, BLOCK, HEAD_DIM)
    host = torch.zeros(LAYERS, HEADS, HOST_BLOCKS, BLOCK, HEAD_DIM)
    x = torch.randn(64, 576)
    up = [torch.randn(576, 1536) for _ in range(LAYERS)]
    down = [torch.randn(1536, 576) for _ in range(LAYERS)]

    def forward() -> None:
        h = x
        for a, b in zip(up, down, strict=True):
            h = torch.relu(h @ a) @ b

    def torch_copy(pairs: Pairs) -> None:
        src = torch.tensor([p[0] for p in pairs])
        dst = torch.tensor([p[1] for p in pairs])
        for _ in range(2):  # K and V
            for layer in range(LAYERS):
                host[layer].index_copy_(1, dst, torch.index_select(device[layer], 1, src))

    def memcpy_copy(pairs: Pairs) -> None:
        sources, targets = [p[0] for p in pairs], [p[1] for p in pairs]
        for _ in range(2):
            torch.ops.kvserve.copy_blocks_serial_(host, device, sources, targets)

    def forward_ms(copy: Callable[[Pairs], None] | None, steps: int = 40) -> float:
        times = []
        for i in range(steps):
            pairs = [
                ((i * 7 + j) % DEVICE_BLOCKS, (i * 13 + j) % HOST_BLOCKS)
                for j in range(BLOCKS_PER_STEP)
            ]
            writer = None
            if copy is not None:
                writer = threading.Thread(target=copy, args=(pairs,))
                writer.start()
            start = time.perf_counter()
            forward()
            times.append(time.perf_counter() - start)
            if writer is not None:
                writer.join()
        return statistics.median(times[5:]) * 1e3

    modes = {"alone": None, "torch copies beside": torch_copy, "memcpy beside": memcpy_copy}
    results: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(4):
        for name, copy in modes.items():
            results[name].append(forward_ms(copy))
    print(f"torch threads {torch.get_num_threads()}; {BLOCKS_PER_STEP} blocks copied per step")
    for name, values in results.items():
        rounds = ", ".join(f"{v:.1f}" for v in values)
        print(f"forward {name:20s} median {statistics.median(values):6.1f} ms ({rounds})")
    for name, copy in (("torch", torch_copy), ("memcpy", memcpy_copy)):
        start = time.perf_counter()
        assert copy is not None
        copy([(j, j) for j in range(BLOCKS_PER_STEP)])
        print(f"the copy alone, {name}: {(time.perf_counter() - start) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
