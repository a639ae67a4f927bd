"""Import first in Triton kernel tests: runs the kernels in Triton's CPU interpreter when
there is no GPU (TRITON_INTERPRET must be set before a kernel is decorated) and names the
device the tests put their tensors on. On a GPU machine the same tests run the compiled
kernels on the GPU instead."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
