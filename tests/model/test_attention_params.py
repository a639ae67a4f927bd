"""Per-layer attention parameters (sliding window, soft-cap, sinks) in the torch kernels,
against a dense reference: a plain softmax over a masked score matrix built here.

Each case writes a context into a paged cache with scrambled block tables, then attends
decode rows and prefill chunks behind a cached prefix. Blocks wholly before every query's
window are filled with NaN after the write: with sliding-window KV groups their table
entries may be a placeholder block whose contents mean nothing, so nothing may read them
into a result. The native backend, whose kernels take none of these parameters yet, must
defer and agree.
"""

from __future__ import annotations

import pytest
import torch

from engine.kv.accounting import KVShape
from engine.model.kernels.base import TorchKernels
from engine.model.kernels.metadata import SequenceChunk, build_metadata
from engine.model.kernels.native import NativeKernels, load_native_ops
from engine.model.kernels.params import AttentionParams
from engine.model.runtime.kv_cache import KVPool, KVPoolLayout, PagedKVCache
from engine.model.spec import ModelSpec
from tests.model.paged import BlockTables

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16
SCALE = HEAD_DIM**-0.5
SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0, 3.0, -0.5])
CASES = {
    "plain": AttentionParams(SCALE),
    "window": AttentionParams(SCALE, window=7),
    "window-1": AttentionParams(SCALE, window=1),
    "softcap": AttentionParams(SCALE, softcap=2.0),
    "sinks": AttentionParams(SCALE, sinks=SINKS),
    "all": AttentionParams(SCALE, window=9, softcap=3.0, sinks=SINKS),
}
SPEC = ModelSpec(
    model_type="llama",
    num_layers=1,
    hidden_size=HEADS * HEAD_DIM,
    num_heads=HEADS,
    num_kv_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    intermediate_size=64,
    vocab_size=100,
    rms_norm_eps=1e-6,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def reference_attention(
    qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int, p: AttentionParams
) -> torch.Tensor:
    """Rows of ``qkv`` at positions ``first_pos, first_pos + 1, ...`` attending to ``keys``
    / ``values`` ``[positions, kv_heads, head_dim]`` (every position up to the last row's),
    in float64: scores, soft-cap, the causal (and window) mask, softmax with the sinks."""
    rows = qkv.shape[0]
    group = HEADS // KV_HEADS
    q = qkv[:, : SPEC.q_size].view(rows, HEADS, HEAD_DIM).double()
    k = keys.double().repeat_interleave(group, dim=1)  # [positions, heads, d]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("rhd,khd->hrk", q, k) * p.scale
    if p.softcap is not None:
        scores = torch.tanh(scores / p.softcap) * p.softcap
    query_pos = torch.arange(first_pos, first_pos + rows)[:, None]
    key_pos = torch.arange(keys.shape[0])[None, :]
    visible = key_pos <= query_pos
    if p.window is not None:
        visible &= key_pos > query_pos - p.window
    scores = scores.masked_fill(~visible, float("-inf"))
    if p.sinks is not None:
        sink = p.sinks.double()[:, None, None].expand(-1, rows, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hrk,khd->rhd", probs, v).reshape(rows, -1).float()


class Context:
    """One sequence's keys and values written into a scrambled paged cache."""

    def __init__(self, length: int, block_size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        shape = KVShape(1, KV_HEADS, HEAD_DIM, "float32")
        pool = KVPool(KVPoolLayout(shape, 64, block_size), torch.device("cpu"))
        self.cache = PagedKVCache(pool, torch.float32)
        self.block_size = block_size
        self.blocks = BlockTables(64, seed=seed).allocate(length, block_size)
        self.keys = torch.randn(length, KV_HEADS, HEAD_DIM, generator=generator)
        self.values = torch.randn(length, KV_HEADS, HEAD_DIM, generator=generator)
        slots = [self.blocks[p // block_size] * block_size + p % block_size for p in range(length)]
        self.cache.write(0, self.keys, self.values, torch.tensor(slots))

    def poison_before(self, position: int) -> None:
        """NaN into every block that holds only positions before ``position``."""
        for index in range(max(0, position) // self.block_size):
            block = self.blocks[index]
            self.cache.pool.key[0, :, block] = float("nan")
            self.cache.pool.value[0, :, block] = float("nan")

    def qkv(self, first: int, last: int, seed: int) -> torch.Tensor:
        """Rows for positions ``[first, last)``: random queries, the context's own K/V."""
        queries = torch.randn(
            last - first, SPEC.q_size, generator=torch.Generator().manual_seed(seed)
        )
        kv = torch.cat([self.keys[first:last], self.values[first:last]], dim=1).flatten(1)
        return torch.cat([queries, kv], dim=1)


def window_start(position: int, params: AttentionParams) -> int:
    return 0 if params.window is None else position - params.window + 1


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [4, 5])
def test_decode_attention_matches_the_dense_reference(case, block_size):
    params = CASES[case]
    contexts = [Context(n, block_size, seed=n) for n in (3, 12, 29)]
    rows = [c.qkv(len(c.keys) - 1, len(c.keys), seed=i) for i, c in enumerate(contexts)]
    expected = torch.cat(
        [
            reference_attention(r, c.keys, c.values, len(c.keys) - 1, params)
            for r, c in zip(rows, contexts, strict=True)
        ]
    )
    # One batch over one cache: the three sequences' blocks side by side in one pool.
    cache, chunks = shared_cache(contexts, block_size)
    for context, chunk in zip(contexts, chunks, strict=True):
        poison(cache, chunk.block_ids, window_start(len(context.keys) - 1, params), block_size)
    meta = build_metadata(chunks, block_size, torch.device("cpu"))
    actual = TorchKernels().decode_attention(cache, 0, torch.cat(rows), meta, SPEC, params)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("computed", [0, 5, 20])
def test_prefill_attention_matches_the_dense_reference(case, computed):
    params, block_size, new = CASES[case], 4, 11
    context = Context(computed + new, block_size, seed=computed)
    qkv = context.qkv(computed, computed + new, seed=1)
    expected = reference_attention(qkv, context.keys, context.values, computed, params)
    context.poison_before(window_start(computed, params))
    chunk = SequenceChunk(computed, new, context.blocks)
    meta = build_metadata([chunk], block_size, torch.device("cpu"))
    actual = TorchKernels().prefill_attention(context.cache, 0, qkv, meta, SPEC, params)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(not load_native_ops(), reason="needs the native kernels")
@pytest.mark.parametrize("case", list(CASES))
def test_the_native_backend_defers_what_its_kernels_lack(case):
    params, block_size = CASES[case], 4
    contexts = [Context(n, block_size, seed=n) for n in (6, 30)]
    cache, chunks = shared_cache(contexts, block_size)
    meta = build_metadata(chunks, block_size, torch.device("cpu"))
    qkv = torch.cat([c.qkv(len(c.keys) - 1, len(c.keys), seed=7) for c in contexts])
    expected = TorchKernels().decode_attention(cache, 0, qkv, meta, SPEC, params)
    actual = NativeKernels().decode_attention(cache, 0, qkv, meta, SPEC, params)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    prefill = build_metadata([SequenceChunk(20, 10, chunks[1].block_ids)], 4, torch.device("cpu"))
    rows = contexts[1].qkv(20, 30, seed=8)
    expected = TorchKernels().prefill_attention(cache, 0, rows, prefill, SPEC, params)
    actual = NativeKernels().prefill_attention(cache, 0, rows, prefill, SPEC, params)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_a_window_longer_than_every_context_is_plain_attention():
    assert AttentionParams(SCALE, window=32).is_plain_within(32)
    assert not AttentionParams(SCALE, window=32).is_plain_within(33)
    assert not AttentionParams(SCALE, softcap=5.0).is_plain_within(1)
    assert not AttentionParams(SCALE, sinks=SINKS).is_plain_within(1)
    assert AttentionParams(SCALE).is_plain


def shared_cache(
    contexts: list[Context], block_size: int
) -> tuple[PagedKVCache, list[SequenceChunk]]:
    """The contexts copied into one pool (their blocks renumbered side by side), and a
    decode chunk for each (its last position is the new token)."""
    shape = KVShape(1, KV_HEADS, HEAD_DIM, "float32")
    total = sum(len(c.blocks) for c in contexts)
    pool = KVPool(KVPoolLayout(shape, total, block_size), torch.device("cpu"))
    cache = PagedKVCache(pool, torch.float32)
    order = torch.randperm(total, generator=torch.Generator().manual_seed(block_size)).tolist()
    chunks = []
    for context in contexts:
        ids, order = order[: len(context.blocks)], order[len(context.blocks) :]
        for source, target in zip(context.blocks, ids, strict=True):
            pool.key[0, :, target] = context.cache.pool.key[0, :, source]
            pool.value[0, :, target] = context.cache.pool.value[0, :, source]
        chunks.append(SequenceChunk(len(context.keys) - 1, 1, ids))
    return cache, chunks


def poison(cache: PagedKVCache, block_ids: list[int], position: int, block_size: int) -> None:
    for index in range(max(0, position) // block_size):
        cache.pool.key[0, :, block_ids[index]] = float("nan")
        cache.pool.value[0, :, block_ids[index]] = float("nan")
