"""The CPU decode fast path (engine/model/runtime/cpu_decode.py): one native call for every layer
of a decode step computes exactly what DecoderModel's Python loop computes, and steps it
cannot serve go the Python way."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.model.kernels.metadata import SequenceChunk, build_metadata
from engine.model.kernels.native import NativeKernels, load_native_ops
from engine.model.layers.attention import QK_NORM_ALL_HEADS, QK_NORM_PER_HEAD
from engine.model.layers.decoder import DecoderModel
from engine.model.layers.linear import DenseLinear
from engine.model.layers.moe import MoEMLP
from engine.model.layers.quantize import quantize_weights
from engine.model.loader import model_from_reference
from engine.model.runtime.cpu_decode import MAX_ROWS, DecodeLayers
from tests.model import family_models
from tests.model.family_models import random_reference
from tests.model.paged import BlockTables, make_cache, run_step

pytestmark = pytest.mark.skipif(not load_native_ops(), reason="needs the native kernels")

PROMPTS = [[5, 9, 17, 33, 65, 129, 7, 3, 2], [11, 12, 13, 14, 15, 16], [40, 41, 42, 43, 44]]
KV_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def decode_logits(model: DecoderModel, steps: int = 6) -> torch.Tensor:
    """Logits of a prefill of three prompts, then decode steps of 3 rows, then of 1."""
    cache = make_cache(model, num_blocks=64, block_size=4, kv_dtype=KV_DTYPES[model.dtype])
    tables = BlockTables(64, seed=3)
    blocks = [tables.allocate(len(p) + 2 * steps, 4) for p in PROMPTS]
    outputs = [run_step(model, cache, PROMPTS, [0, 0, 0], blocks)]
    lengths = [len(p) for p in PROMPTS]
    for step in range(steps):
        tokens = [[3 + step], [7 + step], [9 + step]]
        outputs.append(run_step(model, cache, tokens, lengths, blocks))
        lengths = [n + 1 for n in lengths]
    for step in range(steps):  # one sequence alone
        outputs.append(run_step(model, cache, [[20 + step]], lengths[:1], blocks[:1]))
        lengths[0] += 1
    return torch.cat(outputs)


def native_model(reference: torch.nn.Module, dtype: torch.dtype, quantization: str) -> DecoderModel:
    base = model_from_reference(reference.to(dtype))
    weights = quantize_weights(base.weights, quantization, rowwise=True)
    return base.replace(weights=weights, kernels=NativeKernels())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_the_fast_path_is_bit_identical_to_the_python_loop(
    tiny_llama_factory, monkeypatch: pytest.MonkeyPatch, dtype, quantization
):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    assert_fast_path_matches_python(native_model(reference, dtype, quantization), monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral", "granite"])
def test_qk_norm_expert_and_scaled_layers_take_the_fast_path_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, family, dtype, quantization
):
    """Qwen3's per-head QK RMSNorm (head_dim 32 over a 64-wide hidden state), mixtures of
    experts (Qwen3-MoE with a dense first layer, Mixtral) and Granite's multipliers run in
    the one native call, bit-identical to the Python loop."""
    build, _ = family_models.FAMILIES[family]
    model = native_model(random_reference(build), dtype, quantization)
    assert (model.options.qk_norm == QK_NORM_PER_HEAD) == family.startswith("qwen3")
    experts = [isinstance(layer.mlp, MoEMLP) for layer in model.weights.layers]
    assert any(experts) == (family in ("qwen3_moe", "mixtral"))
    assert (model.options.residual_multiplier is not None) == (family == "granite")
    assert_fast_path_matches_python(model, monkeypatch)


def test_the_families_whose_layers_take_the_fast_path():
    """Which families' decode steps the one native call serves (bf16): the Llama-shaped
    ones, QK-normed, mixture-of-experts and Granite's scaled ones included; the rest
    (biases, post-norms, soft-capping, sinks, GELU, and Phi-3's partial LongRoPE here) keep
    the Python loop."""
    fast = {
        family
        for family, (build, _) in family_models.FAMILIES.items()
        if native_model(random_reference(build), torch.bfloat16, "none").fast_decode is not None
    }
    assert fast == {"llama", "mistral", "ministral", "qwen3", "granite", "mixtral", "qwen3_moe"}


def test_qk_norms_it_does_not_run_keep_the_python_loop():
    """A QK-norm over all heads (OLMo 2's shape), or a layer missing one of its two
    norms, is not what decode_layers computes: such models keep the Python loop."""
    model = native_model(random_reference(family_models.qwen3), torch.float32, "none")
    assert model.fast_decode is not None
    options = dataclasses.replace(model.options, qk_norm=QK_NORM_ALL_HEADS)
    all_heads = DecoderModel(model.spec, model.weights, model.ropes, model.kernels, options)
    assert all_heads.fast_decode is None
    layers = model.weights.layers
    half = dataclasses.replace(layers[0].attention, k_norm=None)
    lopsided = [dataclasses.replace(layers[0], attention=half), *layers[1:]]
    weights = dataclasses.replace(model.weights, layers=lopsided)
    assert model.replace(weights=weights).fast_decode is None


def assert_fast_path_matches_python(fast: DecoderModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decode step of ``decode_logits`` takes the native path, and its logits are
    the Python loop's, bit for bit."""
    assert fast.fast_decode is not None
    python = fast.replace()
    python.fast_decode = None
    calls = []
    run = DecodeLayers.run

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(DecodeLayers, "run", counted)
    expected = decode_logits(python)
    assert not calls
    actual = decode_logits(fast)
    assert len(calls) == 12  # every decode step, no prefill
    assert torch.equal(actual, expected)


def test_steps_it_cannot_serve_go_the_python_way(tiny_llama_factory):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    model = native_model(reference, torch.float32, "none")
    fast = model.fast_decode
    assert fast is not None
    cache = make_cache(model, num_blocks=64, block_size=4)
    decode = SequenceChunk(num_computed=4, num_new=1, block_ids=[0, 1])
    prefill = SequenceChunk(num_computed=0, num_new=3, block_ids=[2])

    def meta(chunks: list[SequenceChunk]):  # type: ignore[no-untyped-def]
        return build_metadata(chunks, 4, torch.device("cpu"))

    assert fast.serves(meta([decode]), cache)
    assert fast.serves(meta([decode] * MAX_ROWS), cache)
    assert not fast.serves(meta([decode] * (MAX_ROWS + 1)), cache)
    assert not fast.serves(meta([decode, prefill]), cache)
    assert not fast.serves(meta([decode]), make_cache(model, 64, 4, "int8"))


def test_a_sliding_window_is_served_only_while_no_context_reaches_past_it(tiny_llama_factory):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    model = native_model(reference, torch.float32, "none")
    assert model.fast_decode is not None
    fast = dataclasses.replace(model.fast_decode, window=8)
    cache = make_cache(model, num_blocks=64, block_size=4)

    def decode(computed: int) -> SequenceChunk:
        return SequenceChunk(num_computed=computed, num_new=1, block_ids=[0, 1, 2, 3])

    def meta(chunks: list[SequenceChunk]):  # type: ignore[no-untyped-def]
        return build_metadata(chunks, 4, torch.device("cpu"))

    assert fast.serves(meta([decode(7)]), cache)  # 8 keys: all inside the window
    assert not fast.serves(meta([decode(8)]), cache)  # a 9th key: the window hides one
    assert not fast.serves(meta([decode(3), decode(8)]), cache)


def test_only_projections_with_a_few_row_kernel_and_no_bias_take_it(tiny_llama_factory):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    model = model_from_reference(reference).replace(kernels=NativeKernels())
    weights = model.weights
    assert model.fast_decode is not None
    int8 = quantize_weights(weights, "int8", rowwise=False)  # fbgemm only
    assert model.replace(weights=int8).fast_decode is None
    layer = weights.layers[0]
    qkv = layer.attention.qkv
    assert isinstance(qkv, DenseLinear)
    biased_qkv = DenseLinear(qkv.weight, torch.zeros(qkv.weight.shape[0]))
    biased_layer = dataclasses.replace(
        layer, attention=dataclasses.replace(layer.attention, qkv=biased_qkv)
    )
    biased = dataclasses.replace(weights, layers=[biased_layer, *weights.layers[1:]])
    assert model.replace(weights=biased).fast_decode is None
