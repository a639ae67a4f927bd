"""The memory profile's steps (engine/model/runtime/profile.py, profile_shapes.py): besides fresh
prefills, a chunk behind a long cached prefix and a prefix hit, the largest peak counted.
On the CPU their extra is computed (a bound per backend); on CUDA measured."""

from __future__ import annotations

import pytest
import torch

from engine.kv.accounting import KVShape
from engine.model.kernels.base import TorchKernels
from engine.model.loader import model_from_reference
from engine.model.runtime import profile
from engine.model.runtime.profile import activation_peaks, profile_shapes
from engine.model.runtime.profile_shapes import (
    chunked_chunks,
    context_attention_bytes,
    fresh_chunks,
    prefix_hit_chunks,
)


def new_tokens(chunks) -> int:
    return sum(c.num_new for c in chunks)


def test_chunked_prefill_attends_to_a_full_context_from_inside_a_block():
    chunks = chunked_chunks(total_tokens=10, max_len=64, block_size=16)
    first = chunks[0]
    assert (first.num_computed, first.num_new) == (54, 10)  # 54 = 3 blocks + 6: unaligned
    assert len(first.block_ids) == 4 and new_tokens(chunks) == 10
    # A budget above max_model_len: the chunk leaves one cached token, fresh prompts follow.
    chunks = chunked_chunks(total_tokens=100, max_len=64, block_size=16)
    assert [(c.num_computed, c.num_new) for c in chunks] == [(1, 63), (0, 37)]
    assert set(chunks[0].block_ids).isdisjoint(chunks[1].block_ids)


def test_prefix_hit_is_block_aligned_and_fits_the_context():
    chunks = prefix_hit_chunks(total_tokens=10, max_len=64, block_size=16)
    first = chunks[0]
    assert (first.num_computed, first.num_new) == (48, 10)
    chunks = prefix_hit_chunks(total_tokens=100, max_len=64, block_size=16)
    assert [(c.num_computed, c.num_new) for c in chunks] == [(16, 48), (0, 52)]
    assert new_tokens(chunks) == new_tokens(fresh_chunks(100, 64, 16)) == 100


def test_shapes_without_room_for_a_cached_prefix_are_left_out():
    assert set(profile_shapes(8, 64, 16)) == {"fresh", "chunked", "prefix-hit"}
    assert set(profile_shapes(8, 16, 16)) == {"fresh", "chunked"}
    assert set(profile_shapes(8, 1, 16)) == {"fresh"}


@pytest.fixture(scope="module")
def spec(tiny_llama_factory):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    return model_from_reference(reference).spec


def test_only_gathering_backends_pay_for_the_cached_context(spec):
    def extra(kernels: str, kv_dtype: str = "bfloat16", context: int = 1024) -> int:
        return context_attention_bytes(spec, kernels, kv_dtype, 16, context, 2)

    assert extra("triton") == extra("native") == extra("native", "int8") == 0
    assert extra("native", "fp8") == extra("torch") > 0  # fp8: native hands it to torch
    assert extra("torch", context=2048) == 2 * extra("torch")  # every term ∝ context


def test_cpu_reserve_is_the_largest_shape(tiny_llama_factory, monkeypatch):
    """Peak RSS unavailable (the deterministic estimate stands for the fresh peak): a
    long context makes the chunked shape the largest, and it is what gets reserved."""
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    model = model_from_reference(reference).replace(kernels=TorchKernels())
    spec = model.spec
    shape = KVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32")
    monkeypatch.setattr(profile, "_reset_peak_rss", lambda: False)
    peaks = activation_peaks(model, shape, tokens=8, max_len=256, block_size=16)
    fresh = profile._estimate_cpu_activation(model, 8)
    element = torch.finfo(model.dtype).bits // 8
    assert peaks["fresh"] == fresh
    assert peaks["chunked"] == fresh + context_attention_bytes(
        spec, "torch", "float32", 8, 256, element
    )
    # Both: 8 new tokens behind a prefix gathered as 256 keys.
    assert peaks["chunked"] == peaks["prefix-hit"] > fresh
    args = type("Args", (), {"max_num_batched_tokens": 8, "block_size": 16})()
    assert profile.measure_activation_peak(model, shape, args, 256) == peaks["chunked"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_measures_the_cached_context_shapes(tiny_llama_factory):
    """With the torch backend a chunk behind a long prefix gathers it: measured larger."""
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    model = model_from_reference(reference.to("cuda")).replace(kernels=TorchKernels())
    spec = model.spec
    shape = KVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32")
    peaks = activation_peaks(model, shape, tokens=16, max_len=4096, block_size=16)
    assert set(peaks) == {"fresh", "chunked", "prefix-hit"}
    assert peaks["chunked"] > peaks["fresh"] and peaks["prefix-hit"] > peaks["fresh"]
