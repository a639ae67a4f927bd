"""The decoder's elementwise and attention kernels, behind one interface with two backends.

``TorchKernels`` is plain PyTorch and runs anywhere (CPU, CUDA, any dtype, quantized KV
caches). ``NativeKernels`` calls the fused CPU ops in csrc/ (built by native.py): one call
where the torch version dispatches five to fifteen ops, and decode attention that reads
K/V straight from the block table (int8 caches with their scales) instead of gathering a
padded copy. It defers to the torch version for what the fused ops do not cover: writing
a quantized KV cache (the torch write computes the scales) and reading an fp8 one.

Contracts shared by both (``qkv`` is the fused projection output, ``[tokens, q + 2 kv]``):

- ``add_rms_norm(x, residual, w)`` adds ``x`` into ``residual`` in place and returns the
  normalised sum; ``x`` may be overwritten.
- ``rotary(qkv, ...)`` rotates the query and key heads in place and returns qkv.
- ``write_kv`` stores every row's key/value heads at its slot; ``decode_attention``
  attends rows ``[0, meta.num_decodes)`` to their cached context and returns
  ``[num_decodes, heads * head_dim]``; ``prefill_attention`` attends the remaining rows
  (``meta.prefills``, after ``write_kv`` stored them) causally to their cached prefix and
  each other, returning ``[prefill rows, heads * head_dim]``. ``varlen_attention`` (the
  Triton backend only) attends every row of a ``meta.varlen`` step in one launch.

``select_kernels`` picks a backend from the ``--kernels`` flag (auto | native | torch |
triton). On CUDA, auto means ``TritonKernels`` (kernels/triton/triton_kernels.py: Triton
attention and KV write) when triton imports, else torch.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.model.kernels.metadata import (
    AttentionMetadata,
    decode_attention_torch,
    prefill_attention_torch,
    split_heads,
)
from engine.model.kernels.native import load_native_ops, native_ops_error
from engine.model.runtime.kv_cache import PagedKVCache
from engine.model.spec import ModelSpec

logger = logging.getLogger(__name__)
KERNEL_CHOICES: tuple[str, ...] = ("auto", "native", "torch", "triton")
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# KV storage the native attention reads directly (int8 with its per-token scales).
_NATIVE_CACHE_DTYPES = (*_NATIVE_DTYPES, torch.int8)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 (as the reference does), returned in x's dtype."""
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class TorchKernels:
    """Portable kernels in eager PyTorch."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        residual.add_(x)
        return rms_norm(residual, weight, eps)

    def rotary(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        spec: ModelSpec,
    ) -> torch.Tensor:
        # Query and key heads sit side by side at the front of each row: one pass rotates both.
        tokens = qkv.shape[0]
        rope_width = spec.q_size + spec.kv_size
        heads = qkv[:, :rope_width].view(tokens, spec.num_heads + spec.num_kv_heads, -1)
        heads.copy_(apply_rotary(heads, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)))
        return qkv

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def write_kv(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        slots: torch.Tensor,
        spec: ModelSpec,
    ) -> None:
        _, key, value = split_heads(qkv, spec)
        cache.write(layer, key, value, slots)

    def decode_attention(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        meta: AttentionMetadata,
        spec: ModelSpec,
        scale: float,
    ) -> torch.Tensor:
        query, _, _ = split_heads(qkv, spec)
        return decode_attention_torch(layer, query, cache, meta, scale)

    def prefill_attention(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        meta: AttentionMetadata,
        spec: ModelSpec,
        scale: float,
    ) -> torch.Tensor:
        return prefill_attention_torch(layer, qkv, spec, cache, meta, scale)

    def varlen_attention(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        meta: AttentionMetadata,
        spec: ModelSpec,
        scale: float,
    ) -> torch.Tensor:
        """Attend every row through ``meta.varlen`` in one launch; ``[tokens, heads *
        head_dim]``. Only backends whose attention reads block tables directly have it."""
        raise NotImplementedError(f"the {self.name} kernels take no varlen metadata")


class NativeKernels(TorchKernels):
    """Fused CPU kernels (torch.ops.kvserve); see csrc/ops.h."""

    name = "native"

    def __init__(self) -> None:
        if not load_native_ops():
            raise RuntimeError(native_ops_error())
        self.ops = torch.ops.kvserve

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        self.ops.rms_norm(out, x, weight, eps)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
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
        qkv = qkv.contiguous()
        rotated_heads = spec.num_heads + spec.num_kv_heads
        self.ops.rotary_(qkv, positions, cos, sin, rotated_heads, spec.head_dim)
        return qkv

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
        self.ops.silu_and_mul(out, x)
        return out

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
        scale: float,
    ) -> torch.Tensor:
        key_cache, value_cache = cache.layer(layer)
        if key_cache.dtype not in _NATIVE_CACHE_DTYPES:  # fp8 (stored as uint8)
            return super().decode_attention(cache, layer, qkv, meta, spec, scale)
        assert meta.decode_block_table is not None and meta.decode_context_lens is not None
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
            scale,
            *cache.layer_scales(layer),
        )
        return out

    def prefill_attention(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        meta: AttentionMetadata,
        spec: ModelSpec,
        scale: float,
    ) -> torch.Tensor:
        key_cache, value_cache = cache.layer(layer)
        tables = meta.prefill_tables
        if key_cache.dtype not in _NATIVE_CACHE_DTYPES or tables is None:  # fp8
            return super().prefill_attention(cache, layer, qkv, meta, spec, scale)
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
            scale,
            *cache.layer_scales(layer),
        )
        return out


def select_kernels(choice: str, device: torch.device, dtype: torch.dtype) -> TorchKernels:
    """The backend for ``--kernels``: auto uses the native ops on the CPU when they build
    and the Triton kernels on CUDA when triton is installed."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"--kernels must be one of {list(KERNEL_CHOICES)}, not {choice!r}")
    if choice == "triton" or (choice == "auto" and device.type == "cuda"):
        return _triton_kernels(device, required=choice == "triton")
    native_possible = device.type == "cpu" and dtype in _NATIVE_DTYPES
    if choice == "torch" or (choice == "auto" and not native_possible):
        return TorchKernels()
    if not native_possible:
        raise ValueError(
            f"--kernels native runs on the CPU only, not on {device.type}; use --kernels auto"
        )
    if choice == "auto" and not load_native_ops():
        return TorchKernels()
    return NativeKernels()


def _triton_kernels(device: torch.device, required: bool) -> TorchKernels:
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
