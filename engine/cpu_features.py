"""What the host CPU can do, read without importing torch.

Torch-free so that ``kvserve plan`` can mirror serve's ``--dtype auto`` without loading
the engine's builder (which imports torch and the model); engine.builder re-exports it.
"""

from __future__ import annotations

from pathlib import Path


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 matrix units (AMX or AVX512-BF16); without them torch's
    bf16 matmuls are emulated and slower than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags
