"""Linear layers behind one small interface: dense (F.linear), int8 (fbgemm) or int4.

The decoder calls every projection as ``linear(x)`` and counts weight memory through
``linear.nbytes``; it never looks inside. ``--quantization int8`` swaps the dense layers
for ``Int8Linear`` after loading:

- weights: symmetric per-output-channel qint8 (scale = max|row| / 127, zero point 0),
  prepacked once into fbgemm's blocked layout;
- activations: quantized per call, per tensor (dynamic quantization), with the 7-bit
  ``reduce_range`` that x86's u8 x s8 multiply-add needs to avoid int16 saturation;
- decode steps of a few rows take a native kernel instead (``Int8Linear``'s docstring):
  integer dot products (VNNI, or the same math on AVX2) where the CPU has either, float
  ones elsewhere.

CPU only: fbgemm has no CUDA kernels, so int8 on CUDA is refused with a message naming
the flag. The quantization cost is paid once; each call then reads a quarter of the
float32 weight bytes, which is what a memory-bound decode step is limited by.

``--quantization int4`` puts the decoder's projections in ``Int4Linear`` (llama.cpp's Q4_1
format: groups of 32 input channels, a float16 scale and minimum each, 5 bits per weight)
and the LM head in ``Int8Linear``, as the Q4_1 GGUF keeps its embedding at 8 bits. It
halves the bytes a batch-1 decode step streams again; it needs the native CPU kernels.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from engine.model import weight_format
from engine.model.kernels.native import load_native_ops
from engine.model.weight_format import (
    INT4_GROUP,
    INT4_GROUP_OVERHEAD_BYTES,
    INT4_LEVELS,
    INT8_CHANNEL_OVERHEAD_BYTES,
    INT8_MAX,
    QUANTIZATION_METHODS,
    ROWWISE_CHANNEL_BYTES,
)

__all__ = [
    "INT4_GROUP",
    "INT4_GROUP_OVERHEAD_BYTES",
    "INT4_LEVELS",
    "INT8_CHANNEL_OVERHEAD_BYTES",
    "INT8_MAX",
    "QUANTIZATION_METHODS",
    "ROWWISE_CHANNEL_BYTES",
]
# Calls with at most this many rows take the row-major int8 kernel when it is loaded: up to
# here it is about as fast as fbgemm or faster, and exact in the activations; at 8 rows
# it is half fbgemm's speed.
ROWWISE_MAX_ROWS = 4
# Calls with at most this many rows take the native bf16 kernel on CPUs with AVX512_BF16
# (where AMX does not take them first): each weight line fetched 32 KiB ahead, it streams a
# decode step's projections at 1-8 rows in about the time of one, and beats torch's bf16
# GEMM (oneDNN) up to ~48 rows: 1.8x at 8, 1.24x at 32, 1.16x at 48, even at 64 (EPYC Zen 4,
# cold weights; bench/bench_kernels.py --only bf16).
BF16_ROWWISE_MAX_ROWS = 48
# Calls of this many rows take the AMX kernel (csrc/bf16_linear_amx.cpp) where the CPU has
# AMX-BF16 and the shape fits: 1.6x the few-row kernel at 8 rows, 1.5x torch's GEMM at 32,
# 1.3x at 64, slower than torch by 512 (Xeon-AMX, a decode step's projections, cold); at
# one row the few-row kernel is ~5% faster.
BF16_AMX_MIN_ROWS = 5
BF16_AMX_MAX_ROWS = 64
# Calls with at most this many float32 rows take the native float32 kernel (AVX2 + FMA)
# where a layer asks for it (an MoE's experts and router, quantize.py): an expert of a
# 32-sequence decode step gets ~4 rows, where ATen's GEMM is ~3x slower than streaming the
# weights once (csrc/f32_linear.cpp; kF32FewRows in csrc/projection.h).
F32_ROWWISE_MAX_ROWS = 16
# Calls with at most this many float32 rows take that kernel in chunks of
# F32_ROWWISE_MAX_ROWS for a float32 model's dense projections and LM head: one to 64 rows
# ran 0.3-0.97x ATen's GEMM time on SmolLM2's shapes (EPYC-AVX2), 256 rows 1.14-1.24x.
F32_CHUNKED_MAX_ROWS = 64
# Activation dtypes the integer int8 kernel and the int4 kernel read and write as they are.
NATIVE_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)
# Output rows interleaved together in the int4 layout (kBlockRows in csrc/int4_linear.cpp).
INT4_BLOCK_ROWS = 16
# Calls with at most this many rows quantize activations for integer dot products
# (kIntegerMaxRows in csrc/int4_linear.cpp).
INT4_INTEGER_MAX_ROWS = 8


class Linear(Protocol):
    """``y = x @ W.T (+ b)`` for x of shape ``[rows, in_features]``."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int:
        """Bytes of the stored parameters (weights, bias, scales)."""
        ...

    @property
    def decode_nbytes(self) -> int:
        """Bytes a one-row call reads: the copy its few-row kernel streams, where it has one."""
        ...


class DenseLinear:
    """A weight tensor (and optional bias) in the serving dtype, applied with F.linear.

    With ``rowwise`` (bf16 weights, the native kernels loaded, a CPU with AVX512_BF16)
    calls of at most ``BF16_ROWWISE_MAX_ROWS`` rows go through ``torch.ops.kvserve.bf16_linear``
    instead: the CPU's bf16 dot-product instruction over the weights as stored, each
    weight row read once for every activation row (docs/archive/benchmarks-log.md, "bf16 decode").
    With ``rowwise`` and float32 weights (a CPU with AVX2 and FMA) calls of at most
    ``F32_ROWWISE_MAX_ROWS`` rows go through ``torch.ops.kvserve.f32_linear`` the same way,
    each row's outputs the same sums whatever the batch. ``chunked_rows`` extends that to
    calls of up to so many rows, in chunks of the limit: a float32 model's dense
    projections and LM head take the kernel up to ``F32_CHUNKED_MAX_ROWS`` rows, where it
    beats ATen's GEMM (which streams a decode step's weights at half its rate).

    With ``amx`` as well (``bf16_amx_supported``: AMX-BF16 and a shape its tiles fit) calls
    of ``BF16_AMX_MIN_ROWS`` to ``BF16_AMX_MAX_ROWS`` rows go through
    ``torch.ops.kvserve.bf16_linear_amx`` instead: tile products over the same stored
    weights, for the decode steps of many sequences that are compute-bound on vdpbf16ps.

    With ``invariant`` (``--batch-invariant``; needs ``rowwise``) every call takes the
    few-row kernel, in chunks of its row limit: a row's numbers then never depend on the
    other rows of the step.
    """

    __slots__ = ("amx", "bias", "chunked_rows", "invariant", "rowwise", "weight")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        rowwise: bool = False,
        invariant: bool = False,
        chunked_rows: int = 0,
        amx: bool = False,
    ):
        self.weight = weight
        self.bias = bias
        self.rowwise = rowwise
        self.invariant = invariant and rowwise
        self.chunked_rows = chunked_rows
        self.amx = amx and rowwise and not self.invariant

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rowwise:
            rows = x.shape[0]
            amx_rows = BF16_AMX_MIN_ROWS <= rows <= BF16_AMX_MAX_ROWS
            if self.amx and amx_rows and x.dtype == torch.bfloat16:
                y = x.new_empty(rows, self.weight.shape[0])
                torch.ops.kvserve.bf16_linear_amx(y, x.contiguous(), self.weight)
                return y if self.bias is None else y.add_(self.bias)
            if x.dtype == torch.bfloat16 and (self.invariant or rows <= BF16_ROWWISE_MAX_ROWS):
                y = by_row_chunks(
                    torch.ops.kvserve.bf16_linear, x, self.weight.shape[0], BF16_ROWWISE_MAX_ROWS,
                    self.weight,
                )  # fmt: skip
                return y if self.bias is None else y.add_(self.bias)
            limit = max(F32_ROWWISE_MAX_ROWS, self.chunked_rows)
            if x.dtype == torch.float32 and (self.invariant or rows <= limit):
                y = by_row_chunks(
                    torch.ops.kvserve.f32_linear, x, self.weight.shape[0], F32_ROWWISE_MAX_ROWS,
                    self.weight,
                )  # fmt: skip
                return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.weight) + _tensor_bytes(self.bias)

    @property
    def decode_nbytes(self) -> int:
        return self.nbytes


class Int8Linear:
    """Per-channel int8 weights prepacked for fbgemm; float activations in and out.

    With ``rowwise`` (the native kernels are loaded) a second, row-major copy of the same
    int8 weights and their float32 scales serves calls of at most ``ROWWISE_MAX_ROWS``
    rows (decode steps of one to four sequences), in float32 or bfloat16, through one of
    two kernels chosen once from the CPU's features:

    - ``torch.ops.kvserve.int8_linear_vnni`` on CPUs with AVX512_VNNI or AVX2
      (``in_features`` a multiple of 64): activations quantized per group of 64
      (llama.cpp's Q8_0 grid), exact integer dot products (vpdpbusd, or vpmaddubsw on the
      activations' magnitudes), the same numbers on either class;
    - ``torch.ops.kvserve.int8_linear`` elsewhere: float32 activations (exact up to float
      rounding), each weight widened to float.

    Larger batches use fbgemm's integer GEMM (per-tensor 7-bit activations), which is
    faster once the step is compute-bound (bench/bench_kernels.py), but whose activation
    scale is shared by every row of the call: a row's numbers depend on its batch. With
    ``invariant`` (``--batch-invariant``; needs ``rowwise``) every call takes the row-wise
    kernel, whose rows are each quantized and summed on their own.
    """

    __slots__ = (
        "bias",
        "in_features",
        "integer",
        "invariant",
        "out_features",
        "packed",
        "rowwise",
    )

    def __init__(
        self,
        packed: object,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
        rowwise: tuple[torch.Tensor, torch.Tensor] | None = None,
        invariant: bool = False,
    ):
        self.packed = packed
        self.out_features = out_features
        self.in_features = in_features
        self.invariant = invariant and rowwise is not None
        # Kept outside fbgemm, in the serving dtype: the bias stays exact and is counted
        # at the same width as in the dense model.
        self.bias = bias
        self.rowwise = rowwise  # (int8 [out, in], float32 scales [out])
        # The integer kernel (VNNI, or its AVX2 form) where it runs; else the float one.
        self.integer = rowwise is not None and in_features % 64 == 0 and int8_integer_supported()

    @classmethod
    def from_dense(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        rowwise: bool = False,
        invariant: bool = False,
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
        return cls(packed, out_features, in_features, bias, copy, invariant)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # (The row-wise kernels take any number of rows; past ROWWISE_MAX_ROWS fbgemm is
        # faster, and only batch invariance is worth its cost.)
        if self.rowwise is not None and (self.invariant or x.shape[0] <= ROWWISE_MAX_ROWS):
            y = self._few_rows(x.contiguous())
        elif x.dtype == torch.float32:
            y = torch.ops.quantized.linear_dynamic(x, self.packed, True)
        else:  # fbgemm takes float32 activations: a bf16/fp16 model converts at the boundary
            y = torch.ops.quantized.linear_dynamic(x.float(), self.packed, True).to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)

    def _few_rows(self, x: torch.Tensor) -> torch.Tensor:
        assert self.rowwise is not None
        if self.integer and x.dtype in NATIVE_ACTIVATION_DTYPES:
            y = x.new_empty(x.shape[0], self.out_features)
            torch.ops.kvserve.int8_linear_vnni(y, x, *self.rowwise)
            return y
        # (Checked first: even a no-op .to() costs microseconds, 240 times a step.)
        x32 = x if x.dtype == torch.float32 else x.float()
        y = x32.new_empty(x.shape[0], self.out_features)
        torch.ops.kvserve.int8_linear(y, x32, *self.rowwise)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    @property
    def nbytes(self) -> int:
        weights = self.out_features * self.in_features  # one byte each
        scales = self.out_features * INT8_CHANNEL_OVERHEAD_BYTES
        copy = 0 if self.rowwise is None else sum(map(_tensor_bytes, self.rowwise))
        return weights + scales + copy + _tensor_bytes(self.bias)

    @property
    def decode_nbytes(self) -> int:
        if self.rowwise is None:  # fbgemm's packed weights and per-channel parameters
            return self.nbytes
        return sum(map(_tensor_bytes, (*self.rowwise, self.bias)))

    def unpack(self) -> torch.Tensor:
        """The quantized weight as fbgemm holds it (a per-channel qint8 tensor)."""
        weight, _ = torch.ops.quantized.linear_unpack(self.packed)
        return weight


class Int4Linear:
    """Group-wise asymmetric 4-bit weights (Q4_1): ``w = d * q + m``, q in 0..15.

    Each output row's input channels form groups of 32 with their own float16 scale ``d``
    and minimum ``m``; the 4-bit codes are packed two per byte, and both are stored
    row-interleaved for the kernels (``quantize_int4``'s layout): exactly Q4_1's bytes, in
    an order where one 64-byte load holds four codes of each of sixteen output rows.
    ``torch.ops.kvserve.int4_linear`` computes ``sum_g d * (x . q) + m * sum(x)``. Up to
    ``INT4_INTEGER_MAX_ROWS`` rows (decode) the dot products are integer, as llama.cpp's
    Q4_1 x Q8_1: each group of 32 activations is quantized to int8 with its own scale
    (max|x| / 127), the group sums stay exact; more rows (prefill, large batches)
    dequantize blocks of weight rows and keep float32 activations. At batch 1 this streams
    0.6x int8's bytes and is faster; from a few rows on fbgemm's int8 GEMM is faster
    (docs/archive/benchmarks-log.md).

    A weight already on a Q4_1 grid (the embedded GGUF's projections) round-trips exactly:
    its group minimum and maximum are codes 0 and 15.

    With ``invariant`` (``--batch-invariant``) every call takes the integer path, in chunks
    of ``INT4_INTEGER_MAX_ROWS`` rows, so a row's numbers never depend on its batch.
    """

    __slots__ = ("bias", "in_features", "invariant", "out_features", "packed", "params")

    def __init__(
        self,
        packed: torch.Tensor,
        params: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
        invariant: bool = False,
    ):
        self.invariant = invariant
        self.packed = packed
        self.params = params
        self.out_features = out_features
        self.in_features = packed.numel() * 2 // out_features
        self.bias = bias  # in the serving dtype, as for Int8Linear

    @classmethod
    def from_dense(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, invariant: bool = False
    ) -> Int4Linear:
        """Quantize a ``[out, in]`` weight group-wise (``in`` a multiple of 32)."""
        check_quantization("int4", weight.device, "native" if load_native_ops() else "torch")
        packed, params = quantize_int4(weight)
        return cls(packed, params, weight.shape[0], bias, invariant)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in NATIVE_ACTIVATION_DTYPES:  # float32 and bf16 go in and come out as they are
            chunk = INT4_INTEGER_MAX_ROWS if self.invariant else x.shape[0]
            y = by_row_chunks(
                torch.ops.kvserve.int4_linear, x, self.out_features, chunk,
                self.packed, self.params,
            )  # fmt: skip
        else:
            y = x.new_empty(x.shape[0], self.out_features, dtype=torch.float32)
            torch.ops.kvserve.int4_linear(y, x.float().contiguous(), self.packed, self.params)
            y = y.to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)

    @property
    def nbytes(self) -> int:
        return sum(map(_tensor_bytes, (self.packed, self.params, self.bias)))

    @property
    def decode_nbytes(self) -> int:
        return self.nbytes

    def unpack(self) -> Int4Groups:
        """The codes, scales and minimums in row order."""
        return unpack_int4(self.packed, self.params, self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight the kernel multiplies by."""
        return self.unpack().dequantize()


@dataclasses.dataclass(frozen=True)
class Int4Groups:
    """Q4_1 weights in row order: ``codes [out, in / 32, 32]`` (uint8 0..15), and ``scales``
    and ``minimums [out, in / 32]`` (float16)."""

    codes: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        scales, minimums = self.scales[..., None].float(), self.minimums[..., None].float()
        weight = self.codes.float() * scales + minimums
        return weight.reshape(self.codes.shape[0], -1)


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 [out * in / 2], params float16 [out * in / 32 * 2])``, interleaved.

    Per group: ``m = min``, ``d = (max - min) / 15``, both rounded to float16 first so the
    codes are chosen against the scale the kernel will use. The layout is ``interleave_int4``'s.
    """
    out_features, in_features = weight.shape
    if in_features % INT4_GROUP:
        raise ValueError(
            f"--quantization int4 needs input widths that are multiples of {INT4_GROUP}; "
            f"this model has a {in_features}-wide projection (use --quantization int8)"
        )
    groups = (
        weight.detach().to(device="cpu", dtype=torch.float32).reshape(out_features, -1, INT4_GROUP)
    )
    low = groups.amin(dim=2).half()
    scale = ((groups.amax(dim=2) - low.float()) / INT4_LEVELS).half()
    inverse = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale.float()))
    codes = ((groups - low[..., None].float()) * inverse[..., None]).round_().clamp_(0, INT4_LEVELS)
    return interleave_int4(Int4Groups(codes.to(torch.uint8), scale, low))


def interleave_int4(weights: Int4Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' layout (csrc/int4_linear.cpp): output rows in blocks of
    ``INT4_BLOCK_ROWS`` (the last block holds the R < 16 left over; nothing is padded).
    In a block of R rows, group g is 16R bytes: four chunks of 4R, where chunk c holds,
    row after row, 4 bytes whose low nibbles are elements 4c..4c+3 of the group and high
    nibbles elements 16+4c..16+4c+3. Its params are R scales then R minimums."""
    out_features = weights.codes.shape[0]
    full = out_features - out_features % INT4_BLOCK_ROWS
    packed, params = [], []
    for start, end, rows in ((0, full, INT4_BLOCK_ROWS), (full, out_features, out_features - full)):
        if end == start:
            continue
        codes = weights.codes[start:end].reshape(-1, rows, *weights.codes.shape[1:])
        codes = codes.permute(0, 2, 1, 3)  # [blocks, groups, rows, 32]
        half = INT4_GROUP // 2
        nibbles = [
            part.reshape(*part.shape[:3], 4, 4).transpose(2, 3)  # [blocks, groups, 4, rows, 4]
            for part in (codes[..., :half], codes[..., half:])
        ]
        packed.append((nibbles[0] | (nibbles[1] << 4)).flatten())
        scales, minimums = (
            t[start:end].reshape(-1, rows, t.shape[1]).transpose(1, 2)  # [blocks, groups, rows]
            for t in (weights.scales, weights.minimums)
        )
        params.append(torch.stack([scales, minimums], dim=2).flatten())
    return torch.cat(packed).contiguous(), torch.cat(params).contiguous()


def unpack_int4(
    packed: torch.Tensor, params: torch.Tensor, out_features: int, in_features: int
) -> Int4Groups:
    """``interleave_int4`` undone: the row-order codes, scales and minimums."""
    groups = in_features // INT4_GROUP
    full = out_features - out_features % INT4_BLOCK_ROWS
    split = full * in_features // 2, full * groups * 2
    parts = []
    for rows, codes, pairs in (
        (INT4_BLOCK_ROWS, packed[: split[0]], params[: split[1]]),
        (out_features - full, packed[split[0] :], params[split[1] :]),
    ):
        if rows == 0 or codes.numel() == 0:
            continue
        chunks = codes.reshape(-1, groups, 4, rows, 4).transpose(2, 3)  # [b, g, rows, 4, 4]
        chunks = chunks.reshape(-1, groups, rows, INT4_GROUP // 2)
        row_codes = torch.cat([chunks & 0x0F, chunks >> 4], dim=3)  # [b, g, rows, 32]
        scale_min = pairs.reshape(-1, groups, 2, rows)
        parts.append(
            (
                row_codes.transpose(1, 2).reshape(-1, groups, INT4_GROUP),
                scale_min[:, :, 0].transpose(1, 2).reshape(-1, groups),
                scale_min[:, :, 1].transpose(1, 2).reshape(-1, groups),
            )
        )
    return Int4Groups(*(torch.cat(tensors) for tensors in zip(*parts, strict=True)))


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


def check_quantization(method: str, device: torch.device, kernels: str = "native") -> None:
    """``weight_format.check_quantization`` for a torch device."""
    weight_format.check_quantization(method, device.type, kernels)


def int8_integer_supported() -> bool:
    """Whether the few-row int8 layers take the integer kernel on this CPU (VNNI, or the
    same math on AVX2): activations rounded to int8 per group of 64."""
    return load_native_ops() and bool(torch.ops.kvserve.int8_integer_supported())


def bf16_rowwise_supported(weight: torch.Tensor) -> bool:
    """Whether the native few-row bf16 kernel can serve ``weight`` on this CPU."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and load_native_ops()
        and bool(torch.ops.kvserve.bf16_linear_supported())
    )


def bf16_amx_supported(weight: torch.Tensor) -> bool:
    """Whether the AMX bf16 kernel can serve ``weight`` on this CPU: bf16, contiguous, its
    input features a multiple of 32 and its outputs of 16 (whole tiles)."""
    return (
        bf16_rowwise_supported(weight)
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] % 32 == 0
        and weight.shape[0] % 16 == 0
        and bool(torch.ops.kvserve.amx_available())
    )


def f32_rowwise_supported(weight: torch.Tensor) -> bool:
    """Whether the native few-row float32 kernel can serve ``weight`` on this CPU."""
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and load_native_ops()
        and bool(torch.ops.kvserve.f32_linear_supported())
    )


def rowwise_supported(weight: torch.Tensor) -> bool:
    """Whether a native few-row kernel (bf16 or float32) can serve ``weight``."""
    return bf16_rowwise_supported(weight) or f32_rowwise_supported(weight)


def by_row_chunks(
    kernel: Callable[..., Any],
    x: torch.Tensor,
    out_features: int,
    chunk: int,
    *operands: torch.Tensor,
) -> torch.Tensor:
    """``kernel(out, x, *operands)`` over ``x``'s rows, at most ``chunk`` rows a call.

    The native kernels compute each row on its own, so a row's numbers are the same in
    any chunk; chunking keeps a kernel within its row limit (or on its integer path)."""
    x = x.contiguous()
    y = x.new_empty(x.shape[0], out_features)
    step = max(chunk, 1)
    for start in range(0, x.shape[0], step):
        kernel(y[start : start + step], x[start : start + step], *operands)
    return y


def _tensor_bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


LINEAR_TYPES = (DenseLinear, Int8Linear, Int4Linear)


def map_linears(weights: Any, convert: Callable[[Linear], Linear]) -> Any:
    """``weights`` with every linear layer it holds replaced by ``convert(linear)``.

    Walks dataclasses (rebuilt with ``dataclasses.replace``), lists and tuples; tensors and
    other values are kept as they are. This is how quantization reaches every family's
    projections (and an MoE's experts) without knowing their layout."""
    if isinstance(weights, LINEAR_TYPES):
        return convert(weights)
    if dataclasses.is_dataclass(weights) and not isinstance(weights, type):
        changes = {
            f.name: map_linears(getattr(weights, f.name), convert)
            for f in dataclasses.fields(weights)
            if f.init
        }
        return dataclasses.replace(weights, **changes)
    if isinstance(weights, (list, tuple)):
        return type(weights)(map_linears(item, convert) for item in weights)
    return weights


def linear_layers(weights: Any) -> list[Linear]:
    """Every linear layer ``weights`` holds, in field order (walked as ``map_linears``)."""
    found: list[Linear] = []

    def collect(linear: Linear) -> Linear:
        found.append(linear)
        return linear

    map_linears(weights, collect)
    return found


def parameter_bytes(weights: Any, decode: bool = False) -> int:
    """Bytes of every tensor and linear layer ``weights`` holds (walked as ``map_linears``
    walks), or with ``decode`` the bytes a one-row call reads (``Linear.decode_nbytes``).
    With ``decode``, an object with ``active_decode_bytes()`` (an MoE block, whose
    one-token step reads only its chosen experts) is asked rather than walked; so is, in
    either case, any other object with ``nbytes`` and ``decode_nbytes``. A dataclass's
    fields outside its ``__init__`` are caches built from the others (an MoE block's
    router and native view) and are not counted again."""
    if isinstance(weights, torch.Tensor):
        return _tensor_bytes(weights)
    active = getattr(weights, "active_decode_bytes", None) if decode else None
    if active is not None:
        return int(active())
    if dataclasses.is_dataclass(weights) and not isinstance(weights, type):
        fields = [f for f in dataclasses.fields(weights) if f.init]
        return sum(parameter_bytes(getattr(weights, f.name), decode) for f in fields)
    if isinstance(weights, (list, tuple)):
        return sum(parameter_bytes(item, decode) for item in weights)
    if hasattr(weights, "decode_nbytes"):
        return int(weights.decode_nbytes if decode else weights.nbytes)
    return 0
