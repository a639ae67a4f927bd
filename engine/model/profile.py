"""Measure the activation peak of the largest step the scheduler may build.

One forward of ``max_num_batched_tokens`` prompt tokens (split into sequences of at most
``max_model_len``, all sampled) runs against a scratch KV pool just big enough for it.
On CUDA the peak is read from the allocator; on the CPU from the process's peak resident
set (VmHWM), which the kernel lets us reset first through /proc/self/clear_refs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.config import EngineArgs
from engine.kv.accounting import KVShape, blocks_for_tokens
from engine.model.attention import SequenceChunk, build_metadata
from engine.model.kv_cache import KVPool, KVPoolLayout, PagedKVCache
from engine.model.llama import LlamaModel

logger = logging.getLogger(__name__)


def profile_chunks(total_tokens: int, max_len: int, block_size: int) -> list[SequenceChunk]:
    """Fresh prefills covering ``total_tokens``, none longer than ``max_len``."""
    chunks: list[SequenceChunk] = []
    next_block = 0
    remaining = total_tokens
    while remaining > 0:
        length = min(remaining, max_len)
        count = blocks_for_tokens(length, block_size)
        chunks.append(SequenceChunk(0, length, list(range(next_block, next_block + count))))
        next_block += count
        remaining -= length
    return chunks


def run_profile_forward(
    model: LlamaModel, kv_shape: KVShape, total_tokens: int, max_len: int, block_size: int
) -> None:
    chunks = profile_chunks(total_tokens, max_len, block_size)
    num_blocks = sum(len(c.block_ids) for c in chunks)
    pool = KVPool(KVPoolLayout(kv_shape, num_blocks, block_size), model.device)
    cache = PagedKVCache(pool, model.dtype)
    meta = build_metadata(chunks, block_size, model.dtype, model.device)
    token_ids = torch.zeros(total_tokens, dtype=torch.long, device=model.device)
    hidden = model.forward(token_ids, meta, cache)
    model.logits(hidden[: len(chunks)])


def measure_activation_peak(
    model: LlamaModel, kv_shape: KVShape, args: EngineArgs, max_model_len: int
) -> int:
    """Bytes the largest step needs beyond weights and KV pool."""
    tokens = args.max_num_batched_tokens
    if model.device.type == "cuda":
        return _cuda_peak(model, kv_shape, tokens, max_model_len, args.block_size)
    return _cpu_peak(model, kv_shape, tokens, max_model_len, args.block_size)


def _cuda_peak(
    model: LlamaModel, kv_shape: KVShape, tokens: int, max_len: int, block_size: int
) -> int:
    torch.cuda.synchronize(model.device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(model.device)
    baseline = torch.cuda.memory_allocated(model.device)
    run_profile_forward(model, kv_shape, tokens, max_len, block_size)
    torch.cuda.synchronize(model.device)
    peak = torch.cuda.max_memory_allocated(model.device) - baseline
    scratch_kv = _scratch_pool_bytes(kv_shape, tokens, max_len, block_size)
    torch.cuda.empty_cache()
    return max(0, peak - scratch_kv)


def _cpu_peak(
    model: LlamaModel, kv_shape: KVShape, tokens: int, max_len: int, block_size: int
) -> int:
    if not _reset_peak_rss():
        estimate = _estimate_cpu_activation(model, tokens)
        logger.warning("cannot reset peak RSS; using an activation estimate of %d bytes", estimate)
        run_profile_forward(model, kv_shape, tokens, max_len, block_size)
        return estimate
    baseline = _read_status_kib("VmRSS")
    run_profile_forward(model, kv_shape, tokens, max_len, block_size)
    peak = (_read_status_kib("VmHWM") - baseline) * 1024
    scratch_kv = _scratch_pool_bytes(kv_shape, tokens, max_len, block_size)
    # The allocator may reuse memory freed earlier, hiding part of the peak from RSS:
    # never plan below a conservative estimate of the live tensors.
    return max(peak - scratch_kv, _estimate_cpu_activation(model, tokens))


def _scratch_pool_bytes(kv_shape: KVShape, tokens: int, max_len: int, block_size: int) -> int:
    chunks = profile_chunks(tokens, max_len, block_size)
    from engine.kv.accounting import bytes_per_block

    return sum(len(c.block_ids) for c in chunks) * bytes_per_block(kv_shape, block_size)


def _estimate_cpu_activation(model: LlamaModel, tokens: int) -> int:
    """A lower bound: a few live [tokens, widest projection] tensors in the model dtype."""
    spec = model.spec
    widest = max(2 * spec.intermediate_size, spec.q_size + 2 * spec.kv_size, spec.hidden_size)
    element = torch.finfo(model.dtype).bits // 8
    return 3 * tokens * widest * element


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _read_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")
