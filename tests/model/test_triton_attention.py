"""The Triton unified paged attention against a pure-torch reference: mixed batches of
decodes and prefill chunks (chunks starting inside a block, ragged lengths), block sizes
1 and 16, GQA ratios, every KV cache dtype, and decodes split over the context. Under
TRITON_INTERPRET on the CPU, compiled on a GPU."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.model.triton_setup import DEVICE  # isort: skip  (sets TRITON_INTERPRET first)
from engine.kv.accounting import KVShape
from engine.model.kernels.triton.triton_attention import (
    SplitWorkspace,
    choose_num_splits,
    unified_attention,
)
from engine.model.runtime.kv_cache import KVPool, KVPoolLayout, PagedKVCache

# (cached tokens before the step, new tokens): decodes first, then prefill chunks that
# start at 0, inside a block, on a block boundary, and one longer than a key tile.
MIXED = [(16, 1), (45, 1), (0, 1), (0, 5), (7, 9), (16, 3), (21, 20)]
DECODES = [(70, 1), (3, 1), (128, 1), (33, 1)]
# (query heads, KV heads, head_dim): MHA, GQA 3 (not a power of two) with a padded head
# dim, GQA 8 (a query tile of 8 tokens, so a 20-token chunk spans three tiles).
HEAD_LAYOUTS = [(4, 4, 16), (6, 2, 24), (8, 1, 16)]
KV_DTYPES = ["float32", "bfloat16", "float16", "int8", "fp8"]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@dataclass
class Batch:
    query: torch.Tensor  # [tokens, heads, head_dim]
    cache: PagedKVCache  # one layer, dequantized reads in float32
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_starts: torch.Tensor
    seqs: list[tuple[int, int]]


def compute_dtype(kv_dtype: str) -> torch.dtype:
    return getattr(torch, kv_dtype) if kv_dtype in ("bfloat16", "float16") else torch.float32


def make_batch(
    seqs: list[tuple[int, int]], layout: tuple[int, int, int], kv_dtype: str, block_size: int
) -> Batch:
    heads, kv_heads, head_dim = layout
    dtype = compute_dtype(kv_dtype)
    generator = torch.Generator().manual_seed(len(seqs) * 7 + block_size)
    lengths = [done + new for done, new in seqs]
    per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(per_seq) + 3
    shape = KVShape(1, kv_heads, head_dim, kv_dtype)
    cache = PagedKVCache(KVPool(KVPoolLayout(shape, num_blocks, block_size), DEVICE), torch.float32)
    order = torch.randperm(num_blocks, generator=generator).tolist()  # scattered blocks
    width = max(per_seq)
    rows = []
    for count in per_seq:
        blocks, order = order[:count], order[count:]
        rows.append(blocks + [blocks[0]] * (width - count))
        length = lengths[len(rows) - 1]
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(length)]
        keys = torch.randn(length, kv_heads, head_dim, generator=generator).to(dtype)
        values = torch.randn(length, kv_heads, head_dim, generator=generator).to(dtype)
        cache.write(0, keys.to(DEVICE), values.to(DEVICE), torch.tensor(slots, device=DEVICE))
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)
    query = torch.randn(starts[-1], heads, head_dim, generator=generator).to(dtype)
    return Batch(
        query=query.to(DEVICE),
        cache=cache,
        block_table=torch.tensor(rows, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
        query_starts=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seqs=seqs,
    )


def reference_attention(batch: Batch, scale: float) -> torch.Tensor:
    """Float32 causal attention per sequence over the cache's dequantized K/V."""
    heads = batch.query.shape[1]
    outputs = []
    for index, (done, new) in enumerate(batch.seqs):
        length = done + new
        keys, values = batch.cache.gather(0, batch.block_table[index].long())
        group = heads // keys.shape[0]
        keys = keys[:, :length].float().repeat_interleave(group, dim=0)
        values = values[:, :length].float().repeat_interleave(group, dim=0)
        start = int(batch.query_starts[index])
        query = batch.query[start : start + new].float()
        scores = torch.einsum("thd,hkd->htk", query, keys) * scale
        visible = (
            torch.arange(length, device=DEVICE) <= done + torch.arange(new, device=DEVICE)[:, None]
        )
        scores = scores.masked_fill(~visible, float("-inf"))
        outputs.append(torch.einsum("htk,hkd->thd", scores.softmax(-1), values))
    return torch.cat(outputs)


def run_triton(batch: Batch, scale: float, one_query: bool = False, splits: int = 1):
    key, value = batch.cache.layer(0)
    key_scale, value_scale = batch.cache.layer_scales(0)
    out = torch.full_like(batch.query, float("nan"))
    max_new = max(new for _, new in batch.seqs)
    return unified_attention(
        out,
        batch.query,
        key,
        value,
        batch.block_table,
        batch.seq_lens,
        scale,
        query_starts=None if one_query else batch.query_starts,
        max_query_len=max_new,
        key_scale=key_scale,
        value_scale=value_scale,
        num_splits=splits,
    )


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("layout", HEAD_LAYOUTS, ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
@pytest.mark.parametrize("block_size", [1, 16])
def test_mixed_batch_matches_reference(kv_dtype, layout, block_size):
    batch = make_batch(MIXED, layout, kv_dtype, block_size)
    scale = layout[2] ** -0.5
    expected = reference_attention(batch, scale)
    assert_matches(run_triton(batch, scale), expected, compute_dtype(kv_dtype))


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("block_size", [1, 16])
def test_decodes_split_over_the_context_match_reference(kv_dtype, splits, block_size):
    batch = make_batch(DECODES, (8, 2, 16), kv_dtype, block_size)
    expected = reference_attention(batch, 0.25)
    actual = run_triton(batch, 0.25, one_query=True, splits=splits)
    assert_matches(actual, expected, compute_dtype(kv_dtype))


def test_prefill_chunks_split_over_the_context_match_reference():
    batch = make_batch(MIXED, (6, 2, 24), "float32", 16)
    expected = reference_attention(batch, 0.2)
    assert_matches(run_triton(batch, 0.2, splits=2), expected, torch.float32)


def test_padded_sequences_of_length_zero_write_zeros():
    """A CUDA graph pads the batch with sequences of length 0: their rows come out 0 and
    the real rows are unaffected."""
    batch = make_batch(DECODES, (4, 2, 16), "float32", 16)
    expected = reference_attention(batch, 0.25)
    batch.seq_lens[1] = 0
    for splits in (1, 2):
        actual = run_triton(batch, 0.25, one_query=True, splits=splits)
        assert torch.equal(actual[1], torch.zeros_like(actual[1]))
        keep = [0, 2, 3]
        assert_matches(actual[keep], expected[keep], torch.float32)


def test_reused_workspace_gives_the_same_result():
    batch = make_batch(DECODES, (4, 2, 16), "float32", 16)
    workspace = SplitWorkspace.allocate(8, 4, 2, 16, DEVICE)
    key, value = batch.cache.layer(0)
    args = (key, value, batch.block_table, batch.seq_lens, 0.25)
    first = unified_attention(
        torch.empty_like(batch.query), batch.query, *args, num_splits=2, workspace=workspace
    )
    second = unified_attention(
        torch.empty_like(batch.query), batch.query, *args, num_splits=2, workspace=workspace
    )
    assert torch.equal(first, second)
    assert_matches(first, reference_attention(batch, 0.25), torch.float32)


def test_split_choice_fills_the_device_only_for_long_contexts():
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_context=8192, num_sms=132) == 16
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_context=64, num_sms=132) == 1
    assert choose_num_splits(num_seqs=256, num_kv_heads=8, max_context=8192, num_sms=132) == 1
    assert choose_num_splits(num_seqs=4, num_kv_heads=8, max_context=8192, num_sms=132) == 8
