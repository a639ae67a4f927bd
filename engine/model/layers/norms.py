"""RMSNorm weights in the two conventions families use; one kernel computes both.

Every norm runs as ``kernels.rms_norm(x, w)`` (normalise in float32, multiply by ``w``).
Llama-style norms keep ``w`` in the model dtype and multiply after rounding the normalised
row. Gemma's compute ``x_norm * (1 + w)`` entirely in float32 before rounding: its weight
is stored as ``1 + w`` in float32 (folded once at load), and a float32 weight on a
narrower activation tells the kernel to multiply first (kernels/base.py, ``rms_norm``).
"""

from __future__ import annotations

import torch


def plain_norm_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A Llama-style RMSNorm weight, in the model dtype."""
    return weight.to(dtype).contiguous()


def offset_norm_weight(weight: torch.Tensor) -> torch.Tensor:
    """A Gemma-style RMSNorm weight ``w`` as the kernels take it: ``1 + w`` in float32."""
    return (weight.to(torch.float32) + 1.0).contiguous()
