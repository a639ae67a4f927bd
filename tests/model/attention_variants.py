"""Test helper: paged attention problems for the attention variants (sliding window, logit
soft-capping, sinks) and their dense reference.

A problem is a batch of sequences over one layer's paged cache, laid out as the kernels
read it ([kv_heads, blocks, block_size, head_dim], int8/fp8 caches with per-token
scales). Every slot no sequence owns holds NaN (int8: a NaN scale), and the table entries
of blocks wholly before a sequence's window name one shared placeholder block (the KV
manager frees those blocks), so a kernel that read anything it must not would return NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NULL_BLOCK = 0  # the placeholder id in tables, a block of NaN
CACHE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8": torch.uint8,  # float8_e4m3fn bits
}


def window_start(position: int, window: int) -> int:
    """The first key a query at ``position`` sees (0 without a window)."""
    return max(0, position + 1 - window) if window else 0


@dataclass
class PagedProblem:
    seqs: list[tuple[int, int]]  # (tokens cached before, new tokens) per sequence
    query: torch.Tensor  # [tokens, heads, head_dim], the model's dtype
    key_cache: torch.Tensor  # [kv_heads, blocks, block_size, head_dim]
    value_cache: torch.Tensor
    key_scale: torch.Tensor | None  # [kv_heads, blocks, block_size] for int8/fp8 caches
    value_scale: torch.Tensor | None
    block_table: torch.Tensor  # [seqs, blocks per longest sequence], int64
    keys: list[torch.Tensor]  # per sequence [kv_heads, length, head_dim] float64, 0 if unread
    values: list[torch.Tensor]

    @property
    def lengths(self) -> list[int]:
        return [done + new for done, new in self.seqs]

    @property
    def query_starts(self) -> list[int]:
        starts = [0]
        for _, new in self.seqs:
            starts.append(starts[-1] + new)
        return starts


def _store(rows: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows as the cache stores them, with per-row scales for a quantized cache."""
    if kv_dtype == "int8":
        scales = rows.abs().amax(-1).clamp(min=1e-6) / 127
        return (rows / scales[..., None]).round().to(torch.int8), scales
    if kv_dtype == "fp8":
        scales = rows.abs().amax(-1).clamp(min=1e-6) / 448
        codes = (rows / scales[..., None]).to(torch.float8_e4m3fn)
        return codes.view(torch.uint8), scales
    return rows.to(CACHE_DTYPES[kv_dtype]), None


def _read(stored: torch.Tensor, scales: torch.Tensor | None, kv_dtype: str) -> torch.Tensor:
    """Stored rows as float64, the way the kernels read them."""
    if kv_dtype == "fp8":
        stored = stored.view(torch.float8_e4m3fn)
    rows = stored.double()
    return rows * scales.double()[..., None] if scales is not None else rows


def make_problem(
    seqs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    kv_dtype: str,
    model_dtype: torch.dtype,
    window: int,
    seed: int = 0,
) -> PagedProblem:
    """Random queries and K/V for ``seqs``. Only the blocks from each sequence's first
    query's window on are real; the table names the placeholder before them and past the
    sequence's end."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [done + new for done, new in seqs]
    per_seq = [-(-length // block_size) for length in lengths]
    num_blocks = 1 + sum(per_seq)
    shape = (kv_heads, num_blocks, block_size, head_dim)
    quantized = kv_dtype in ("int8", "fp8")
    if kv_dtype == "int8":
        key_cache = torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator)
        value_cache = torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator)
    elif kv_dtype == "fp8":
        key_cache = torch.full(shape, 0x7F, dtype=torch.uint8)  # e4m3fn's NaN
        value_cache = key_cache.clone()
    else:
        key_cache = torch.full(shape, float("nan"), dtype=CACHE_DTYPES[kv_dtype])
        value_cache = key_cache.clone()
    key_scale = torch.full(shape[:3], float("nan")) if quantized else None
    value_scale = key_scale.clone() if key_scale is not None else None
    order = (1 + torch.randperm(num_blocks - 1, generator=generator)).tolist()  # scattered
    width = max(per_seq)
    table = torch.full((len(seqs), width), NULL_BLOCK, dtype=torch.long)
    keys, values = [], []
    for index, ((done, _), length, count) in enumerate(zip(seqs, lengths, per_seq, strict=True)):
        blocks, order = order[:count], order[count:]
        first_block = window_start(done, window) // block_size
        table[index, first_block:count] = torch.tensor(blocks[first_block:], dtype=torch.long)
        first = first_block * block_size
        k_rows = torch.randn(kv_heads, length - first, head_dim, generator=generator)
        v_rows = torch.randn(kv_heads, length - first, head_dim, generator=generator)
        k_stored, k_scales = _store(k_rows, kv_dtype)
        v_stored, v_scales = _store(v_rows, kv_dtype)
        k_read = torch.zeros(kv_heads, length, head_dim, dtype=torch.float64)
        v_read = torch.zeros_like(k_read)
        k_read[:, first:] = _read(k_stored, k_scales, kv_dtype)
        v_read[:, first:] = _read(v_stored, v_scales, kv_dtype)
        keys.append(k_read)
        values.append(v_read)
        positions = torch.arange(first, length)
        slot_blocks, slot_rows = table[index, positions // block_size], positions % block_size
        key_cache[:, slot_blocks, slot_rows] = k_stored
        value_cache[:, slot_blocks, slot_rows] = v_stored
        if key_scale is not None and value_scale is not None:
            key_scale[:, slot_blocks, slot_rows] = k_scales
            value_scale[:, slot_blocks, slot_rows] = v_scales
    tokens = sum(new for _, new in seqs)
    query = (torch.randn(tokens, heads, head_dim, generator=generator) * 2).to(model_dtype)
    return PagedProblem(
        seqs, query, key_cache, value_cache, key_scale, value_scale, table, keys, values
    )


def reference_attention(
    problem: PagedProblem,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense float64 attention, [tokens, heads, head_dim]: scaled scores, soft cap, causal
    and window mask, softmax with a sink column that is then dropped, values."""
    heads = problem.query.shape[1]
    outputs = []
    starts = problem.query_starts
    for index, (done, new) in enumerate(problem.seqs):
        length = done + new
        group = heads // problem.keys[index].shape[0]
        keys = problem.keys[index].repeat_interleave(group, dim=0)
        values = problem.values[index].repeat_interleave(group, dim=0)
        query = problem.query[starts[index] : starts[index + 1]].double()
        scores = torch.einsum("thd,hkd->htk", query, keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        key_positions = torch.arange(length)
        query_positions = done + torch.arange(new)[:, None]
        visible = key_positions <= query_positions
        if window:
            visible &= key_positions > query_positions - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink_column = sinks.double()[:, None, None].expand(heads, new, 1)
            probs = torch.cat([scores, sink_column], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outputs.append(torch.einsum("htk,hkd->thd", probs, values))
    return torch.cat(outputs)
