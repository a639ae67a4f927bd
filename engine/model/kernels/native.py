"""The fused CPU kernels in csrc/ (``torch.ops.kvserve.*``): their build, and
``NativeKernels``, the backend that calls them.

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

``NativeKernels`` defers to the torch backend, call by call, for what the fused ops do not
cover: writing a quantized KV cache (the torch write computes the scales), reading an fp8
one, partial rotary and a float32 norm weight on a narrower activation (Gemma's norms).
The attention ops take each layer's window (work bounded by it: blocks before a window
are never read), soft-cap and sinks.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

from engine.model.kernels.base import TorchKernels
from engine.model.kernels.metadata import AttentionMetadata
from engine.model.kernels.params import AttentionParams
from engine.model.runtime.kv_cache import PagedKVCache
from engine.model.spec import ModelSpec

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "cpu_features.cpp",
    "elementwise.cpp",
    "argmax.cpp",
    "paged_attention.cpp",
    "prefill_attention.cpp",
    "prefill_attention_bf16.cpp",
    "prefill_attention_amx.cpp",
    "int8_linear.cpp",
    "int8_linear_vnni.cpp",
    "int8_linear_avx2.cpp",
    "int4_linear.cpp",
    "bf16_linear.cpp",
    "bf16_linear_amx.cpp",
    "f32_linear.cpp",
    "token_mask.cpp",
    "block_copy.cpp",
    "decode_layers.cpp",
    "moe.cpp",
    "lora.cpp",
    "register.cpp",
)
# Activation and weight dtypes the fused ops take.
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# KV storage the native attention reads directly (int8 with its per-token scales).
_NATIVE_CACHE_DTYPES = (*NATIVE_DTYPES, torch.int8)
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


def _headers_digest() -> str:
    """A short hash of csrc's headers: torch rebuilds when a source changes, not a header,
    so the headers name the build."""
    digest = hashlib.sha256()
    for header in sorted(CSRC.glob("*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:10]


def _build_and_load() -> None:
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    # -fopenmp matters: at::parallel_for is an inline OpenMP loop, serial without it. The
    # extension then links libgomp.so.1, which resolves to the copy torch already loaded.
    flags = ["-O3", "-fopenmp", *_CAPABILITY_FLAGS.get(capability, [])]
    cpp_extension.load(
        name=f"kvserve_cpu_ops_{capability.lower()}_{_headers_digest()}",
        sources=[str(CSRC / name) for name in SOURCES],
        extra_include_paths=[str(CSRC)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


class NativeKernels(TorchKernels):
    """Fused CPU kernels (torch.ops.kvserve); see csrc/ops.h."""

    name = "native"

    def __init__(self) -> None:
        if not load_native_ops():
            raise RuntimeError(native_ops_error())
        self.ops = torch.ops.kvserve

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if weight.dtype != x.dtype:  # Gemma's float32 norms multiply before rounding
            return super().rms_norm(x, weight, eps)
        x = x.contiguous()
        out = torch.empty_like(x)
        self.ops.rms_norm(out, x, weight, eps)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if weight.dtype != x.dtype:
            return super().add_rms_norm(x, residual, weight, eps)
        x = x.contiguous()
        self.ops.add_rms_norm(x, residual, weight, eps)
        return x

    def rotary(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        spec: ModelSpec,
    ) -> torch.Tensor:
        if cos.shape[-1] != spec.head_dim:  # partial rotary
            return super().rotary(qkv, positions, cos, sin, spec)
        qkv = qkv.contiguous()
        rotated_heads = spec.num_heads + spec.num_kv_heads
        self.ops.rotary_(qkv, positions, cos, sin, rotated_heads, spec.head_dim)
        return qkv

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
        self.ops.silu_and_mul(out, x)
        return out

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        # One pass a row (argmax.cpp, which has the timings against torch's reduction).
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0:
            return super().greedy_tokens(logits)
        return self.ops.argmax_rows(logits.contiguous())

    def write_kv(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        slots: torch.Tensor,
        spec: ModelSpec,
    ) -> None:
        if cache.is_quantized:
            super().write_kv(cache, layer, qkv, slots, spec)
            return
        key_cache, value_cache = cache.layer(layer)
        self.ops.write_kv(
            key_cache, value_cache, qkv, slots, spec.num_heads, spec.num_kv_heads, spec.head_dim
        )

    def decode_attention(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        meta: AttentionMetadata,
        spec: ModelSpec,
        params: AttentionParams,
    ) -> torch.Tensor:
        key_cache, value_cache = cache.layer(layer)
        assert meta.decode_block_table is not None and meta.decode_context_lens is not None
        if key_cache.dtype not in _NATIVE_CACHE_DTYPES:  # fp8
            return super().decode_attention(cache, layer, qkv, meta, spec, params)
        out = qkv.new_empty(meta.num_decodes, spec.q_size)
        self.ops.paged_decode_attention(
            out,
            qkv,
            key_cache,
            value_cache,
            meta.decode_block_table,
            meta.decode_context_lens,
            spec.num_heads,
            spec.num_kv_heads,
            params.scale,
            *cache.layer_scales(layer),
            *params.kernel_args(),
        )
        return out

    def prefill_attention(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        meta: AttentionMetadata,
        spec: ModelSpec,
        params: AttentionParams,
    ) -> torch.Tensor:
        key_cache, value_cache = cache.layer(layer)
        tables = meta.prefill_tables
        if key_cache.dtype not in _NATIVE_CACHE_DTYPES or tables is None:  # fp8
            return super().prefill_attention(cache, layer, qkv, meta, spec, params)
        rows = qkv[meta.num_decodes :]  # a row slice of a contiguous tensor: no copy
        out = qkv.new_empty(rows.shape[0], spec.q_size)
        self.ops.paged_prefill_attention(
            out,
            rows,
            key_cache,
            value_cache,
            tables.block_table,
            tables.query_starts,
            tables.num_computed,
            spec.num_heads,
            spec.num_kv_heads,
            params.scale,
            *cache.layer_scales(layer),
            *params.kernel_args(),
        )
        return out
