"""Fixtures for the model tests: both kernel backends run the same parity checks."""

from __future__ import annotations

import pytest

from engine.model.kernels.base import TorchKernels
from engine.model.kernels.native import NativeKernels


@pytest.fixture(scope="module", params=["torch", "native"])
def kernels(request: pytest.FixtureRequest) -> TorchKernels:
    """Each backend in turn. The native one must build here: g++ and ninja are part of the
    supported CPU setup, so a failed build fails the tests instead of skipping them."""
    return NativeKernels() if request.param == "native" else TorchKernels()
