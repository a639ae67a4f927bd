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

Reading page residency or allocator counters is safe from any thread.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

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
        resident_pages = int(torch.frombuffer(vector, dtype=torch.uint8).bitwise_and(1).sum())
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
