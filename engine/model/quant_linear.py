"""Linear layers behind one small interface: dense (F.linear) or int8 weights (fbgemm).

The decoder calls every projection as ``linear(x)`` and counts weight memory through
``linear.nbytes``; it never looks inside. ``--quantization int8`` swaps the dense layers
for ``Int8Linear`` after loading:

- weights: symmetric per-output-channel qint8 (scale = max|row| / 127, zero point 0),
  prepacked once into fbgemm's blocked layout;
- activations: quantized per call, per tensor (dynamic quantization), with the 7-bit
  ``reduce_range`` that x86's u8 x s8 multiply-add needs to avoid int16 saturation.

CPU only: fbgemm has no CUDA kernels, so int8 on CUDA is refused with a message naming
the flag. The quantization cost is paid once; each call then reads a quarter of the
float32 weight bytes, which is what a memory-bound decode step is limited by.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.model.llama import LayerWeights, LlamaWeights

QUANTIZATION_METHODS: tuple[str, ...] = ("none", "int8")
# Calls with at most this many rows take the row-major int8 kernel when it is loaded: up to
# here it is about as fast as fbgemm or faster, and exact in the activations; at 8 rows
# it is half fbgemm's speed.
ROWWISE_MAX_ROWS = 4
# The row-major copy keeps one float32 scale per output channel beside its int8 weights.
ROWWISE_CHANNEL_BYTES = 4
INT8_MAX = 127
# fbgemm keeps one float32 scale and one int32 zero point per output channel.
INT8_CHANNEL_OVERHEAD_BYTES = 4 + 4


class Linear(Protocol):
    """``y = x @ W.T (+ b)`` for x of shape ``[rows, in_features]``."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int:
        """Bytes of the stored parameters (weights, bias, scales)."""
        ...


class DenseLinear:
    """A weight tensor (and optional bias) in the serving dtype, applied with F.linear."""

    __slots__ = ("bias", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.weight) + _tensor_bytes(self.bias)


class Int8Linear:
    """Per-channel int8 weights prepacked for fbgemm; float activations in and out.

    With ``rowwise`` (the native kernels are loaded) a second, row-major copy of the same
    int8 weights and their float32 scales serves calls of at most ``ROWWISE_MAX_ROWS``
    rows (decode steps of one to four sequences) through ``torch.ops.kvserve.int8_linear``:
    activations stay float32 (no per-call activation quantization, so these rows are
    exact up to float rounding) and the weights stream from memory at 1.0-1.4x fbgemm's
    rate at one or two rows, about even at four (bench/bench_kernels.py). Larger batches
    use fbgemm's integer GEMM, which is faster once the step is compute-bound.
    """

    __slots__ = ("bias", "in_features", "out_features", "packed", "rowwise")

    def __init__(
        self,
        packed: object,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
        rowwise: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        self.packed = packed
        self.out_features = out_features
        self.in_features = in_features
        # Kept outside fbgemm, in the serving dtype: the bias stays exact and is counted
        # at the same width as in the dense model.
        self.bias = bias
        self.rowwise = rowwise  # (int8 [out, in], float32 scales [out])

    @classmethod
    def from_dense(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, rowwise: bool = False
    ) -> Int8Linear:
        """Quantize a ``[out, in]`` weight symmetrically per output channel and prepack it."""
        check_quantization("int8", weight.device)
        out_features, in_features = weight.shape
        quantized = quantize_per_channel(weight)
        packed = torch.ops.quantized.linear_prepack(quantized, None)
        copy = None
        if rowwise:
            scales = quantized.q_per_channel_scales().to(torch.float32)
            copy = (quantized.int_repr().contiguous(), scales)
        return cls(packed, out_features, in_features, bias, copy)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # fbgemm takes float32 activations; a bf16/fp16 model converts at the boundary.
        # (Checked first: even a no-op .to() costs microseconds, 240 times a step.)
        if x.dtype == torch.float32:
            if self.rowwise is not None and x.shape[0] <= ROWWISE_MAX_ROWS:
                y = x.new_empty(x.shape[0], self.out_features)
                torch.ops.kvserve.int8_linear(y, x.contiguous(), *self.rowwise)
            else:
                y = torch.ops.quantized.linear_dynamic(x, self.packed, True)
        else:
            y = torch.ops.quantized.linear_dynamic(x.float(), self.packed, True).to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)

    @property
    def nbytes(self) -> int:
        weights = self.out_features * self.in_features  # one byte each
        scales = self.out_features * INT8_CHANNEL_OVERHEAD_BYTES
        copy = 0 if self.rowwise is None else sum(map(_tensor_bytes, self.rowwise))
        return weights + scales + copy + _tensor_bytes(self.bias)

    def unpack(self) -> torch.Tensor:
        """The quantized weight as fbgemm holds it (a per-channel qint8 tensor)."""
        weight, _ = torch.ops.quantized.linear_unpack(self.packed)
        return weight


def quantize_per_channel(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric qint8 per output row: scale = max|row| / 127, zero point 0."""
    weight = weight.detach().to(device="cpu", dtype=torch.float32)
    scales = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX
    zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
    with warnings.catch_warnings():
        # torch marks quantized tensor creation deprecated; fbgemm's prepack still needs it.
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_channel(
            weight, scales.to(torch.float64), zero_points, 0, torch.qint8
        )


def check_quantization(method: str, device: torch.device) -> None:
    """Reject an unknown method, and int8 off the CPU, with messages naming the flag."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"--quantization must be one of {list(QUANTIZATION_METHODS)}, not {method!r}"
        )
    if method == "int8" and device.type != "cpu":
        raise ValueError(
            f"--quantization int8 runs on the CPU only (fbgemm kernels), not on {device.type}; "
            "use --quantization none (or --device cpu)"
        )


def quantize_weights(weights: LlamaWeights, method: str, rowwise: bool = False) -> LlamaWeights:
    """The same model with its projections and LM head in ``method`` (``none``: unchanged).

    With int8 the LM head gets its own quantized copy even when tied to the embedding: the
    lookup table stays in the serving dtype and both count toward the weight bytes.
    ``rowwise`` adds the row-major copy for few-row calls (needs the native kernels).
    """
    check_quantization(method, weights.embed.device)
    if method == "none":
        return weights
    layers = [_quantize_layer(layer, rowwise) for layer in weights.layers]
    lm_head = _to_int8(weights.lm_head, rowwise)
    return dataclasses.replace(weights, layers=layers, lm_head=lm_head)


def _quantize_layer(layer: LayerWeights, rowwise: bool) -> LayerWeights:
    return dataclasses.replace(
        layer,
        qkv=_to_int8(layer.qkv, rowwise),
        o_proj=_to_int8(layer.o_proj, rowwise),
        gate_up=_to_int8(layer.gate_up, rowwise),
        down=_to_int8(layer.down, rowwise),
    )


def _to_int8(linear: Linear, rowwise: bool) -> Int8Linear:
    if isinstance(linear, Int8Linear):
        return linear
    if not isinstance(linear, DenseLinear):
        raise TypeError(f"cannot quantize a {type(linear).__name__}")
    return Int8Linear.from_dense(linear.weight, linear.bias, rowwise=rowwise)


def _tensor_bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()
