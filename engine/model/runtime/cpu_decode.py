"""The CPU decode fast path: every decoder layer of a decode step in one native call.

A single-stream decode step on two cores takes ~4 ms with int4 weights, and ~1.3 ms of
that was Python and torch's dispatcher: ten op calls a layer (norms, four projections,
rotary, KV write, attention, SiLU) times thirty layers. ``torch.ops.kvserve.decode_layers``
(kernels/csrc/decode_layers.cpp) runs the same kernels in the same order from C++, so its
output is bit-identical to ``DecoderModel.forward``'s loop (tests/model/test_cpu_decode.py).

It runs Llama-shaped layers only (``PlainLayer``: pre-norm attention and SwiGLU MLP, plain
attention), optionally with Qwen3's per-head QK-norm and with mixture-of-experts layers in
place of the MLP (the native MoE op, runtime/cpu_moe.py); the decoder decides whether a
model's layers are (layers/decoder.py).
``DecodeLayers.build`` describes each projection once, as the few-row kernel it takes and
its tensors; ``serves`` says whether a step can take the path: at most ``MAX_ROWS`` decode
rows (so every projection is on its few-row kernel) and no prefill, an unquantized KV
cache, no context reaching past a sliding window, and a model whose projections have no
bias and all have such a kernel. Everything else (prefills, larger batches, fp8/int8
caches, biased or fbgemm-only projections) runs the Python loop.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.model.kernels.metadata import AttentionMetadata
from engine.model.layers.linear import (
    BF16_ROWWISE_MAX_ROWS,
    INT4_INTEGER_MAX_ROWS,
    NATIVE_ACTIVATION_DTYPES,
    ROWWISE_MAX_ROWS,
    DenseLinear,
    Int4Linear,
    Int8Linear,
    Linear,
)
from engine.model.runtime.kv_cache import PagedKVCache
from engine.model.spec import ModelSpec

# Rows every projection serves with its few-row kernel (the smallest of their limits).
MAX_ROWS = min(ROWWISE_MAX_ROWS, BF16_ROWWISE_MAX_ROWS, INT4_INTEGER_MAX_ROWS)
_UNUSED = torch.empty(0)
_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class LinearKind(enum.IntEnum):
    """The kernel a projection takes (csrc/projection.h's LinearKind)."""

    DENSE = 0  # at::linear: float32 / float16 weights
    DENSE_BF16 = 1  # bf16_linear: bf16 weights on a CPU with AVX512_BF16
    INT8_INTEGER = 2  # int8_linear_vnni (VNNI or AVX2): weights, per-row scales
    INT8_FLOAT = 3  # int8_linear on float32 activations: weights, per-row scales
    INT4 = 4  # int4_linear: packed codes, Q4_1 parameters
    DENSE_F32 = 5  # f32_linear: row-wise float32 weights (an MoE's experts) on AVX2 + FMA
    UNUSED = -1  # decode_layers: no projection here (an MoE layer's gate_up and down)


_UNUSED_OPERANDS = (LinearKind.UNUSED, _UNUSED, _UNUSED)


def projection_operands(
    linear: Linear, dtype: torch.dtype, allow_bias: bool = False
) -> tuple[LinearKind, torch.Tensor, torch.Tensor] | None:
    """``(kind, a, b)`` for a projection a native path can run on ``dtype`` activations
    (one with a bias only if ``allow_bias``: the caller passes it on), or None."""
    if not allow_bias and getattr(linear, "bias", None) is not None:
        return None
    if isinstance(linear, DenseLinear):
        return dense_kind(linear), linear.weight, _UNUSED
    if isinstance(linear, Int8Linear) and linear.rowwise is not None:
        integer = linear.integer and dtype in NATIVE_ACTIVATION_DTYPES
        return (LinearKind.INT8_INTEGER if integer else LinearKind.INT8_FLOAT), *linear.rowwise
    if isinstance(linear, Int4Linear) and dtype in NATIVE_ACTIVATION_DTYPES:
        return LinearKind.INT4, linear.packed, linear.params
    return None


def _operands(
    linear: Linear | None, dtype: torch.dtype
) -> tuple[LinearKind, torch.Tensor, torch.Tensor] | None:
    """``projection_operands``, with placeholders where there is no projection."""
    return _UNUSED_OPERANDS if linear is None else projection_operands(linear, dtype)


def dense_kind(linear: DenseLinear) -> LinearKind:
    """The kernel a dense projection takes: its few-row kernel where it is row-wise."""
    if not linear.rowwise:
        return LinearKind.DENSE
    return LinearKind.DENSE_F32 if linear.weight.dtype == torch.float32 else LinearKind.DENSE_BF16


@functools.cache
def _decode_layers_op() -> Callable[..., torch.Tensor]:
    """``decode_layers``'s C++ entry point, looked up once. The op takes a TorchBind object
    (MoELayers), and for such ops torch's Python wrapper first walks every argument looking
    for a fake one (``torch._ops._must_dispatch_in_python``, for tracing): ~0.13 ms a call
    over a model's 300 weight tensors, 2% of a single-stream int4 step. Only real objects
    reach this call."""
    return torch.ops.kvserve.decode_layers.default._op


@dataclass(frozen=True)
class PlainLayer:
    """One Llama-shaped layer as ``decode_layers`` runs it: RMSNorm (weight in the model
    dtype), attention (with a per-head QK RMSNorm where the model has one), residual add,
    RMSNorm, SwiGLU MLP or mixture of experts, residual add."""

    input_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    gate_up: Linear | None  # None where the feed-forward is ``experts``
    down: Linear | None
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None  # per head: (q_norm, k_norm)
    # A mixture of experts as moe_forward takes it (runtime/cpu_moe.py's NativeMoE.weights).
    experts: torch.ScriptObject | None = None


@dataclass(frozen=True)
class DecodeLayers:
    """The decoder's weights as ``decode_layers`` takes them."""

    weights: tuple[torch.Tensor, ...]  # per layer: 2 norms, then (a, b) x 4 projections
    kinds: tuple[int, ...]  # per layer: the 4 projections' LinearKind (UNUSED: experts)
    qk_norms: tuple[torch.Tensor, ...]  # per layer (q_norm, k_norm), or none at all
    moe: torch.ScriptObject  # csrc/moe.h's MoELayers: the layers whose feed-forward is experts
    window: int | None = None  # the smallest sliding window of any layer
    residual_multiplier: float = 1.0  # Granite: each sublayer's output scaled by it

    @classmethod
    def build(
        cls,
        layers: Sequence[PlainLayer],
        window: int | None = None,
        residual_multiplier: float = 1.0,
    ) -> DecodeLayers | None:
        """The path for these layers (whose smallest sliding window is ``window``, and whose
        sublayer outputs join the residual stream times ``residual_multiplier``), or
        None where a projection has no few-row kernel (or a bias), the weights are not on
        the CPU, or some layers have a QK-norm and others not."""
        if not layers or layers[0].input_norm.device.type != "cpu":
            return None
        if len({layer.qk_norms is None for layer in layers}) != 1:
            return None
        dtype = layers[0].input_norm.dtype
        tensors: list[torch.Tensor] = []
        kinds: list[int] = []
        moe = torch.classes.kvserve.MoELayers(len(layers))
        for index, layer in enumerate(layers):
            tensors += [layer.input_norm, layer.mlp_norm]
            for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
                operands = _operands(linear, dtype)
                if operands is None:
                    return None
                kinds.append(int(operands[0]))
                tensors += operands[1:]
            if layer.experts is not None:
                moe.set(index, layer.experts)
        qk_norms = [norm for layer in layers for norm in layer.qk_norms or ()]
        return cls(tuple(tensors), tuple(kinds), tuple(qk_norms), moe, window, residual_multiplier)

    def serves(self, meta: AttentionMetadata, cache: PagedKVCache) -> bool:
        """Whether a step can take the path: a few decodes, no prefill, a plain cache, and
        no context long enough for a sliding window to hide a key (the native attention
        takes no window; the padded table's width bounds every context)."""
        return (
            0 < meta.num_decodes <= MAX_ROWS
            and not meta.prefills
            and meta.varlen is None
            and meta.group_metas is None
            and not cache.is_quantized
            and cache.pool.key.dtype in _CACHE_DTYPES
            and (self.window is None or self._longest_context(meta, cache) <= self.window)
        )

    @staticmethod
    def _longest_context(meta: AttentionMetadata, cache: PagedKVCache) -> int:
        assert meta.decode_block_table is not None
        return meta.decode_block_table.shape[1] * cache.block_size

    def run(
        self,
        residual: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        spec: ModelSpec,
        rope: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """``DecoderModel.forward``'s result for the embedded tokens ``residual``."""
        assert meta.decode_block_table is not None and meta.decode_context_lens is not None
        return _decode_layers_op()(
            residual,
            self.weights,
            self.kinds,
            self.qk_norms,
            self.moe,
            cache.pool.key,
            cache.pool.value,
            meta.positions,
            *rope,
            meta.slots,
            meta.decode_block_table,
            meta.decode_context_lens,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.rms_norm_eps,
            scale,
            self.residual_multiplier,
        )
