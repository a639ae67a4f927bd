"""Int4 weight quantization (--quantization int4, Q4_1 groups of 32): the format's round
trip, the native kernel against the dequantized weights on both of its paths, bounded
logit error against float32, weight bytes and plan agreement, refusals that name the
flag, the engine end to end, and (slow) the real SmolLM2, whose GGUF projections are Q4_1
and must come back bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from engine.builder import build_engine
from engine.config import EngineArgs
from engine.model.kernels.native import load_native_ops
from engine.model.layers.decoder import DecoderModel, ModelWeights
from engine.model.layers.linear import (
    INT4_GROUP,
    INT4_GROUP_OVERHEAD_BYTES,
    INT4_INTEGER_MAX_ROWS,
    DenseLinear,
    Int4Linear,
    Int8Linear,
    Linear,
    check_quantization,
    linear_layers,
    map_linears,
    quantize_int4,
    unpack_int4,
)
from engine.model.layers.quantize import quantize_weights
from engine.model.loader import ModelSource, load_model, model_from_reference
from tests.model.engine_helpers import greedy, run_all, smollm_chat_prompt, smollm_greedy_answer
from tests.model.test_weight_quant import (
    assert_logits_close,
    parse_plan,
    prefill_and_decode_logits,
)

pytestmark = pytest.mark.skipif(not load_native_ops(), reason="int4 needs the native kernels")

# Int4 vs float32 logits on the tiny random models (Gaussian weights x4, far from any
# 4-bit grid), measured over seeds 0-2 and both shapes: relative error 0.196-0.233, max
# |error| 0.75-1.25 x the logits' std, top-1 agreement 0.64-0.84 (int8: 0.033-0.036, 0.17-0.22,
# 0.84-1.0). These bounds only catch a broken quantizer; the exactness of the int4 path
# itself is checked against the dequantized weights below.
RELATIVE_ERROR_BOUND = 0.3
MAX_ERROR_BOUND = 1.6  # x std of the float32 logits
TOP1_AGREEMENT = 0.55
ACTIVATION_ROUNDING_BOUND = 0.04


def q4_1_grid_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A weight already on a Q4_1 grid, as a GGUF's dequantized tensor is: float16 d and
    m per group, codes 0..15 with 0 and 15 present in every group (llama.cpp's quantizer
    maps each group's minimum and maximum to them)."""
    generator = torch.Generator().manual_seed(seed)
    groups = cols // INT4_GROUP
    codes = torch.randint(0, 16, (rows, groups, INT4_GROUP), generator=generator)
    codes[..., 0], codes[..., 1] = 0, 15
    scale = (torch.rand(rows, groups, 1, generator=generator) * 0.05 + 1e-3).half().float()
    low = (torch.randn(rows, groups, 1, generator=generator) * 0.1).half().float()
    return (codes * scale + low).reshape(rows, cols)


def test_a_q4_1_weight_round_trips_bit_for_bit():
    weight = q4_1_grid_weight(24, 96)
    packed, params = quantize_int4(weight)
    assert packed.dtype == torch.uint8 and packed.shape == (24 * 48,)
    assert params.dtype == torch.float16 and params.shape == (24 * 3 * 2,)
    assert torch.equal(unpack_int4(packed, params, 24, 96).dequantize(), weight)


@pytest.mark.parametrize("out_features", [16, 37])
def test_the_interleaved_layout_puts_four_codes_of_each_row_in_a_lane(out_features):
    """Blocks of 16 output rows (the last of R = out % 16), group by group: chunk c of a
    block's group holds, row after row, 4 bytes whose low nibbles are the row's elements
    4c..4c+3 and high nibbles 16+4c..16+4c+3; then the group's R scales and R minimums."""
    weight = q4_1_grid_weight(out_features, 64, seed=3)
    packed, params = quantize_int4(weight)
    groups = unpack_int4(packed, params, out_features, 64)
    for row in (0, 5, out_features - 1):
        block, rows = divmod(row, 16)[0], min(16, out_features - row // 16 * 16)
        lane = row % 16
        for group in (0, 1):
            codes = packed[block * 16 * 32 + group * 16 * rows :]
            for chunk in range(4):
                for byte in range(4):
                    value = int(codes[chunk * 4 * rows + 4 * lane + byte])
                    element = 4 * chunk + byte
                    assert value & 0x0F == groups.codes[row, group, element]
                    assert value >> 4 == groups.codes[row, group, 16 + element]
            pairs = params[block * 16 * 2 * 2 + group * 2 * rows :]
            assert pairs[lane] == groups.scales[row, group]
            assert pairs[rows + lane] == groups.minimums[row, group]
    scale_groups = weight.reshape(out_features, 2, INT4_GROUP)
    assert torch.equal(groups.minimums, scale_groups.amin(dim=2).half())


def test_quantization_error_is_at_most_half_a_step_per_group():
    weight = torch.randn(40, 128, generator=torch.Generator().manual_seed(1))
    groups = unpack_int4(*quantize_int4(weight), 40, 128)
    error = (groups.dequantize() - weight).abs().reshape(40, -1, INT4_GROUP)
    step = groups.scales[..., None].float()
    # Half a step, plus the float16 rounding of the group's minimum.
    assert (error <= step / 2 + 1e-3 * weight.abs().max()).all()
    assert error.max() > 0  # random weights are not on the grid


def kernel_reference(x: torch.Tensor, linear: Int4Linear) -> torch.Tensor:
    """What the kernel computes, in torch: up to INT4_INTEGER_MAX_ROWS rows the activations
    are rounded per group of 32 to int8 steps of max|x| / 127 (the minimum term uses the
    exact group sums); more rows multiply float32 activations by the dequantized weight."""
    weight = linear.dequantize()
    if x.shape[0] > INT4_INTEGER_MAX_ROWS:
        return x @ weight.T
    groups = x.reshape(x.shape[0], -1, INT4_GROUP)
    amax = groups.abs().amax(dim=2, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    rounded = ((groups * inverse).round() * (amax / 127.0)).reshape_as(x)
    low = linear.unpack().minimums.float()  # [out, groups]
    codes_times_scale = weight - low.repeat_interleave(INT4_GROUP, dim=1)
    return rounded @ codes_times_scale.T + groups.sum(dim=2) @ low.T


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 33])
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 64), (960, 576), (50, 1536)])
def test_int4_linear_computes_its_reference(rows, out_features, in_features):
    """Rows 1-8 take the integer path (in blocks of up to four rows: 5 = 4 + 1), more
    rows the dequantized-tile path; out_features that are not multiples of the 16-row
    tile or the 3-row block included. Against float32 activations the integer path's
    error is the int8 rounding of the activations: a few tenths of a percent."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    linear = Int4Linear.from_dense(weight, bias)
    actual = linear(x)
    expected = kernel_reference(x, linear) + bias
    scale = expected.abs().max().item()
    assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-5 * scale)
    exact = F.linear(x, linear.dequantize(), bias)
    assert (actual - exact).abs().max().item() < 0.02 * scale
    # bf16 activations go in as they are (quantized straight from bf16 up to 8 rows): the
    # float32 result on the same bf16 values, within one bf16 rounding of it.
    x16 = x.to(torch.bfloat16)
    from_bf16 = linear(x16)
    assert from_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(from_bf16.float(), linear(x16.float()), rtol=8e-3, atol=8e-3 * scale)


def test_int4_linear_bytes_are_the_packed_sizes():
    linear = Int4Linear.from_dense(torch.randn(48, 64), torch.randn(48))
    groups = 48 * 64 // INT4_GROUP
    assert linear.nbytes == 48 * 64 // 2 + groups * INT4_GROUP_OVERHEAD_BYTES + 48 * 4
    assert (linear.in_features, linear.out_features) == (64, 48)


def test_refusals_name_the_flag():
    with pytest.raises(ValueError, match=r"multiples of 32.*--quantization int8"):
        Int4Linear.from_dense(torch.randn(8, 48))
    with pytest.raises(ValueError, match="--quantization int4 runs on the CPU only"):
        check_quantization("int4", torch.device("cuda"))
    with pytest.raises(ValueError, match=r"native CPU kernels.*--kernels auto"):
        check_quantization("int4", torch.device("cpu"), "torch")
    check_quantization("int4", torch.device("cpu"), "native")


def int4_model(model: DecoderModel) -> DecoderModel:
    return model.replace(weights=quantize_weights(model.weights, "int4", rowwise=True))


@pytest.mark.parametrize(
    "shape",
    [
        {"num_heads": 4, "num_kv_heads": 2},
        {"num_heads": 4, "num_kv_heads": 4, "tie_embeddings": True},
    ],
    ids=["gqa-untied", "mha-tied"],
)
def test_int4_logits_stay_close_to_float32(tiny_llama_factory, kernels, shape):
    _, reference = tiny_llama_factory(**shape)
    model = model_from_reference(reference).replace(kernels=kernels)
    exact = prefill_and_decode_logits(model)
    approx = prefill_and_decode_logits(int4_model(model))
    assert_logits_close(approx, exact, RELATIVE_ERROR_BOUND, MAX_ERROR_BOUND, TOP1_AGREEMENT)


def test_int4_model_stays_close_to_a_dense_model_of_its_dequantized_weights(
    tiny_llama_factory, kernels
):
    """Everything the int4 path adds beyond the rounding of the weights: the int8 rounding
    of activations in steps of at most eight rows (all of this test's steps). Measured
    over seeds 0-3: relative logit error 0.019-0.023, a tenth of the int4 weights' own
    0.196-0.234 against float32, and top-1 agreement 0.96-1.0 with the twin."""
    _, reference = tiny_llama_factory()
    quantized = int4_model(model_from_reference(reference).replace(kernels=kernels))
    twin = quantized.replace(weights=dequantized_twin(quantized.weights))
    exact, actual = prefill_and_decode_logits(twin), prefill_and_decode_logits(quantized)
    relative = ((actual - exact).norm() / exact.norm()).item()
    assert 0 < relative < ACTIVATION_ROUNDING_BOUND, relative
    agree = (actual.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def dequantized_twin(weights: ModelWeights) -> ModelWeights:
    def dense(linear: Linear) -> Linear:
        assert isinstance(linear, Int4Linear)
        return DenseLinear(linear.dequantize(), linear.bias)

    return dataclasses.replace(weights, layers=map_linears(weights.layers, dense))


def test_projections_are_int4_and_the_head_int8(tiny_llama_factory):
    _, reference = tiny_llama_factory(tie_embeddings=True)
    dense = model_from_reference(reference).weights
    quantized = quantize_weights(dense, "int4", rowwise=True)
    for layer in quantized.layers:
        assert all(isinstance(linear, Int4Linear) for linear in linear_layers(layer))
    assert isinstance(quantized.lm_head, Int8Linear) and quantized.lm_head.rowwise is not None
    assert quantized.embed is dense.embed
    linears = [quantized.lm_head] + [
        linear for layer in quantized.layers for linear in linear_layers(layer)
    ]
    norms = [quantized.final_norm] + [
        t for layer in quantized.layers for t in (layer.input_norm, layer.pre_mlp_norm)
    ]
    expected = quantized.embed.numel() * 4 + sum(t.numel() * 4 for t in norms)
    assert quantized.nbytes == expected + sum(linear.nbytes for linear in linears)


def test_a_decode_token_streams_the_few_row_copies_and_not_the_embedding(tiny_llama_factory):
    """decode_nbytes, the weights a batch-1 step reads: the dense model streams its tied
    embedding as the LM head; int8 the row-major copies (not fbgemm's packed ones); int4
    the Q4_1 projections and the int8 head's row-major copy; never the embedding table
    when the head is not the embedding (a lookup reads one row)."""
    _, reference = tiny_llama_factory(tie_embeddings=True)
    dense = model_from_reference(reference).weights
    norms = sum(
        t.numel() * t.element_size()
        for t in [dense.final_norm]
        + [t for layer in dense.layers for t in (layer.input_norm, layer.pre_mlp_norm)]
    )
    assert dense.decode_nbytes == dense.nbytes  # tied: the embedding is the LM head
    int8 = quantize_weights(dense, "int8", rowwise=True)
    int4 = quantize_weights(dense, "int4", rowwise=True)
    for quantized in (int8, int4):
        head = quantized.lm_head
        assert isinstance(head, Int8Linear) and head.rowwise is not None
        head_copy = sum(t.numel() * t.element_size() for t in head.rowwise)
        projections = sum(
            linear.decode_nbytes for layer in quantized.layers for linear in linear_layers(layer)
        )
        assert quantized.decode_nbytes == norms + projections + head_copy
    int8_projections = int8.layers[0].attention.qkv
    assert isinstance(int8_projections, Int8Linear) and int8_projections.rowwise is not None
    assert int8_projections.decode_nbytes == sum(
        t.numel() * t.element_size() for t in int8_projections.rowwise
    )
    assert int4.decode_nbytes < int8.decode_nbytes < int8.nbytes


def test_engine_and_plan_agree_on_int4_weights_and_generate(tiny_model_dir):
    """build_engine(quantization=int4): weight bytes equal `kvserve plan`'s, and greedy
    generation runs; each first token is within the int4 error bound of float32's best."""
    from transformers import AutoModelForCausalLM

    from server.plan import build_report

    args = EngineArgs(model=str(tiny_model_dir), device="cpu", dtype="float32", quantization="int4")
    built = build_engine(args)
    flags = ["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32"]
    report = build_report(parse_plan(*flags, "--quantization", "int4"))
    assert built.weight_bytes == built.plan.weight_bytes == report.weight_bytes
    texts = ["The capital of France is", "One, two, three,", "Hello"]
    prompts = {f"r{i}": built.tokenizer.encode(t) for i, t in enumerate(texts)}
    outputs = run_all(built.core, prompts, {rid: greedy(12) for rid in prompts})
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for rid, prompt in prompts.items():
        assert len(outputs[rid]) == 12
        with torch.no_grad():
            exact = reference(torch.tensor([prompt])).logits[0, -1]
        assert exact[outputs[rid][0]] >= exact.max() - MAX_ERROR_BOUND * exact.std()


def test_int4_with_torch_kernels_is_refused_before_loading(tiny_model_dir):
    from server.plan import build_report

    args = EngineArgs(model=str(tiny_model_dir), device="cpu", quantization="int4", kernels="torch")
    with pytest.raises(ValueError, match="--quantization int4 runs on the native CPU kernels"):
        build_engine(args)
    flags = ["--model", str(tiny_model_dir), "--quantization", "int4", "--kernels", "torch"]
    plan_args = parse_plan(*flags)
    with pytest.raises(ValueError, match="--kernels auto or --quantization int8"):
        build_report(plan_args)


@pytest.mark.slow
def test_smollm_q4_1_projections_round_trip_and_the_answer_agrees(smollm_gguf, smollm_tokenizer):
    """The embedded GGUF stores every projection in Q4_1: int4 holds them bit for bit (only
    the LM head, Q8_0 in the file, is requantized to int8), so the greedy chat answer is
    float32's."""
    source = ModelSource.from_path(str(smollm_gguf))
    model = load_model(source, torch.float32, torch.device("cpu"), max_positions=64)
    for layer in model.weights.layers:
        for linear in linear_layers(layer):
            weight = linear.weight  # type: ignore[attr-defined]
            out_features, in_features = weight.shape
            groups = unpack_int4(*quantize_int4(weight), out_features, in_features)
            assert torch.equal(groups.dequantize(), weight)
    prompt = smollm_chat_prompt(smollm_tokenizer)
    exact = smollm_greedy_answer(str(smollm_gguf), prompt, 24)
    approx = smollm_greedy_answer(str(smollm_gguf), prompt, 24, "int4")
    assert approx == exact, (smollm_tokenizer.decode(approx), smollm_tokenizer.decode(exact))
