"""Builds and loads the fused CPU kernels in csrc/ (``torch.ops.kvserve.*``).

The extension is compiled once per machine with torch's JIT extension builder (g++ and
ninja; about 25 s on two cores, the sources in parallel) and cached under
``TORCH_EXTENSIONS_DIR`` (by default ``~/.cache/torch_extensions``); later loads take well
under a second. The build targets the CPU features torch itself dispatches to (AVX2 /
AVX-512), and the cache name carries that capability, so a cache copied to an older CPU is
rebuilt rather than crashing.

The AVX-512 kernels (bf16 dot products, VNNI) are chosen at run time where the CPU has
the instructions; ``KVSERVE_CPU_ISA=avx2`` keeps the AVX2 family instead, so one machine
can test and time both (tests/model/test_cpu_isa.py).

``load_native_ops`` returns whether the ops are usable; it never raises for a failed build
(no compiler, no ninja): callers fall back to the torch kernels and say so.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "cpu_features.cpp",
    "elementwise.cpp",
    "paged_attention.cpp",
    "prefill_attention.cpp",
    "prefill_attention_bf16.cpp",
    "prefill_attention_amx.cpp",
    "int8_linear.cpp",
    "int8_linear_vnni.cpp",
    "int8_linear_avx2.cpp",
    "int4_linear.cpp",
    "bf16_linear.cpp",
    "token_mask.cpp",
    "block_copy.cpp",
    "decode_layers.cpp",
    "register.cpp",
)
_CAPABILITY_FLAGS: dict[str, list[str]] = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
}


@functools.lru_cache(maxsize=1)
def load_native_ops() -> bool:
    """Build (first time) and load the extension; True when ``torch.ops.kvserve`` works."""
    try:
        _build_and_load()
    except Exception as error:  # any build or load failure means "use the torch kernels"
        logger.warning("fused CPU kernels unavailable, using torch kernels: %s", error)
        return False
    return True


def native_ops_error() -> str | None:
    """Why the kernels did not load (for error messages), or None when they did."""
    if load_native_ops():
        return None
    return "the fused CPU kernels failed to build; see the warning above (needs g++ and ninja)"


def _build_and_load() -> None:
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    # -fopenmp matters: at::parallel_for is an inline OpenMP loop, serial without it. The
    # extension then links libgomp.so.1, which resolves to the copy torch already loaded.
    flags = ["-O3", "-fopenmp", *_CAPABILITY_FLAGS.get(capability, [])]
    cpp_extension.load(
        name=f"kvserve_cpu_ops_{capability.lower()}",
        sources=[str(CSRC / name) for name in SOURCES],
        extra_include_paths=[str(CSRC)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
