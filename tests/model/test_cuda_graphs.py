"""Decode steps through persistent buffers (engine/model/runtime/cuda_graphs.py): the batch-size
ladder, padding that writes and reads nothing, and logits equal to the ordinary forward's.
The eager path runs here under TRITON_INTERPRET; graph capture and replay need a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.model.triton_setup import DEVICE  # isort: skip  (sets TRITON_INTERPRET first)
from engine.model.kernels.triton.triton_kernels import TritonKernels
from engine.model.loader import model_from_reference
from engine.model.runtime.cuda_graphs import DecodeGraphs, DecodeRow, batch_size_ladder, padded_size
from tests.model.paged import BlockTables, make_cache, run_step


def test_ladder_is_increasing_and_ends_at_the_maximum():
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(6) == [1, 2, 4, 6]
    assert batch_size_ladder(128) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    assert batch_size_ladder(300) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 300]


def test_padded_size_is_the_smallest_rung_that_fits():
    ladder = batch_size_ladder(128)
    assert [padded_size(n, ladder) for n in (1, 3, 9, 33, 128)] == [1, 4, 16, 48, 128]
    with pytest.raises(ValueError, match="exceeds"):
        padded_size(129, ladder)


def prefilled(tiny_llama_factory, prompts: list[list[int]], block_size: int):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    model = model_from_reference(reference.to(DEVICE)).replace(kernels=TritonKernels(DEVICE))
    cache = make_cache(model, num_blocks=40, block_size=block_size)
    tables = BlockTables(40, seed=4)
    blocks = [tables.allocate(len(p) + 4, block_size) for p in prompts]
    run_step(model, cache, prompts, [0] * len(prompts), blocks)
    return model, cache, blocks


def changed_slots(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """Flat slots whose key or value rows differ, over every layer and head."""
    blocks, block_size = before.shape[2:4]
    rows = (before != after).permute(2, 3, 0, 1, 4).reshape(blocks * block_size, -1)
    return set(rows.any(dim=1).nonzero().flatten().tolist())


@pytest.mark.parametrize("block_size", [1, 4])
def test_padded_eager_step_equals_the_ordinary_forward(tiny_llama_factory, block_size):
    """Three decodes padded to four: the logits and stored K/V of the ordinary forward,
    and the padding row wrote nowhere (only the three new tokens' slots changed)."""
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
    model, cache, blocks = prefilled(tiny_llama_factory, prompts, block_size)
    _, twin, _ = prefilled(tiny_llama_factory, prompts, block_size)
    new_tokens = [[21], [22], [23]]
    expected = run_step(model, twin, new_tokens, [len(p) for p in prompts], blocks)
    graphs = DecodeGraphs(model, cache, max_batch=4, max_model_len=16, use_graphs=True)
    assert graphs.capture() == 0 and not graphs.use_graphs  # no CUDA here: eager
    rows = [
        DecodeRow(token_id=t[0], position=len(p), block_ids=b)
        for t, p, b in zip(new_tokens, prompts, blocks, strict=True)
    ]
    before = [t.clone() for t in cache.pool.tensors()]
    actual = graphs.logits(rows)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    new_slots = {
        b[len(p) // block_size] * block_size + len(p) % block_size
        for p, b in zip(prompts, blocks, strict=True)
    }
    for old, mine, theirs in zip(before, cache.pool.tensors(), twin.pool.tensors(), strict=True):
        assert changed_slots(old, mine) == new_slots
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    padding = graphs.inputs.host_fields[:, 3]
    assert padding[2] == -1 and padding[3] == 0  # slot -1, context 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("batch", [1, 3, 5])
def test_graph_replay_equals_the_eager_step_on_cuda(tiny_llama_factory, batch):
    prompts = [[5 + i, 6, 7 + i, 8][: 2 + i % 3] for i in range(batch)]
    logits = []
    for use_graphs in (False, True):
        model, cache, blocks = prefilled(tiny_llama_factory, prompts, 4)
        graphs = DecodeGraphs(model, cache, max_batch=8, max_model_len=16, use_graphs=use_graphs)
        captured = graphs.capture()
        assert (captured > 0) == use_graphs
        assert graphs.inputs.host_fields.is_pinned() and graphs.inputs.host_table.is_pinned()
        for step in range(2):  # the second step reads new inputs through the same buffers
            rows = [
                DecodeRow(30 + 10 * step + i, len(p) + step, b)
                for i, (p, b) in enumerate(zip(prompts, blocks, strict=True))
            ]
            logits.append(graphs.logits(rows).clone())
    torch.testing.assert_close(logits[2], logits[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[3], logits[1], atol=1e-5, rtol=0)
    assert not torch.equal(logits[0], logits[1])
