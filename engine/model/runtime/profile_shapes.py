"""The steps whose activation peaks the memory profile must cover.

A step of ``max_num_batched_tokens`` fresh prompt tokens is not always the worst: a prefill
chunk, or a prompt whose prefix was found in the cache, attends to a context up to
``max_model_len`` long while holding only its new tokens' activations, and a backend that
gathers that context before attending (the torch one; the native one for fp8 caches)
holds a copy of it and a score matrix as wide. The profile runs three shapes: fresh
prefills, a chunk behind a long cached prefix starting inside a block, and a prefix hit
(a block-aligned cached prefix). ``context_attention_bytes`` bounds what the cached
context adds, for the CPU, where the profile computes that part rather than measures it.
"""

from __future__ import annotations

from engine.kv.accounting import KVShape, blocks_for_tokens, bytes_per_block
from engine.model.kernels.metadata import SequenceChunk
from engine.model.spec import ModelSpec

# Bytes of the scores and probabilities (float32) per (head, query, key) when a backend
# materialises them, and of the boolean causal mask per (query, key).
_SCORE_BYTES = 2 * 4
_MASK_BYTES = 1


def fresh_chunks(total_tokens: int, max_len: int, block_size: int) -> list[SequenceChunk]:
    """Fresh prefills covering ``total_tokens``, none longer than ``max_len``."""
    return _fresh(total_tokens, max_len, block_size, first_block=0)


def chunked_chunks(total_tokens: int, max_len: int, block_size: int) -> list[SequenceChunk]:
    """A chunk of ``min(total_tokens, max_len - 1)`` tokens behind a cached prefix that
    brings its context to ``max_len`` (a block-unaligned start unless the numbers fall
    so), then fresh prefills for the rest of the budget. Empty when ``max_len < 2``."""
    if max_len < 2:
        return []
    new = min(total_tokens, max_len - 1)
    return _behind_prefix(max_len - new, new, total_tokens, max_len, block_size)


def prefix_hit_chunks(total_tokens: int, max_len: int, block_size: int) -> list[SequenceChunk]:
    """A prompt whose longest block-aligned prefix that leaves room for its new tokens
    (at least one block) was a cache hit, then fresh prefills for the rest of the budget.
    Empty when ``max_len`` leaves no room for a cached block and a new token."""
    if max_len <= block_size:
        return []
    new = min(total_tokens, max_len - block_size)
    cached = (max_len - new) // block_size * block_size
    return _behind_prefix(cached, new, total_tokens, max_len, block_size)


def context_attention_bytes(
    spec: ModelSpec, kernels: str, kv_dtype: str, new: int, context: int, element: int
) -> int:
    """Bytes, beyond a fresh chunk's, that attending ``new`` query tokens to ``context``
    keys needs in one layer with the ``kernels`` backend (compute dtype ``element`` bytes
    wide). 0 for kernels that read the block tables in place (triton; native, except
    for fp8 caches, which it hands to torch). For torch: the gathered K and V, the GQA
    expansion SDPA's math path makes of them, the causal mask and the float32 scores
    and probabilities: an upper bound, whichever SDPA path runs."""
    if kernels == "triton" or (kernels == "native" and kv_dtype != "fp8"):
        return 0
    gathered = 2 * spec.num_kv_heads * context * spec.head_dim * element
    expanded = 2 * spec.num_heads * context * spec.head_dim * element
    scores = spec.num_heads * new * context * _SCORE_BYTES
    return gathered + expanded + new * context * _MASK_BYTES + scores


def scratch_blocks(chunks: list[SequenceChunk]) -> int:
    """Blocks of the scratch pool a profile forward over ``chunks`` needs."""
    return sum(len(c.block_ids) for c in chunks)


def scratch_pool_bytes(kv_shape: KVShape, chunks: list[SequenceChunk], block_size: int) -> int:
    return scratch_blocks(chunks) * bytes_per_block(kv_shape, block_size)


def _behind_prefix(
    cached: int, new: int, total_tokens: int, max_len: int, block_size: int
) -> list[SequenceChunk]:
    count = blocks_for_tokens(cached + new, block_size)
    first = SequenceChunk(cached, new, list(range(count)))
    return [first, *_fresh(total_tokens - new, max_len, block_size, first_block=count)]


def _fresh(
    total_tokens: int, max_len: int, block_size: int, first_block: int
) -> list[SequenceChunk]:
    chunks: list[SequenceChunk] = []
    next_block = first_block
    remaining = total_tokens
    while remaining > 0:
        length = min(remaining, max_len)
        count = blocks_for_tokens(length, block_size)
        chunks.append(SequenceChunk(0, length, list(range(next_block, next_block + count))))
        next_block += count
        remaining -= length
    return chunks
