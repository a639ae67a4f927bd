"""The few-row linear kernels (engine/model/kernels/csrc/: int8 float and integer, bf16,
float32) against float math and torch's GEMM, one by one, and the layers that take them.

The other fused kernels are pinned down in test_native_kernels.py; test_cpu_isa.py reruns
both files with the AVX-512 paths off.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.kernels.native import NativeKernels
from engine.model.layers.linear import (
    BF16_AMX_MAX_ROWS,
    BF16_AMX_MIN_ROWS,
    BF16_ROWWISE_MAX_ROWS,
    F32_CHUNKED_MAX_ROWS,
    F32_ROWWISE_MAX_ROWS,
    ROWWISE_CHANNEL_BYTES,
    ROWWISE_MAX_ROWS,
    DenseLinear,
    Int8Linear,
    bf16_amx_supported,
    bf16_rowwise_supported,
    linear_layers,
)
from engine.model.layers.quantize import quantize_weights


@pytest.fixture(scope="module")
def native() -> NativeKernels:
    return NativeKernels()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("in_features", [64, 100])  # 100: not a multiple of the 32-wide loop
def test_int8_linear_matches_dequantized_weights(native, rows, in_features):
    """The few-row int8 kernel computes x @ (int8 * scale).T exactly up to float rounding:
    no activation quantization, unlike fbgemm's dynamic path."""
    torch.manual_seed(rows)
    weight = torch.randn(37, in_features)
    linear = Int8Linear.from_dense(weight, rowwise=True)
    assert linear.rowwise is not None
    int8, scales = linear.rowwise
    x = torch.randn(rows, in_features)
    expected = x @ (int8.float() * scales[:, None]).T
    out = torch.empty(rows, 37)
    torch.ops.kvserve.int8_linear(out, x, int8, scales)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
    # Through the layer: few rows take this kernel, more rows fbgemm; both near the dense op.
    dense = x @ weight.T
    assert (linear(x) - dense).abs().max() < 0.05 * dense.abs().max()
    if rows <= ROWWISE_MAX_ROWS:  # the layer's few-row kernel: VNNI where the CPU has it
        few_rows = vnni_reference(x, int8, scales) if linear.integer else expected
        torch.testing.assert_close(linear(x), few_rows, atol=1e-4, rtol=1e-5)
    rowwise_bytes = int8.numel() + ROWWISE_CHANNEL_BYTES * 37
    assert linear.nbytes == Int8Linear.from_dense(weight).nbytes + rowwise_bytes


def vnni_reference(x: torch.Tensor, int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What the VNNI kernel computes, in float64: activations rounded (half to even) to
    int8 per group of 64 at max|x| / 127, exact integer dot products, then the scales."""
    rows, in_features = x.shape
    groups = x.float().view(rows, in_features // 64, 64)
    largest = groups.abs().amax(-1, keepdim=True)
    # (a tensor quotient: ``127.0 / largest`` is 127 * (1 / largest) in torch, one rounding
    # more than the kernel's division, which moves values sitting on a .5 tie)
    inverse = torch.where(largest > 0, torch.full_like(largest, 127.0) / largest, 0.0)
    codes = torch.round(groups * inverse).double()
    dots = torch.einsum("rgk,ngk->rng", codes, int8.double().view(-1, in_features // 64, 64))
    per_group = (largest / 127.0).double().squeeze(-1)  # [rows, groups]
    y = (dots * per_group[:, None, :]).sum(-1) * scales.double()
    return y.to(x.dtype)


def _needs_integer_int8() -> None:
    if not torch.ops.kvserve.int8_integer_supported():
        pytest.skip("no AVX2 and no AVX512_VNNI: the integer int8 kernel never runs here")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("in_features", [64, 192, 576])  # 1, 3 and 9 groups: odd tails
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_integer_linear_matches_group_quantized_math(native, rows, in_features, dtype):
    """The integer kernel (VNNI, or its AVX2 form under KVSERVE_CPU_ISA=avx2 and on AVX2
    CPUs: tests/model/test_cpu_isa.py reruns this file) equals int8 activations (per group
    of 64) times int8 weights summed exactly, up to float32 rounding of the per-group sums;
    and it stays within int8's rounding of the float kernel's exact-activation result."""
    _needs_integer_int8()
    torch.manual_seed(rows * in_features)
    linear = Int8Linear.from_dense(torch.randn(70, in_features), rowwise=True)
    assert linear.rowwise is not None and linear.integer
    int8, scales = linear.rowwise
    x = (torch.randn(rows, in_features) * torch.linspace(0.1, 3, in_features)).to(dtype)
    x[0, :64] = 0.0  # an all-zero group: scale 0, no division by zero
    out = torch.empty(rows, 70, dtype=dtype)
    torch.ops.kvserve.int8_linear_vnni(out, x.contiguous(), int8, scales)
    expected = vnni_reference(x, int8, scales)
    tolerance = 1e-4 if dtype == torch.float32 else 8e-3  # bf16 out: one rounding
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
    exact = x.float() @ (int8.float() * scales[:, None]).T
    assert (out.float() - exact).abs().max() <= 0.02 * exact.abs().max()
    if rows <= ROWWISE_MAX_ROWS:  # the layer's few-row path is this kernel
        torch.testing.assert_close(linear(x), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_integer_linear_gives_a_row_the_same_bits_alone_and_in_a_batch(native, dtype):
    """A row's result does not depend on the rows or weight rows beside it: alone, among
    eight, and for weight rows cut out of a larger matrix (1001 outputs: two threads'
    ranges and a short last block), the same bits."""
    _needs_integer_int8()
    torch.manual_seed(1001)
    linear = Int8Linear.from_dense(torch.randn(1001, 576), rowwise=True)
    assert linear.rowwise is not None
    int8, scales = linear.rowwise
    x = torch.randn(8, 576).to(dtype)
    batch = torch.empty(8, 1001, dtype=dtype)
    torch.ops.kvserve.int8_linear_vnni(batch, x, int8, scales)
    for row in range(8):
        alone = torch.empty(1, 1001, dtype=dtype)
        torch.ops.kvserve.int8_linear_vnni(alone, x[row : row + 1].contiguous(), int8, scales)
        assert torch.equal(alone[0], batch[row])
    part = torch.empty(8, 7, dtype=dtype)
    torch.ops.kvserve.int8_linear_vnni(part, x, int8[3:10].contiguous(), scales[3:10].contiguous())
    assert torch.equal(part, batch[:, 3:10])


def test_int8_integer_kernel_only_where_it_can_run(native):
    """The layer takes the integer kernel exactly when the CPU runs it (VNNI or AVX2) and
    in_features is a multiple of 64; the op refuses other shapes and mixed dtypes with a
    message."""
    supported = bool(torch.ops.kvserve.int8_integer_supported())
    assert Int8Linear.from_dense(torch.randn(8, 128), rowwise=True).integer == supported
    assert not Int8Linear.from_dense(torch.randn(8, 100), rowwise=True).integer
    assert not Int8Linear.from_dense(torch.randn(8, 128)).integer  # no row-major copy
    if not supported:
        return
    int8, scales = torch.zeros(8, 96, dtype=torch.int8), torch.ones(8)
    with pytest.raises(RuntimeError, match="divisible by 64"):
        torch.ops.kvserve.int8_linear_vnni(torch.empty(1, 8), torch.randn(1, 96), int8, scales)
    int8 = torch.zeros(8, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="float32 or both bfloat16"):
        out = torch.empty(1, 8, dtype=torch.bfloat16)
        torch.ops.kvserve.int8_linear_vnni(out, torch.randn(1, 64), int8, scales)


def _needs_avx512_bf16() -> None:
    # The kernel's own cases only: everything else in the suite runs on every CPU class.
    if not torch.ops.kvserve.bf16_linear_supported():
        pytest.skip("this CPU has no AVX512_BF16 (the bf16 kernel is never used on it)")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, BF16_ROWWISE_MAX_ROWS])
@pytest.mark.parametrize("in_features", [64, 100, 576])  # 100: a masked tail; 576: 9 x 64
def test_bf16_linear_matches_float32_math_within_bf16_rounding(native, rows, in_features):
    """The few-row bf16 kernel: float32 accumulation of bf16 products, one bf16 rounding
    at the end (torch's bf16 GEMM rounds the same way, so they agree to one bf16 ulp)."""
    _needs_avx512_bf16()
    torch.manual_seed(rows * in_features)
    weight = torch.randn(37, in_features).to(torch.bfloat16)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    out = torch.empty(rows, 37, dtype=torch.bfloat16)
    torch.ops.kvserve.bf16_linear(out, x, weight)
    exact = x.float() @ weight.float().T
    torch.testing.assert_close(out.float(), exact.to(torch.bfloat16).float(), atol=0.02, rtol=8e-3)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), atol=0.02, rtol=8e-3)


@pytest.mark.parametrize("in_features", [100, 576, 1536])
def test_bf16_linear_gives_a_row_the_same_bits_alone_and_in_a_batch(native, in_features):
    """Each output is its own chain of products and one fixed sum of its lanes, whatever
    rows and weight rows share its block: a row alone, the same row among the kernel's
    most rows, and the same weight rows cut out of a larger matrix (1001 outputs: two
    threads' ranges and a short last block) all give the same bits."""
    _needs_avx512_bf16()
    torch.manual_seed(in_features)
    weight = torch.randn(1001, in_features).to(torch.bfloat16)
    rows = BF16_ROWWISE_MAX_ROWS
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    batch = torch.empty(rows, 1001, dtype=torch.bfloat16)
    torch.ops.kvserve.bf16_linear(batch, x, weight)
    for row in range(rows):
        alone = torch.empty(1, 1001, dtype=torch.bfloat16)
        torch.ops.kvserve.bf16_linear(alone, x[row : row + 1].contiguous(), weight)
        assert torch.equal(alone[0], batch[row])
    part = torch.empty(rows, 7, dtype=torch.bfloat16)
    torch.ops.kvserve.bf16_linear(part, x, weight[3:10].contiguous())
    assert torch.equal(part, batch[:, 3:10])
    exact = x.float() @ weight.float().T
    torch.testing.assert_close(
        batch.float(), exact.to(torch.bfloat16).float(), atol=0.06, rtol=8e-3
    )


def test_bf16_linear_rounds_each_output_to_nearest_even_as_torch_does(native):
    """The kernel's float32 sums are rounded to bf16 as torch rounds them, ties to even,
    through both of its stores: a full block of four outputs and a short last block. The
    sums here are exact in float32 and sit on bf16 ties, past bf16's range, or are NaN."""
    _needs_avx512_bf16()
    tiny, step = 2.0**-8, 2.0**-7  # half a bf16 ulp of 1.0, and a whole one
    big = float(torch.finfo(torch.bfloat16).max)
    pairs = [
        (1.0, tiny),  # a tie below an even mantissa: down to 1.0
        (1.0 + step, tiny),  # a tie below an odd one: up to 1 + 2 ulp
        (-(1.0 + step), -tiny),  # the same, negative
        (1.0, tiny / 2),  # under half an ulp: down
        (big, big),  # past float32's range: inf
        (float("nan"), 1.0),  # NaN stays NaN
    ]
    weight = torch.tensor(pairs, dtype=torch.bfloat16)  # six outputs: blocks of 4 and 2
    x = torch.ones(5, 2, dtype=torch.bfloat16)  # five rows: passes of 4 and 1
    out = torch.empty(5, len(pairs), dtype=torch.bfloat16)
    torch.ops.kvserve.bf16_linear(out, x, weight)
    expected = (x.float() @ weight.float().T).to(torch.bfloat16)
    assert expected[0, :4].float().tolist() == [1.0, 1.0 + 2 * step, -(1.0 + 2 * step), 1.0]
    torch.testing.assert_close(out, expected, atol=0, rtol=0, equal_nan=True)


def test_bf16_linear_refuses_what_it_cannot_serve(native):
    _needs_avx512_bf16()
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.kvserve.bf16_linear(torch.empty(2, 8), x.float(), torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="shape"):
        out = torch.empty(2, 8, dtype=torch.bfloat16)
        torch.ops.kvserve.bf16_linear(out, x, torch.randn(8, 32, dtype=torch.bfloat16))


def _needs_amx() -> None:
    if not torch.ops.kvserve.amx_available():
        pytest.skip("this CPU has no AMX-BF16 (the AMX kernel is never used on it)")


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, BF16_AMX_MAX_ROWS])
@pytest.mark.parametrize("shape", [(48, 64), (960, 576), (576, 1536)])  # (out, in)
def test_bf16_linear_amx_matches_float32_math_within_bf16_rounding(native, rows, shape):
    """The AMX kernel: tile products of bf16 pairs summed in float32, one bf16 rounding per
    output, for row counts that fill, split and leave part of its 16-row tiles and feature
    counts with a last 16-feature block (48) or none (960)."""
    _needs_amx()
    torch.manual_seed(rows * shape[1])
    weight = torch.randn(*shape).to(torch.bfloat16)
    x = torch.randn(rows, shape[1]).to(torch.bfloat16)
    out = torch.empty(rows, shape[0], dtype=torch.bfloat16)
    torch.ops.kvserve.bf16_linear_amx(out, x, weight)
    exact = x.float() @ weight.float().T
    torch.testing.assert_close(out.float(), exact.to(torch.bfloat16).float(), atol=0.06, rtol=8e-3)


def test_bf16_linear_amx_gives_a_row_the_same_bits_alone_and_in_a_batch(native):
    """A row's sums are the same tile products in the same order whatever else is in the
    call: alone, as the 17th of 33 rows (a second tile's first row) and among 64."""
    _needs_amx()
    torch.manual_seed(0)
    weight = torch.randn(1008, 576).to(torch.bfloat16)
    x = torch.randn(BF16_AMX_MAX_ROWS, 576).to(torch.bfloat16)
    batch = torch.empty(BF16_AMX_MAX_ROWS, 1008, dtype=torch.bfloat16)
    torch.ops.kvserve.bf16_linear_amx(batch, x, weight)
    for rows in (1, 33):
        part = torch.empty(rows, 1008, dtype=torch.bfloat16)
        torch.ops.kvserve.bf16_linear_amx(part, x[16 : 16 + rows].contiguous(), weight)
        assert torch.equal(part, batch[16 : 16 + rows])


def test_bf16_linear_amx_refuses_what_it_cannot_serve(native):
    """Where the CPU has no AMX the op says so instead of faulting on a tile instruction;
    where it has, shapes its tiles do not fit are refused with the reason."""
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    out = torch.empty(8, 32, dtype=torch.bfloat16)
    if not torch.ops.kvserve.amx_available():
        with pytest.raises(RuntimeError, match="AMX"):
            torch.ops.kvserve.bf16_linear_amx(out, x, torch.randn(32, 64).to(torch.bfloat16))
        return
    with pytest.raises(RuntimeError, match="% 32"):
        torch.ops.kvserve.bf16_linear_amx(
            out, x[:, :48].contiguous(), torch.randn(32, 48).to(torch.bfloat16)
        )
    with pytest.raises(RuntimeError, match="% 16"):
        narrow = torch.empty(8, 24, dtype=torch.bfloat16)
        torch.ops.kvserve.bf16_linear_amx(narrow, x, torch.randn(24, 64).to(torch.bfloat16))


def test_bf16_layers_take_the_amx_kernel_only_where_it_runs(native, tiny_llama_factory):
    """quantize_weights('none', rowwise) marks a bf16 projection for the AMX kernel exactly
    where the CPU has AMX-BF16 and its shape fits the tiles; such a layer agrees with
    F.linear on either side of the AMX row range, and --batch-invariant never takes it."""
    from engine.model.loader import model_from_reference

    _, reference = tiny_llama_factory()
    weights = model_from_reference(reference.to(torch.bfloat16)).weights
    weights = quantize_weights(weights, "none", rowwise=True)
    linears = [weights.lm_head] + [
        linear for layer in weights.layers for linear in linear_layers(layer)
    ]
    for linear in linears:
        assert isinstance(linear, DenseLinear)
        assert linear.amx == bf16_amx_supported(linear.weight)
    amx = bool(torch.ops.kvserve.amx_available())
    assert bf16_amx_supported(torch.empty(32, 64, dtype=torch.bfloat16)) == amx
    assert not bf16_amx_supported(torch.empty(32, 48, dtype=torch.bfloat16))
    weight = torch.randn(48, 64).to(torch.bfloat16)
    assert not DenseLinear(weight, rowwise=True, invariant=True, amx=True).amx
    layer = DenseLinear(weight, rowwise=bf16_rowwise_supported(weight), amx=amx)
    for rows in (1, BF16_AMX_MIN_ROWS, BF16_AMX_MAX_ROWS, BF16_AMX_MAX_ROWS + 1):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        torch.testing.assert_close(
            layer(x), torch.nn.functional.linear(x, weight), atol=0.06, rtol=8e-3
        )


def test_bf16_model_takes_the_kernel_for_few_rows_only_where_the_cpu_has_it(
    native, tiny_llama_factory
):
    """quantize_weights('none', rowwise) turns the row-wise kernel on for a bf16 model
    exactly when the CPU supports it (and for a float32 model where the float32 kernel
    runs, up to F32_CHUNKED_MAX_ROWS rows); a bf16 layer with it on agrees with F.linear at
    every row count (the kernel up to BF16_ROWWISE_MAX_ROWS rows, torch's GEMM past it)."""
    from engine.model.loader import model_from_reference

    _, reference = tiny_llama_factory()
    supported = bool(torch.ops.kvserve.bf16_linear_supported())
    for dtype in (torch.float32, torch.bfloat16):
        weights = model_from_reference(reference.to(dtype)).weights
        weights = quantize_weights(weights, "none", rowwise=True)
        linears = [weights.lm_head] + [
            linear for layer in weights.layers for linear in linear_layers(layer)
        ]
        expected = dtype == torch.bfloat16 and supported
        f32 = dtype == torch.float32 and bool(torch.ops.kvserve.f32_linear_supported())
        assert {isinstance(x, DenseLinear) and x.rowwise for x in linears} == {expected or f32}
        assert {x.chunked_rows for x in linears} == {F32_CHUNKED_MAX_ROWS if f32 else 0}
        assert bf16_rowwise_supported(weights.embed) == expected
        assert weights.lm_head_tied == model_from_reference(reference).weights.lm_head_tied
    layer = DenseLinear(torch.randn(40, 64).to(torch.bfloat16), rowwise=supported)
    for rows in (1, BF16_ROWWISE_MAX_ROWS, BF16_ROWWISE_MAX_ROWS + 1):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        reference_out = torch.nn.functional.linear(x, layer.weight)
        torch.testing.assert_close(layer(x), reference_out, atol=0.02, rtol=8e-3)


def _needs_avx2_fma() -> None:
    # The kernel's own cases only: everything else in the suite runs on every CPU class.
    if not torch.ops.kvserve.f32_linear_supported():
        pytest.skip("this CPU has no AVX2 + FMA (the float32 kernel is never used on it)")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, F32_ROWWISE_MAX_ROWS])
@pytest.mark.parametrize("in_features", [64, 100, 256, 772])  # 100, 772: masked tails
def test_f32_linear_matches_torch(native, rows, in_features):
    """The few-row float32 kernel: float32 products and sums, within float32 rounding of
    the exact (float64) result and of torch's GEMM."""
    _needs_avx2_fma()
    torch.manual_seed(rows * in_features)
    weight = torch.randn(37, in_features)
    x = torch.randn(rows, in_features)
    out = torch.empty(rows, 37)
    torch.ops.kvserve.f32_linear(out, x, weight)
    exact = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(out, exact, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("in_features", [64, 100, 768])
def test_f32_linear_gives_a_row_the_same_bits_alone_and_in_any_batch(native, in_features):
    """Batch invariance: each output is one row's dot product summed in a fixed order, so
    a row computes bit-identical results alone, within 16 rows, at any position, and on
    any number of threads."""
    _needs_avx2_fma()
    torch.manual_seed(in_features)
    weight = torch.randn(300, in_features)  # several threads' worth of output rows
    x = torch.randn(F32_ROWWISE_MAX_ROWS, in_features)
    batched = torch.empty(F32_ROWWISE_MAX_ROWS, 300)
    torch.ops.kvserve.f32_linear(batched, x, weight)
    for rows in range(1, F32_ROWWISE_MAX_ROWS + 1):
        part = torch.empty(rows, 300)
        torch.ops.kvserve.f32_linear(part, x[-rows:].contiguous(), weight)
        assert torch.equal(part, batched[-rows:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = torch.empty_like(batched)
        torch.ops.kvserve.f32_linear(serial, x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, batched)


def test_f32_linear_refuses_what_it_cannot_serve(native):
    _needs_avx2_fma()
    weight = torch.randn(8, 64)
    too_many = F32_ROWWISE_MAX_ROWS + 1
    with pytest.raises(RuntimeError, match=f"at most {F32_ROWWISE_MAX_ROWS} rows"):
        torch.ops.kvserve.f32_linear(torch.empty(too_many, 8), torch.randn(too_many, 64), weight)
    with pytest.raises(RuntimeError, match="float32"):
        x = torch.randn(2, 64, dtype=torch.bfloat16)
        torch.ops.kvserve.f32_linear(torch.empty(2, 8, dtype=torch.bfloat16), x, weight)
    with pytest.raises(RuntimeError, match="float32 weights"):
        torch.ops.kvserve.f32_linear(torch.empty(2, 8), torch.randn(2, 64), weight.bfloat16())
    with pytest.raises(RuntimeError, match="shape"):
        torch.ops.kvserve.f32_linear(torch.empty(2, 8), torch.randn(2, 64), torch.randn(8, 32))


def test_a_rowwise_float32_layer_takes_the_kernel_up_to_its_row_limit(native):
    """A row-wise float32 DenseLinear (an MoE expert) agrees with F.linear, its bias
    included, on either side of F32_ROWWISE_MAX_ROWS (the kernel, then torch's GEMM)."""
    _needs_avx2_fma()
    torch.manual_seed(5)
    layer = DenseLinear(torch.randn(40, 64), torch.randn(40), rowwise=True)
    for rows in (1, F32_ROWWISE_MAX_ROWS, F32_ROWWISE_MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)
    one = torch.randn(1, 64)
    assert torch.equal(layer(one), layer(torch.cat([one, torch.randn(7, 64)]))[:1])
