"""CudaModelRunner: all-decode steps go through DecodeGraphs' persistent buffers, the rest
through ModelRunner; greedy output equals the reference either way. Runs the eager
variant on the CPU under TRITON_INTERPRET; graphs on a GPU are the cuda test below."""

from __future__ import annotations

import pytest
import torch

from tests.model.triton_setup import DEVICE  # isort: skip  (sets TRITON_INTERPRET first)
from engine.config import CacheConfig, SchedulerConfig
from engine.core import EngineCore
from engine.cuda_runner import CudaModelRunner, decode_graph_reserve
from engine.kv.accounting import KVShape
from engine.model.kv_cache import KVPool, KVPoolLayout
from engine.model.loader import model_from_reference
from engine.model.triton_kernels import TritonKernels
from engine.scheduler import Scheduler
from tests.model.engine_helpers import greedy, reference_greedy, run_all

PROMPTS = {"a": [5, 9, 17, 33, 65, 129, 7], "b": [42] * 11, "c": [8, 9, 10]}


def cuda_core(model, eager: bool, max_num_seqs: int = 4) -> tuple[EngineCore, CudaModelRunner]:
    spec = model.spec
    shape = KVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32")
    cache = CacheConfig(num_device_blocks=24, block_size=4)
    pool = KVPool(KVPoolLayout(shape, cache.num_device_blocks, cache.block_size), model.device)
    runner = CudaModelRunner(model, pool)
    runner.start_decode_graphs(max_num_seqs, max_model_len=32, eager=eager)
    scheduler = SchedulerConfig(max_model_len=32, max_num_seqs=max_num_seqs)
    return EngineCore(Scheduler(scheduler, cache, shape), runner), runner


def count_graph_steps(runner: CudaModelRunner) -> list[int]:
    """Record the batch size of every step that went through the persistent buffers."""
    graphs = runner.decode_graphs
    assert graphs is not None
    sizes: list[int] = []
    original = graphs.hidden

    def spy(rows):
        sizes.append(len(rows))
        return original(rows)

    graphs.hidden = spy  # type: ignore[method-assign]
    return sizes


def test_decode_steps_use_the_buffers_and_match_the_reference(tiny_llama_factory):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    expected = {rid: reference_greedy(reference, p, 6) for rid, p in PROMPTS.items()}
    model = model_from_reference(reference.to(DEVICE)).replace(kernels=TritonKernels(DEVICE))
    core, runner = cuda_core(model, eager=True)
    sizes = count_graph_steps(runner)
    assert run_all(core, PROMPTS, {rid: greedy(6) for rid in PROMPTS}) == expected
    # After the prefills, every step decodes all three requests: 5 of them.
    assert sizes == [3] * 5


def test_batches_larger_than_captured_take_the_ordinary_path(tiny_llama_factory):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    expected = {rid: reference_greedy(reference, p, 4) for rid, p in PROMPTS.items()}
    model = model_from_reference(reference.to(DEVICE)).replace(kernels=TritonKernels(DEVICE))
    core, runner = cuda_core(model, eager=True, max_num_seqs=4)
    assert runner.decode_graphs is not None
    runner.decode_graphs.ladder = [1, 2]  # as if only two rows had been captured
    sizes = count_graph_steps(runner)
    assert run_all(core, PROMPTS, {rid: greedy(4) for rid in PROMPTS}) == expected
    assert sizes == []


def test_no_graph_memory_is_reserved_off_cuda(tiny_llama_factory):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    model = model_from_reference(reference).replace(kernels=TritonKernels(torch.device("cpu")))
    spec = model.spec
    shape = KVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32")
    assert decode_graph_reserve(model, shape, 4, 8, 32) == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_graphed_decode_steps_match_the_reference_on_cuda(tiny_llama_factory):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    expected = {rid: reference_greedy(reference, p, 6) for rid, p in PROMPTS.items()}
    model = model_from_reference(reference.to("cuda")).replace(kernels=TritonKernels(DEVICE))
    spec = model.spec
    shape = KVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32")
    assert decode_graph_reserve(model, shape, 4, 4, 32) > 0
    core, runner = cuda_core(model, eager=False)
    sizes = count_graph_steps(runner)
    assert run_all(core, PROMPTS, {rid: greedy(6) for rid in PROMPTS}) == expected
    assert sizes == [3] * 5
