"""Measured memory, to set beside the plan's computed figures (engine/kv/accounting.py).

- CUDA: what the caching allocator holds (``torch.cuda.memory_reserved``: weights, KV
  pools, staging and cached activation blocks) and its high-water mark of live tensors
  (``torch.cuda.max_memory_allocated``).
- CPU: the resident bytes of the KV pools' own pages, asked of the kernel with
  ``mincore(2)`` over each pool tensor's address range. A pool the kernel never backed
  (untouched pages, or pages that went to swap) counts as not resident, so this is what
  the pools really cost in RAM, not what they were asked for. The page-aligned range may
  include up to one page of a neighbouring allocation at each end; the result is capped
  at the tensors' size.

Reading page residency or allocator counters is safe from any thread, and must stay free
of OpenMP-parallel torch ops: /metrics calls this on the server's event loop, and the
first parallel torch op on a thread gives that thread an OpenMP team of its own. With more
OpenMP workers than CPUs, libgomp stops spin-waiting in every team, so each of the
engine's ~300 parallel regions per step then waits for a sleeping worker: one scrape left
a single-stream server ~40% slower for the rest of its life (bench/bench_speculative.py
figures, docs/archive/benchmarks-log.md). The page count is numpy's.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import torch

_PAGE = mmap.PAGESIZE


def resident_bytes(tensors: list[torch.Tensor]) -> int | None:
    """Bytes of the CPU tensors' memory resident in RAM; None where mincore is missing."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    total = 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if size == 0:
            continue
        start = tensor.data_ptr() // _PAGE * _PAGE
        length = tensor.data_ptr() + size - start
        pages = -(-length // _PAGE)
        vector = (ctypes.c_ubyte * pages)()
        status = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector)
        if status != 0:
            return None
        resident_pages = int(np.count_nonzero(np.frombuffer(bytes(vector), dtype=np.uint8) & 1))
        total += min(size, resident_pages * _PAGE)
    return total


def measured_memory(
    device: torch.device, device_pool: list[torch.Tensor], host_pool: list[torch.Tensor]
) -> dict[str, int]:
    """Measured bytes by component: ``reserved`` and ``max_allocated`` on CUDA,
    ``kv_cache`` (resident device-pool pages) on the CPU, and ``host_kv_cache``
    (resident offload-pool pages) wherever there is a host pool."""
    out: dict[str, int] = {}
    if device.type == "cuda":
        out["reserved"] = int(torch.cuda.memory_reserved(device))
        out["max_allocated"] = int(torch.cuda.max_memory_allocated(device))
    elif device.type == "cpu":
        resident = resident_bytes(device_pool)
        if resident is not None:
            out["kv_cache"] = resident
    if host_pool:
        host = resident_bytes(host_pool)
        if host is not None:
            out["host_kv_cache"] = host
    return out
