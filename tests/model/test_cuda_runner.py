"""CudaModelRunner: all-decode steps go through DecodeGraphs' persistent buffers, every
other step (mixed, chunked, prefix hits, verifications) through StepMetadataBuilder's
staged buffer, never build_metadata; greedy output equals the reference either way. Runs
the eager variant on the CPU under TRITON_INTERPRET; graphs on a GPU are the cuda tests."""

from __future__ import annotations

import pytest
import torch

from tests.model.triton_setup import DEVICE  # isort: skip  (sets TRITON_INTERPRET first)
import engine.runner
from engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from engine.core import EngineCore
from engine.cuda_runner import CudaModelRunner, decode_graph_reserve
from engine.kv.accounting import KVShape
from engine.model.kernels.triton.triton_kernels import TritonKernels
from engine.model.loader import model_from_reference
from engine.model.runtime.kv_cache import KVPool, KVPoolLayout
from engine.scheduler import Scheduler
from tests.model.engine_helpers import greedy, reference_greedy, run_all

PROMPTS = {"a": [5, 9, 17, 33, 65, 129, 7], "b": [42] * 11, "c": [8, 9, 10]}


def cuda_core(
    model, eager: bool, max_num_seqs: int = 4, **scheduler_args
) -> tuple[EngineCore, CudaModelRunner]:
    spec = model.spec
    shape = KVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32")
    cache = CacheConfig(num_device_blocks=24, block_size=4)
    pool = KVPool(KVPoolLayout(shape, cache.num_device_blocks, cache.block_size), model.device)
    runner = CudaModelRunner(model, pool)
    runner.start_decode_graphs(max_num_seqs, max_model_len=32, eager=eager)
    scheduler = SchedulerConfig(max_model_len=32, max_num_seqs=max_num_seqs, **scheduler_args)
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


def record_staged_steps(runner: CudaModelRunner) -> list[tuple[int, int]]:
    """Record (rows, longest chunk) of every step staged by the metadata builder."""
    builder = runner.step_metadata
    assert builder is not None
    steps: list[tuple[int, int]] = []
    original = builder.build

    def spy(chunks, token_ids, logits_rows):
        steps.append((len(token_ids), max(c.num_new for c in chunks)))
        return original(chunks, token_ids, logits_rows)

    builder.build = spy  # type: ignore[method-assign]
    return steps


def record_step_kinds(runner: CudaModelRunner) -> list[set[str]]:
    """Record what each step held: "decode", "verify" (drafts), "prefill" (chunks)."""
    kinds: list[set[str]] = []
    original = runner._hidden

    def spy(batch):
        kinds.append(
            {
                "verify" if r.num_draft_tokens else "decode" if r.num_new_tokens == 1 else "prefill"
                for r in batch
            }
        )
        return original(batch)

    runner._hidden = spy  # type: ignore[method-assign]
    return kinds


def never_build_metadata(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the CUDA runner built metadata with blocking copies")

    monkeypatch.setattr(engine.runner, "build_grouped_metadata", refuse)


SHARED = [5, 9, 17, 33, 5, 9, 17, 33]
SPEC_PROMPTS = {"a": [*SHARED, 5, 9], "b": [*SHARED, 17, 33, 5], "c": [42] * 7}


def test_mixed_chunked_prefix_hit_and_verification_steps_are_staged(
    tiny_llama_factory, monkeypatch
):
    """Chunks of 6 tokens over 4-token blocks (starts inside blocks), a shared prefix
    (hits), n-gram drafts (verification rows beside prefill chunks): the reference's
    greedy tokens, and not one step through build_metadata."""
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    expected = {rid: reference_greedy(reference, p, 8) for rid, p in SPEC_PROMPTS.items()}
    model = model_from_reference(reference.to(DEVICE)).replace(kernels=TritonKernels(DEVICE))
    speculative = SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1
    )
    core, runner = cuda_core(model, eager=True, max_num_batched_tokens=6, speculative=speculative)
    never_build_metadata(monkeypatch)
    staged = record_staged_steps(runner)
    kinds = record_step_kinds(runner)
    params = {rid: greedy(8) for rid in SPEC_PROMPTS}
    assert run_all(core, SPEC_PROMPTS, params) == expected
    stats = core.stats()
    assert stats.prefix_cache_hits_total > 0 and stats.spec_drafts_total > 0
    assert {"verify", "prefill"} in kinds  # drafts verified beside a prefill chunk
    assert len(staged) == sum("prefill" in kind or "verify" in kind for kind in kinds)


def test_batches_larger_than_captured_take_the_ordinary_path(tiny_llama_factory):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    expected = {rid: reference_greedy(reference, p, 4) for rid, p in PROMPTS.items()}
    model = model_from_reference(reference.to(DEVICE)).replace(kernels=TritonKernels(DEVICE))
    core, runner = cuda_core(model, eager=True, max_num_seqs=4)
    assert runner.decode_graphs is not None
    runner.decode_graphs.ladder = [1, 2]  # as if only two rows had been captured
    sizes = count_graph_steps(runner)
    staged = record_staged_steps(runner)
    assert run_all(core, PROMPTS, {rid: greedy(4) for rid in PROMPTS}) == expected
    assert sizes == []
    assert staged.count((3, 1)) == 3  # the three-request decode steps, staged instead


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


def refuse_syncs(runner: CudaModelRunner) -> None:
    """Run every step's forward and logits gather with CUDA sync checks on: any
    synchronising torch call (a blocking copy, .item(), .tolist()) raises."""
    for name in ("_hidden", "_sample_logits"):
        original = getattr(runner, name)

        def checked(*args, _original=original):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return _original(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        setattr(runner, name, checked)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("eager", [True, False])
def test_no_step_syncs_before_the_sampler_on_cuda(tiny_llama_factory, eager):
    """Mixed, chunked, prefix-hit, verifying and decode steps: staged from pinned memory,
    nothing waits for the device before the sampler reads its ids; the reference's tokens."""
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    expected = {rid: reference_greedy(reference, p, 8) for rid, p in SPEC_PROMPTS.items()}
    model = model_from_reference(reference.to("cuda")).replace(kernels=TritonKernels(DEVICE))
    speculative = SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1
    )
    core, runner = cuda_core(model, eager=eager, max_num_batched_tokens=6, speculative=speculative)
    assert runner.step_metadata is not None
    assert all(staging.host.is_pinned() for staging in runner.step_metadata._staging)
    refuse_syncs(runner)
    params = {rid: greedy(8) for rid in SPEC_PROMPTS}
    assert run_all(core, SPEC_PROMPTS, params) == expected
    assert core.stats().spec_drafts_total > 0
