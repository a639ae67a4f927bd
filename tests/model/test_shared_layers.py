"""Shared layers no family test reaches yet (OLMo 2's all-heads QK-norm, Phi-3's partial
rotary, bf16 Gemma norms, the walks quantization and byte counting rely on), each against
the formula its reference model uses."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.model.kernels.base import TorchKernels
from engine.model.kernels.native import NativeKernels, load_native_ops
from engine.model.layers.attention import (
    QK_NORM_ALL_HEADS,
    QK_NORM_PER_HEAD,
    AttentionWeights,
    normalize_qk,
)
from engine.model.layers.linear import (
    DenseLinear,
    Int8Linear,
    Linear,
    linear_layers,
    map_linears,
    parameter_bytes,
)
from engine.model.layers.norms import offset_norm_weight
from engine.model.spec import ModelSpec

SPEC = ModelSpec(
    model_type="llama",
    num_layers=1,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    vocab_size=100,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def backends() -> list[TorchKernels]:
    return [TorchKernels(), *([NativeKernels()] if load_native_ops() else [])]


@pytest.mark.parametrize("kernels", backends(), ids=lambda k: k.name)
@pytest.mark.parametrize("mode", [QK_NORM_PER_HEAD, QK_NORM_ALL_HEADS])
def test_qk_norm_normalises_queries_and_keys_and_leaves_values(kernels, mode):
    torch.manual_seed(0)
    qkv = torch.randn(5, SPEC.q_size + 2 * SPEC.kv_size)
    width = SPEC.head_dim if mode == QK_NORM_PER_HEAD else None
    q_norm = torch.randn(width or SPEC.q_size)
    k_norm = torch.randn(width or SPEC.kv_size)
    weights = AttentionWeights(DenseLinear(torch.eye(1)), DenseLinear(torch.eye(1)), q_norm, k_norm)
    expected = qkv.clone()
    q, k = expected[:, : SPEC.q_size], expected[:, SPEC.q_size : SPEC.q_size + SPEC.kv_size]
    if mode == QK_NORM_PER_HEAD:  # Qwen3 / Gemma 3: each head on its own
        q.copy_(llama_rms_norm(q.reshape(-1, SPEC.head_dim), q_norm).view(5, -1))
        k.copy_(llama_rms_norm(k.reshape(-1, SPEC.head_dim), k_norm).view(5, -1))
    else:  # OLMo 2: each row's whole query (key) part
        q.copy_(llama_rms_norm(q, q_norm))
        k.copy_(llama_rms_norm(k, k_norm))
    actual = normalize_qk(qkv.clone(), weights, mode, SPEC, kernels)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kernels", backends(), ids=lambda k: k.name)
def test_partial_rotary_turns_only_the_leading_channels(kernels):
    """Phi-3's partial_rotary_factor: a table narrower than the head rotates its leading
    channels (rotate-half over them) and passes the rest through."""
    torch.manual_seed(1)
    qkv = torch.randn(3, SPEC.q_size + 2 * SPEC.kv_size)
    positions = torch.tensor([0, 5, 9])
    rotary_dim = 4
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    angles = torch.outer(torch.arange(16).float(), inv_freq)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    heads = qkv[:, : SPEC.q_size + SPEC.kv_size].view(3, -1, SPEC.head_dim)
    turned, passed = heads[..., :rotary_dim], heads[..., rotary_dim:]
    half = torch.cat([-turned[..., 2:], turned[..., :2]], -1)
    c, s = cos[positions][:, None], sin[positions][:, None]
    expected = torch.cat([turned * c + half * s, passed], -1).reshape(3, -1)
    actual = kernels.rotary(qkv.clone(), positions, cos, sin, SPEC)
    torch.testing.assert_close(actual[:, : expected.shape[1]], expected)
    assert torch.equal(actual[:, expected.shape[1] :], qkv[:, expected.shape[1] :])  # values


@pytest.mark.parametrize("kernels", backends(), ids=lambda k: k.name)
def test_a_gemma_norm_on_bf16_multiplies_in_float32_before_rounding(kernels):
    torch.manual_seed(2)
    x = torch.randn(4, 32).to(torch.bfloat16)
    w = torch.randn(32) * 0.1
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = (normed * (1.0 + w.float())).to(torch.bfloat16)  # Gemma2RMSNorm
    assert torch.equal(kernels.rms_norm(x, offset_norm_weight(w), 1e-6), expected)


@dataclass
class Expert:
    up: Linear
    down: Linear


@dataclass
class Block:
    experts: list[Expert]
    router: torch.Tensor
    shared: tuple[Linear, ...]


def test_the_weight_walks_reach_linears_in_nested_dataclasses_lists_and_tuples():
    """How quantization finds an MoE's experts without knowing its layout."""
    torch.manual_seed(3)

    def dense() -> DenseLinear:
        return DenseLinear(torch.randn(8, 64))

    block = Block([Expert(dense(), dense()) for _ in range(3)], torch.randn(3, 64), (dense(),))
    assert len(linear_layers(block)) == 7
    int8 = map_linears(block, lambda linear: Int8Linear.from_dense(linear.weight))  # type: ignore[attr-defined]
    assert all(isinstance(linear, Int8Linear) for linear in linear_layers(int8))
    assert int8.router is block.router and isinstance(int8.shared, tuple)
    assert parameter_bytes(block) == 7 * 8 * 64 * 4 + 3 * 64 * 4
    assert parameter_bytes(int8) == 7 * int8.shared[0].nbytes + 3 * 64 * 4
