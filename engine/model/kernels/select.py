"""``--kernels``: which backend a model runs on.

On the CPU, auto means the native ops when they build (else torch); on CUDA, the Triton
kernels when triton imports (else torch). Triton is imported only when chosen, so a
CPU-only process never loads it.
"""

from __future__ import annotations

import logging

import torch

from engine.model.kernels.base import Kernels, TorchKernels
from engine.model.kernels.native import NATIVE_DTYPES, NativeKernels, load_native_ops

logger = logging.getLogger(__name__)
KERNEL_CHOICES: tuple[str, ...] = ("auto", "native", "torch", "triton")


def select_kernels(choice: str, device: torch.device, dtype: torch.dtype) -> Kernels:
    """The backend for ``--kernels``: auto uses the native ops on the CPU when they build
    and the Triton kernels on CUDA when triton is installed."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"--kernels must be one of {list(KERNEL_CHOICES)}, not {choice!r}")
    if choice == "triton" or (choice == "auto" and device.type == "cuda"):
        return _triton_kernels(device, required=choice == "triton")
    native_possible = device.type == "cpu" and dtype in NATIVE_DTYPES
    if choice == "torch" or (choice == "auto" and not native_possible):
        return TorchKernels()
    if not native_possible:
        raise ValueError(
            f"--kernels native runs on the CPU only, not on {device.type}; use --kernels auto"
        )
    if choice == "auto" and not load_native_ops():
        return TorchKernels()
    return NativeKernels()


def _triton_kernels(device: torch.device, required: bool) -> Kernels:
    """TritonKernels, imported lazily (a CPU-only process never loads triton); without
    triton, torch's kernels unless ``--kernels triton`` asked for it by name."""
    try:
        from engine.model.kernels.triton.triton_kernels import TritonKernels
    except ImportError as exc:
        if required:
            raise ValueError(f"--kernels triton needs triton installed: {exc}") from exc
        logger.warning("triton is not installed (%s); using the torch kernels", exc)
        return TorchKernels()
    return TritonKernels(device)
