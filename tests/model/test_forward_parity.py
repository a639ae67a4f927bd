"""Logits of kvserve's paged forward equal transformers' LlamaForCausalLM (fp32),
with either kernel backend (the ``kernels`` fixture)."""

from __future__ import annotations

import pytest
import torch

from engine.model.loader import model_from_reference
from tests.model.paged import BlockTables, make_cache, run_step

ATOL = 1e-4

SHAPES = {
    "mha-untied": dict(num_heads=4, num_kv_heads=4, tie_embeddings=False),
    "gqa-tied": dict(num_heads=4, num_kv_heads=2, tie_embeddings=True),
    "mqa-untied": dict(num_heads=4, num_kv_heads=1, tie_embeddings=False),
}


def reference_logits(reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_prefill_logits_match_transformers(tiny_llama_factory, kernels, shape, block_size):
    _, reference = tiny_llama_factory(**SHAPES[shape])
    model = model_from_reference(reference).replace(kernels=kernels)
    cache = make_cache(model, num_blocks=128, block_size=block_size)
    tables = BlockTables(128)
    prompts = [[3, 17, 99, 4, 5, 200, 7, 8, 9, 10, 11], [42, 43, 44]]
    blocks = [tables.allocate(len(p), block_size) for p in prompts]
    logits = run_step(model, cache, prompts, [0, 0], blocks)
    expected = torch.cat([reference_logits(reference, p) for p in prompts])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [3, 16])
def test_decode_and_chunked_prefill_through_paged_cache(
    tiny_llama_factory, kernels, shape, block_size
):
    """Chunked prefill then batched decode steps; every step's logits match the reference
    run on the full sequence so far."""
    _, reference = tiny_llama_factory(**SHAPES[shape])
    model = model_from_reference(reference).replace(kernels=kernels)
    cache = make_cache(model, num_blocks=256, block_size=block_size)
    tables = BlockTables(256, seed=3)
    seqs = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [100, 101, 102, 103, 104], [1, 2]]
    blocks = [tables.allocate(len(s) + 12, block_size) for s in seqs]
    # Chunked prefill: first 4 tokens of seq 0 alone, then the rest together with others.
    run_step(model, cache, [seqs[0][:4]], [0], [blocks[0]])
    logits = run_step(model, cache, [seqs[0][4:], seqs[1], seqs[2]], [4, 0, 0], blocks)
    expected = torch.cat(
        [reference_logits(reference, seqs[0])[4:]]
        + [reference_logits(reference, s) for s in seqs[1:]]
    )
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    for step in range(10):
        new = [[(17 * step + 31 * i) % 200] for i in range(len(seqs))]
        logits = run_step(model, cache, new, [len(s) for s in seqs], blocks)
        for seq, token in zip(seqs, new, strict=True):
            seq.extend(token)
        expected = torch.stack([reference_logits(reference, s)[-1] for s in seqs])
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_mixed_decode_and_prefill_in_one_forward(tiny_llama_factory, kernels):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    model = model_from_reference(reference).replace(kernels=kernels)
    cache = make_cache(model, num_blocks=64, block_size=4)
    tables = BlockTables(64, seed=7)
    first, second = [9, 8, 7, 6, 5, 4], [50, 60, 70, 80, 90, 91, 92]
    blocks = [tables.allocate(20, 4), tables.allocate(20, 4)]
    run_step(model, cache, [first], [0], [blocks[0]])
    logits = run_step(model, cache, [[33], second], [len(first), 0], blocks)
    expected = torch.cat(
        [reference_logits(reference, [*first, 33])[-1:], reference_logits(reference, second)]
    )
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
