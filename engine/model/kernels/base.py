"""The decoder's elementwise and attention kernels: one interface, three backends.

``TorchKernels`` (here) is plain PyTorch and runs anywhere (CPU, CUDA, any dtype,
quantized KV caches, every ``AttentionParams``). ``NativeKernels`` (native.py) calls the
fused CPU ops in csrc/; ``TritonKernels`` (triton/triton_kernels.py) the Triton attention
and KV write. Both subclass ``TorchKernels`` and defer to it, call by call, for what their
kernels do not take (an fp8 cache on the CPU, a quantized cache write); all three take
every layer's window, soft-cap and sinks. ``select_kernels`` (select.py) picks one from
``--kernels``.

Contracts (``qkv`` is the fused projection output, ``[tokens, q + 2 kv]``):

- ``rms_norm(x, w)``: RMSNorm in float32, returned in x's dtype; a float32 ``w`` on a
  narrower ``x`` multiplies in float32 before rounding (Gemma's norms), else after.
- ``add_rms_norm(x, residual, w)`` adds ``x`` into ``residual`` in place and returns the
  normalised sum; ``x`` may be overwritten.
- ``rotary(qkv, ...)`` rotates the query and key heads in place and returns qkv; tables
  narrower than ``head_dim`` rotate only each head's leading part (partial rotary).
- ``silu_and_mul`` / ``gelu_tanh_and_mul``: ``act(gate) * up`` of ``[.., 2 n]``.
- ``write_kv`` stores every row's key/value heads at its slot; ``decode_attention``
  attends rows ``[0, meta.num_decodes)`` to their cached context and returns
  ``[num_decodes, heads * head_dim]``; ``prefill_attention`` attends the remaining rows
  (``meta.prefills``, after ``write_kv`` stored them) causally to their cached prefix and
  each other, returning ``[prefill rows, heads * head_dim]``; ``varlen_attention``
  attends every row of a ``meta.varlen`` step (the Triton backend's steps).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from engine.model.kernels.metadata import AttentionMetadata
from engine.model.kernels.params import AttentionParams
from engine.model.kernels.torch_attention import (
    decode_attention_torch,
    prefill_attention_torch,
    split_heads,
    varlen_attention_torch,
)
from engine.model.runtime.kv_cache import PagedKVCache
from engine.model.spec import ModelSpec


class Kernels(Protocol):
    """What the decoder calls; see the module docstring for each contract."""

    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor: ...

    def rotary(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        spec: ModelSpec,
    ) -> torch.Tensor: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax as ``torch.argmax`` defines it (first index of the largest
        value, a NaN counting as largest): ``[rows, vocab]`` float32 -> int64 ``[rows]``."""
        ...

    def write_kv(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        slots: torch.Tensor,
        spec: ModelSpec,
    ) -> None: ...

    def decode_attention(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        meta: AttentionMetadata,
        spec: ModelSpec,
        params: AttentionParams,
    ) -> torch.Tensor: ...

    def prefill_attention(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        meta: AttentionMetadata,
        spec: ModelSpec,
        params: AttentionParams,
    ) -> torch.Tensor: ...

    def varlen_attention(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        meta: AttentionMetadata,
        spec: ModelSpec,
        params: AttentionParams,
    ) -> torch.Tensor: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 (as the reference does), returned in x's dtype. Llama
    rounds the normalised row before the weight multiplies it; a float32 weight on a
    narrower x (Gemma's ``1 + w``, folded at load) multiplies first, as Gemma does."""
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32 and x.dtype != torch.float32:
        return (normed * weight).to(x.dtype)
    return weight * normed.to(x.dtype)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: the first index of its largest value (a NaN counts as largest),
    as ``argmax`` defines it; ``max``'s indices are the same tokens, and on torch 2.13 the
    two cost the same on the CPU. NativeKernels overrides this with one pass a row
    (csrc/argmax.cpp)."""
    return logits.max(dim=-1).indices


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
        rotated = heads[..., : cos.shape[-1]]  # all of each head unless rotary is partial
        cos_rows, sin_rows = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        rotated.copy_(apply_rotary(rotated, cos_rows, sin_rows))
        return qkv

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        return greedy_tokens(logits)

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
        params: AttentionParams,
    ) -> torch.Tensor:
        query, _, _ = split_heads(qkv, spec)
        return decode_attention_torch(layer, query, cache, meta, params)

    def prefill_attention(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        meta: AttentionMetadata,
        spec: ModelSpec,
        params: AttentionParams,
    ) -> torch.Tensor:
        return prefill_attention_torch(layer, qkv, spec, cache, meta, params)

    def varlen_attention(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        meta: AttentionMetadata,
        spec: ModelSpec,
        params: AttentionParams,
    ) -> torch.Tensor:
        """Every row of ``meta.varlen``, sequence by sequence (reads the tables on the
        host): a reference for the backends that launch it once."""
        assert meta.varlen is not None
        return varlen_attention_torch(layer, qkv, spec, cache, meta.varlen, params)
