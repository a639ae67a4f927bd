"""Test helper: run kvserve's paged decoder directly, with block tables built by hand."""

from __future__ import annotations

import torch

from engine.kv.accounting import KVShape
from engine.model.kernels.metadata import SequenceChunk, build_metadata
from engine.model.layers.decoder import DecoderModel
from engine.model.runtime.kv_cache import KVPool, KVPoolLayout, PagedKVCache


def make_cache(
    model: DecoderModel, num_blocks: int, block_size: int, kv_dtype: str = "float32"
) -> PagedKVCache:
    spec = model.spec
    shape = KVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, kv_dtype)
    pool = KVPool(KVPoolLayout(shape, num_blocks, block_size), model.device)
    return PagedKVCache(pool, model.dtype)


class BlockTables:
    """Hands out blocks in a scrambled order so tables are never contiguous by accident."""

    def __init__(self, num_blocks: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=generator).tolist()

    def allocate(self, num_tokens: int, block_size: int) -> list[int]:
        count = -(-num_tokens // block_size)
        taken, self.free = self.free[:count], self.free[count:]
        return taken


def run_step(
    model: DecoderModel,
    cache: PagedKVCache,
    token_ids: list[list[int]],
    computed: list[int],
    tables: list[list[int]],
) -> torch.Tensor:
    """One forward over several requests' new tokens (decodes must come first); returns
    the logits of every new token, concatenated in order."""
    chunks = [
        SequenceChunk(num_computed=c, num_new=len(t), block_ids=b)
        for t, c, b in zip(token_ids, computed, tables, strict=True)
    ]
    meta = build_metadata(chunks, cache.block_size, model.device)
    flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long)
    hidden = model.forward(flat, meta, cache)
    return model.logits(hidden)
