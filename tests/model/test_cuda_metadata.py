"""StepMetadataBuilder (engine/model/runtime/cuda_metadata.py): any step's metadata for the Triton
backend from one staged buffer. On the CPU under TRITON_INTERPRET (pinning skipped) it
must give the logits and the cache contents of ``build_metadata``'s path for mixed steps:
decodes, verification rows, a chunk starting inside a block, a prefix hit, a fresh
prefill. The pinned, non-blocking and sync-free parts are the cuda tests at the end."""

from __future__ import annotations

import pytest
import torch

from tests.model.triton_setup import DEVICE  # isort: skip  (sets TRITON_INTERPRET first)
from engine.model.kernels.metadata import SequenceChunk, build_metadata
from engine.model.kernels.triton.triton_kernels import TritonKernels
from engine.model.loader import model_from_reference
from engine.model.runtime.cuda_metadata import StepMetadataBuilder
from tests.model.paged import BlockTables, make_cache, run_step

ATOL = 1e-5


def triton_model(tiny_llama_factory):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    return model_from_reference(reference.to(DEVICE)).replace(kernels=TritonKernels(DEVICE))


def mixed_step(block_size: int) -> tuple[list[list[int]], list[int], list[int]]:
    """(new tokens per chunk, tokens cached before each, which prior prompt's blocks each
    uses): a decode, a verification (three one-row chunks of one request), a chunk
    starting inside a block, a prefix hit (block-aligned, two blocks cached), and a fresh
    prefill. Decode rows come first, as the runner orders them."""
    hit = 2 * block_size
    new = [[21], [30], [31], [32], [40, 41, 42], [50, 51, 52], [60, 61, 62, 63, 64]]
    computed = [5, 7, 8, 9, 5, hit, 0]
    owner = [0, 1, 1, 1, 2, 3, 4]
    return new, computed, owner


def prepared(tiny_llama_factory, block_size: int):
    """A model and its cache holding the cached prefix of every chunk of ``mixed_step``
    (written by ordinary prefills), with each request's block table."""
    model = triton_model(tiny_llama_factory)
    cache = make_cache(model, num_blocks=48, block_size=block_size)
    tables = BlockTables(48, seed=7)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 17)), [1, 2, 3, 4, 5], [70] * 2 * block_size]
    blocks = [tables.allocate(len(p) + 6, block_size) for p in prompts]
    blocks.append(tables.allocate(8, block_size))
    run_step(model, cache, prompts, [0] * len(prompts), blocks[:4])
    # The verifying request's earlier drafts, as a previous decode step wrote them.
    run_step(model, cache, [[17]], [7], [blocks[1]])
    return model, cache, blocks


@pytest.mark.parametrize("block_size", [1, 4])
def test_mixed_step_matches_build_metadata(tiny_llama_factory, block_size):
    new, computed, owner = mixed_step(block_size)
    model, cache, blocks = prepared(tiny_llama_factory, block_size)
    _, twin, _ = prepared(tiny_llama_factory, block_size)
    tables = [blocks[i] for i in owner]
    expected = run_step(model, twin, new, computed, tables)
    chunks = [SequenceChunk(c, len(t), b) for t, c, b in zip(new, computed, tables, strict=True)]
    flat = [t for ids in new for t in ids]
    step = StepMetadataBuilder(block_size, model.device).build(chunks, flat, list(range(len(flat))))
    assert step.logits_rows is None  # every row, in order: no gather
    assert step.meta.varlen is not None and step.meta.varlen.max_query_len == 5
    logits = model.logits(model.forward(step.token_ids, step.meta, cache))
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    for mine, theirs in zip(cache.pool.tensors(), twin.pool.tensors(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=0)


def test_decode_only_step_is_one_row_per_sequence(tiny_llama_factory):
    """Decodes and drafts only: the launch is decode_attention's (no query offsets)."""
    block_size = 4
    new, computed, owner = mixed_step(block_size)
    model, cache, blocks = prepared(tiny_llama_factory, block_size)
    _, twin, _ = prepared(tiny_llama_factory, block_size)
    new, computed, tables = new[:4], computed[:4], [blocks[i] for i in owner[:4]]
    expected = run_step(model, twin, new, computed, tables)
    chunks = [SequenceChunk(c, 1, b) for c, b in zip(computed, tables, strict=True)]
    step = StepMetadataBuilder(block_size, model.device).build(chunks, [21, 30, 31, 32], [0, 3])
    assert step.meta.varlen is not None and step.meta.varlen.max_query_len == 1
    assert step.logits_rows is not None and step.logits_rows.tolist() == [0, 3]
    hidden = model.forward(step.token_ids, step.meta, cache)
    logits = model.logits(hidden.index_select(0, step.logits_rows))
    torch.testing.assert_close(logits, expected[[0, 3]], atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [1, 4])
def test_positions_and_slots_equal_build_metadata(block_size):
    new, computed, owner = mixed_step(block_size)
    tables = BlockTables(160, seed=3)
    blocks = [tables.allocate(24, block_size) for _ in range(5)]
    chunks = [
        SequenceChunk(c, len(t), blocks[o]) for t, c, o in zip(new, computed, owner, strict=True)
    ]
    flat = [t for ids in new for t in ids]
    cpu = torch.device("cpu")
    step = StepMetadataBuilder(block_size, cpu).build(chunks, flat, [3, 17])
    reference = build_metadata(chunks, block_size, cpu)
    assert step.token_ids.tolist() == flat
    assert step.meta.positions.tolist() == reference.positions.tolist()
    assert step.meta.slots.tolist() == reference.slots.tolist()
    varlen = step.meta.varlen
    assert varlen is not None
    assert varlen.seq_lens.tolist() == [c + len(t) for t, c in zip(new, computed, strict=True)]
    assert varlen.query_starts.tolist() == [0, 1, 2, 3, 4, 7, 10, 15]
    for row, chunk in zip(varlen.block_table.tolist(), chunks, strict=True):
        used = -(-(chunk.num_computed + chunk.num_new) // block_size)
        assert row[:used] == chunk.block_ids[:used]
    assert step.logits_rows is not None and step.logits_rows.tolist() == [3, 17]


def test_buffers_are_reused_and_grow_on_demand():
    builder = StepMetadataBuilder(4, torch.device("cpu"))
    buffer = builder.device_buffer

    def build(tokens: int):
        chunk = SequenceChunk(0, tokens, list(range(-(-tokens // 4))))
        return builder.build([chunk], [7] * tokens, [tokens - 1])

    first = build(10)
    second = build(12)
    assert builder.device_buffer is buffer  # reused: no allocation per step
    for view in (first.meta.slots, second.meta.varlen.block_table, second.token_ids):
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    grown = build(3000)  # 3 * 3000 tokens + a 750-block table: more than 4096 elements
    assert builder.device_buffer.numel() >= 9000 + 750
    assert grown.meta.positions.tolist() == list(range(3000))
    # The two host buffers alternate, so a step's staging survives the next one's.
    assert builder._staging[0].host is not builder._staging[1].host


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_staging_is_pinned_and_the_build_never_syncs():
    builder = StepMetadataBuilder(16, torch.device("cuda"))
    assert all(staging.host.is_pinned() for staging in builder._staging)
    chunks = [SequenceChunk(40, 1, [3, 4, 5]), SequenceChunk(17, 30, [6, 7, 8])]
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        step = builder.build(chunks, list(range(31)), [0, 30])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert step.meta.slots.is_cuda
    assert step.meta.positions.tolist() == [40, *range(17, 47)]
