"""The mixture-of-experts layer (engine/model/layers/moe.py) against transformers' own
router and expert blocks, per token and per layer, for Mixtral, Qwen3-MoE and gpt-oss;
and the way it works: one call per expert a step, however many tokens chose it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.builder import build_engine
from engine.config import EngineArgs
from engine.model.kernels.base import TorchKernels
from engine.model.kernels.native import load_native_ops
from engine.model.layers.linear import parameter_bytes
from engine.model.layers.moe import MoEMLP
from engine.model.layers.routing import SOFTMAX_TOPK, TOPK_SOFTMAX, Routing, route
from engine.model.loader import model_from_reference
from server.plan import build_report, format_report
from tests.model.family_models import FAMILIES, random_reference
from tests.model.test_family_serving import saved_model
from tests.model.test_weight_quant import parse_plan

MOE_FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")


def sparse_layers(reference: Any) -> list[tuple[int, Any]]:
    """(layer index, transformers' MoE block) for every layer that has experts."""
    blocks = []
    for index, layer in enumerate(reference.model.layers):
        if hasattr(layer.mlp, "experts"):
            blocks.append((index, layer.mlp))
    return blocks


def reference_router(block: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' (weights, ids) for ``hidden`` [tokens, hidden_size]."""
    router = block.router if hasattr(block, "router") else block.gate
    _, weights, ids = router(hidden)
    return weights, ids


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_token_picks_the_experts_transformers_picks(family: str) -> None:
    reference = random_reference(FAMILIES[family][0])
    model = model_from_reference(reference)
    torch.manual_seed(1)
    hidden = torch.randn(64, reference.config.hidden_size) * 3
    layers = sparse_layers(reference)
    assert layers, "the family has expert layers"
    for index, block in layers:
        ours = model.weights.layers[index].mlp
        assert isinstance(ours, MoEMLP)
        expected_weights, expected_ids = reference_router(block, hidden)
        logits = torch.nn.functional.linear(hidden, ours.router_weight, ours.router_bias)
        weights, ids = route(logits, ours.routing)
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(weights, expected_weights.float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_each_expert_layer_equals_transformers_block(family: str) -> None:
    reference = random_reference(FAMILIES[family][0])
    model = model_from_reference(reference)
    torch.manual_seed(2)
    hidden = torch.randn(40, reference.config.hidden_size)
    for index, block in sparse_layers(reference):
        with torch.no_grad():
            out = block(hidden[None])
        expected = (out[0] if isinstance(out, tuple) else out)[0]  # gpt-oss adds its scores
        actual = model.weights.layers[index].mlp(hidden, TorchKernels())
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_a_step_calls_each_chosen_expert_once_over_all_its_tokens() -> None:
    """Grouped by expert: 48 tokens choosing 2 of 4 experts make 4 expert calls, each on
    every token that chose it, not 96 calls of one token."""
    reference = random_reference(FAMILIES["mixtral"][0])
    moe = model_from_reference(reference).weights.layers[0].mlp
    assert isinstance(moe, MoEMLP)
    calls: list[tuple[int, int]] = []
    for number, expert in enumerate(moe.experts):
        original = expert.gate_up

        def spy(x: torch.Tensor, number: int = number, original: Any = original) -> torch.Tensor:
            calls.append((number, x.shape[0]))
            return original(x)

        expert.gate_up = spy  # type: ignore[method-assign]
    hidden = torch.randn(48, reference.config.hidden_size) * 3
    logits = torch.nn.functional.linear(hidden, moe.router_weight)
    _, ids = route(logits, moe.routing)
    moe(hidden, TorchKernels())
    chosen = torch.bincount(ids.flatten(), minlength=len(moe.experts)).tolist()
    assert calls == [(e, n) for e, n in enumerate(chosen) if n]
    assert sum(n for _, n in calls) == 48 * 2


def test_routing_rules() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    weights, ids = route(logits, Routing(top_k=2, rule=SOFTMAX_TOPK, renormalize=False))
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights[0], probs[[1, 2]])
    weights, _ = route(logits, Routing(top_k=2, rule=SOFTMAX_TOPK, renormalize=True))
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0))
    weights, ids = route(logits, Routing(top_k=2, rule=TOPK_SOFTMAX))
    torch.testing.assert_close(weights[0], torch.softmax(torch.tensor([3.0, 2.0]), -1))
    with pytest.raises(ValueError, match="routing rule"):
        Routing(top_k=1, rule="argmax")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_decode_step_counts_only_the_experts_it_reads(family: str) -> None:
    """The decode floor's bytes: every dense part, and per expert layer the router and
    ``top_k`` experts; the stored bytes count every expert."""
    model = model_from_reference(random_reference(FAMILIES[family][0]))
    for layer in model.weights.layers:
        moe = layer.mlp
        if not isinstance(moe, MoEMLP):
            continue
        one_expert = parameter_bytes(moe.experts[0])
        router = parameter_bytes([moe.router_weight, moe.router_bias])
        assert parameter_bytes(moe) == router + one_expert * len(moe.experts)
        assert parameter_bytes(moe, decode=True) == router + one_expert * moe.routing.top_k
    assert model.weights.decode_nbytes < model.weights.nbytes


@pytest.mark.skipif(not load_native_ops(), reason="int4 needs the native kernels")
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_plan_counts_every_expert_and_the_active_ones(
    family: str, quantization: str, smollm_tokenizer: Any, tmp_path: Path
) -> None:
    """`kvserve plan` from the config alone: the weight bytes the engine holds (every
    expert, quantized as the server quantizes them) and the parameters one token's step
    reads (``top_k`` of each layer's experts)."""
    reference = saved_model(FAMILIES[family][0], smollm_tokenizer, tmp_path)
    flags = ["--model", str(tmp_path), "--device", "cpu", "--dtype", "float32"]
    report = build_report(parse_plan(*flags, "--quantization", quantization))
    built = build_engine(
        EngineArgs(
            model=str(tmp_path),
            device="cpu",
            dtype="float32",
            quantization=quantization,
            kv_cache_memory_gib=1 / 1024,
            swap_space_gib=0,
        )
    )
    assert report.weight_bytes == built.weight_bytes
    config = reference.config
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    top_k = config.num_experts_per_tok
    stacked = [
        p.numel()
        for name, p in reference.named_parameters()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj"))
    ]
    unused = sum(stacked) * (experts - top_k) // experts
    assert report.experts == f"{top_k} of {experts} experts a layer"
    assert report.active_parameters == report.num_parameters - unused
    assert report.active_weight_bytes < report.weight_bytes
    if quantization == "none":
        assert report.active_weight_bytes == report.active_parameters * 4
    assert "active per token" in format_report(report)


def test_an_moe_model_is_never_captured_in_a_cuda_graph() -> None:
    """The expert counts are read on the host each layer, which a CUDA graph cannot
    replay: MoE decode steps run eagerly (dense models keep their graphs)."""
    moe = model_from_reference(random_reference(FAMILIES["mixtral"][0]))
    dense = model_from_reference(random_reference(FAMILIES["llama"][0]))
    assert moe.syncs_on_host and not dense.syncs_on_host


@pytest.mark.skipif(not load_native_ops(), reason="the native kernels did not build")
@pytest.mark.parametrize(
    ("dtype", "quantization"),
    [
        (torch.float32, "none"),
        (torch.bfloat16, "none"),
        (torch.float32, "int4"),
        (torch.bfloat16, "int4"),
        (torch.float32, "int8"),
        (torch.bfloat16, "int8"),
    ],
)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_native_layer_equals_the_python_loop(
    family: str, dtype: torch.dtype, quantization: str
) -> None:
    """csrc/moe.cpp routes with the same ATen calls and runs the same kernels in the same
    order as the Python path: bit-identical outputs for decode-sized and chunk-sized steps
    (int8: while no expert gets more rows than its few-row kernel, past which Python hands
    them to fbgemm); gpt-oss with its router bias, expert biases and clamped SwiGLU."""
    from engine.model.kernels.native import NativeKernels
    from engine.model.layers.quantize import quantize_weights

    reference = random_reference(FAMILIES[family][0]).to(dtype)
    model = model_from_reference(reference)
    weights = quantize_weights(model.weights, quantization, rowwise=True)
    kernels = NativeKernels()
    torch.manual_seed(3)
    for layer in weights.layers:
        moe = layer.mlp
        if not isinstance(moe, MoEMLP):
            continue
        native = moe.native_moe(dtype)
        assert native is not None
        for tokens in (1, 3, 48):
            x = torch.randn(tokens, reference.config.hidden_size).to(dtype)
            routed, ids = route(moe.router(True)(x), moe.routing)
            counts = torch.bincount(ids.flatten(), minlength=len(moe.experts))
            if quantization == "int8" and int(counts.max()) > 4:
                continue
            expected = moe.grouped(x, kernels, routed, ids)
            assert torch.equal(native.run(x), expected)
            assert torch.equal(moe(x, kernels), expected)  # the layer takes the op


@pytest.mark.skipif(not load_native_ops(), reason="the native kernels did not build")
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_float32_moe_token_gets_the_same_output_alone_and_in_a_batch(family: str) -> None:
    """A float32 MoE's experts and router take the few-row float32 kernel (AVX2 + FMA) up
    to F32_ROWWISE_MAX_ROWS rows, whose sums do not depend on the batch: a token's layer
    output is bit-identical alone and in a step of 16 tokens, on the native op and on the
    Python loop. The experts take it up to its own limit, as the native op does; the
    attention projections and the LM head in chunks up to F32_CHUNKED_MAX_ROWS rows."""
    from engine.model.kernels.native import NativeKernels
    from engine.model.layers.linear import (
        F32_CHUNKED_MAX_ROWS,
        F32_ROWWISE_MAX_ROWS,
        DenseLinear,
        linear_layers,
    )
    from engine.model.layers.quantize import quantize_weights

    if not torch.ops.kvserve.f32_linear_supported():
        pytest.skip("this CPU has no AVX2 + FMA (the float32 kernel is never used on it)")
    reference = random_reference(FAMILIES[family][0])
    weights = quantize_weights(model_from_reference(reference).weights, "none", rowwise=True)
    kernels = NativeKernels()
    assert isinstance(weights.lm_head, DenseLinear) and weights.lm_head.rowwise
    assert weights.lm_head.chunked_rows == F32_CHUNKED_MAX_ROWS
    torch.manual_seed(4)
    x = torch.randn(F32_ROWWISE_MAX_ROWS, reference.config.hidden_size)
    for layer in weights.layers:
        moe = layer.mlp
        if not isinstance(moe, MoEMLP):
            assert all(linear.chunked_rows for linear in linear_layers(layer))
            continue
        experts = linear_layers(moe.experts)
        assert experts and all(isinstance(e, DenseLinear) and e.rowwise for e in experts)
        assert not any(e.chunked_rows for e in experts)
        attention = linear_layers(layer.attention)
        assert all(linear.chunked_rows == F32_CHUNKED_MAX_ROWS for linear in attention)
        assert moe.router(True).rowwise
        batched = moe(x, kernels)
        routed, ids = route(moe.router(True)(x), moe.routing)
        assert torch.equal(moe.grouped(x, kernels, routed, ids), batched)
        for token in range(x.shape[0]):
            one = x[token : token + 1]
            assert torch.equal(moe(one, kernels), batched[token : token + 1])
            routed, ids = route(moe.router(True)(one), moe.routing)
            assert torch.equal(moe.grouped(one, kernels, routed, ids), batched[token : token + 1])
