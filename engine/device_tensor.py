"""Small tensors of Python values on the compute device, without a host sync.

``torch.tensor(values, device="cuda")`` copies from pageable memory, which blocks the host
until the copy is done, so every per-row parameter the sampler ships (temperatures, top-k,
index lists) would be a host sync of its own. Built in pinned memory and copied with
``non_blocking=True`` they queue behind the step's kernels instead, and a step's one host
sync is reading the sampled ids back. On the CPU this is plain ``torch.tensor``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[float] | Sequence[int] | Sequence[bool],
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``; asynchronous on CUDA."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
