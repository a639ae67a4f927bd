"""``--quantization``: a model's weights with their projections in int8 or int4.

Every linear layer of the decoder's layers is converted wherever the family put it
(``map_linears`` walks the weights), so a new family needs nothing here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

from engine.model.layers.decoder import ModelWeights
from engine.model.layers.linear import (
    F32_CHUNKED_MAX_ROWS,
    DenseLinear,
    Int4Linear,
    Int8Linear,
    Linear,
    bf16_amx_supported,
    bf16_rowwise_supported,
    check_quantization,
    f32_rowwise_supported,
    map_linears,
    rowwise_supported,
)
from engine.model.layers.moe import MoEMLP


def quantize_weights(
    weights: ModelWeights,
    method: str,
    rowwise: bool = False,
    kernels: str = "native",
    batch_invariant: bool = False,
) -> ModelWeights:
    """The same model with its projections and LM head in ``method`` (``none``: unchanged).

    The LM head gets its own int8 copy (int8 and int4) even when tied to the embedding: the
    lookup table stays in the serving dtype and both count toward the weight bytes. With
    int4 the decoder's projections are 4-bit. ``rowwise`` adds the int8 row-major copy for
    few-row calls (unquantized, it sends a bf16 model's few-row calls to the native bf16
    kernel where the CPU has AVX512_BF16, and a float32 model's MoE experts to the native
    float32 kernel where it has AVX2 and FMA); it and int4 need the native kernels
    (``kernels`` names the backend).

    ``batch_invariant`` (``--batch-invariant``) puts every projection and the LM head on
    its row-wise kernel at every row count (``check_batch_invariant`` says where it can).
    """
    check_quantization(method, weights.embed.device, kernels)
    if batch_invariant:
        check_batch_invariant(weights, method, kernels)
        return _invariant(weights, method)
    if method == "none":
        if not rowwise:
            return weights
        if f32_rowwise_supported(weights.embed):
            return _with_f32_rowwise(weights)
        return _with_bf16_rowwise(weights)

    def convert(linear: Linear) -> Linear:
        return _to_int4(linear) if method == "int4" else _to_int8(linear, rowwise)

    layers = map_linears(weights.layers, convert)
    lm_head = _to_int8(weights.lm_head, rowwise)
    return dataclasses.replace(weights, layers=layers, lm_head=lm_head)


def check_batch_invariant(weights: ModelWeights, method: str, kernels: str) -> None:
    """Raise ValueError, naming the reason, where ``--batch-invariant`` cannot hold: it
    needs the native row-wise kernels (float32 weights on AVX2 + FMA, bf16 on
    AVX512_BF16, int8, int4) and a model without mixture-of-experts layers (whose native
    op picks kernels by row count)."""
    if kernels != "native" or weights.embed.device.type != "cpu":
        raise ValueError("--batch-invariant needs the native CPU kernels (--kernels native)")
    if method == "none" and not rowwise_supported(weights.embed):
        raise ValueError(
            f"--batch-invariant has no row-wise kernel for {weights.embed.dtype} weights on "
            "this CPU (float32 needs AVX2 and FMA, bfloat16 AVX512_BF16); use --dtype float32 "
            "or --quantization int8|int4"
        )
    if _has_moe(weights.layers):
        raise ValueError("--batch-invariant does not cover mixture-of-experts layers yet")


def _invariant(weights: ModelWeights, method: str) -> ModelWeights:
    """Every projection and the LM head on its row-wise kernel at every row count."""
    convert: Callable[[Linear], Linear]
    if method == "none":
        convert = _invariant_dense
    elif method == "int4":
        convert = partial(_to_int4, invariant=True)
    else:
        convert = partial(_to_int8, rowwise=True, invariant=True)
    if method == "none":
        lm_head = _invariant_dense(weights.lm_head)
    else:
        lm_head = _to_int8(weights.lm_head, rowwise=True, invariant=True)
    layers = map_linears(weights.layers, convert)
    return dataclasses.replace(weights, layers=layers, lm_head=lm_head)


def _invariant_dense(linear: Linear) -> Linear:
    dense = _dense(linear)
    return DenseLinear(dense.weight.contiguous(), dense.bias, rowwise=True, invariant=True)


def _has_moe(weights: Any) -> bool:
    if isinstance(weights, MoEMLP):
        return True
    if dataclasses.is_dataclass(weights) and not isinstance(weights, type):
        return any(_has_moe(getattr(weights, f.name)) for f in dataclasses.fields(weights))
    if isinstance(weights, (list, tuple)):
        return any(_has_moe(item) for item in weights)
    return False


def _with_bf16_rowwise(weights: ModelWeights) -> ModelWeights:
    """The dense projections and LM head with the few-row bf16 kernel turned on, where the
    weights are bf16 and the CPU has AVX512_BF16; otherwise ``weights`` unchanged."""
    if not bf16_rowwise_supported(weights.embed):
        return weights
    layers = map_linears(weights.layers, _rowwise)
    return dataclasses.replace(weights, layers=layers, lm_head=_rowwise(weights.lm_head))


def _rowwise(linear: Linear) -> Linear:
    if isinstance(linear, DenseLinear) and linear.weight.is_contiguous():
        amx = bf16_amx_supported(linear.weight)
        return DenseLinear(linear.weight, linear.bias, rowwise=True, amx=amx)
    return linear


def _with_f32_rowwise(weights: ModelWeights) -> ModelWeights:
    """A float32 model on the few-row float32 kernel: its dense projections and LM head up
    to ``F32_CHUNKED_MAX_ROWS`` rows (decode steps; prefill chunks keep ATen's GEMM), its
    MoE experts up to the kernel's own limit, as the native MoE op runs them. (The router
    takes the kernel in layers/moe.py.)"""
    layers = _map_moe_experts(map_linears(weights.layers, _chunked_f32))
    return dataclasses.replace(weights, layers=layers, lm_head=_chunked_f32(weights.lm_head))


def _chunked_f32(linear: Linear) -> Linear:
    if isinstance(linear, DenseLinear) and linear.weight.is_contiguous():
        return DenseLinear(linear.weight, linear.bias, True, chunked_rows=F32_CHUNKED_MAX_ROWS)
    return linear


def _map_moe_experts(weights: Any) -> Any:
    """``weights`` with every ``MoEMLP``'s experts made row-wise (walked as ``map_linears``)."""
    if isinstance(weights, MoEMLP):
        return dataclasses.replace(weights, experts=map_linears(weights.experts, _rowwise))
    if dataclasses.is_dataclass(weights) and not isinstance(weights, type):
        changes = {
            f.name: _map_moe_experts(getattr(weights, f.name))
            for f in dataclasses.fields(weights)
            if f.init
        }
        return dataclasses.replace(weights, **changes)
    if isinstance(weights, (list, tuple)):
        return type(weights)(_map_moe_experts(item) for item in weights)
    return weights


def _dense(linear: Linear) -> DenseLinear:
    if not isinstance(linear, DenseLinear):
        raise TypeError(f"cannot quantize a {type(linear).__name__}")
    return linear


def _to_int8(linear: Linear, rowwise: bool, invariant: bool = False) -> Int8Linear:
    if isinstance(linear, Int8Linear):
        if not invariant or linear.rowwise is None:
            return linear
        return Int8Linear(
            linear.packed, linear.out_features, linear.in_features, linear.bias,
            linear.rowwise, invariant,
        )  # fmt: skip
    dense = _dense(linear)
    return Int8Linear.from_dense(dense.weight, dense.bias, rowwise=rowwise, invariant=invariant)


def _to_int4(linear: Linear, invariant: bool = False) -> Int4Linear:
    if isinstance(linear, Int4Linear):
        return Int4Linear(linear.packed, linear.params, linear.out_features, linear.bias, invariant)
    dense = _dense(linear)
    return Int4Linear.from_dense(dense.weight, dense.bias, invariant=invariant)
