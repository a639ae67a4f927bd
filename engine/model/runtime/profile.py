"""Measure the activation peak of the largest steps the scheduler may build.

Three shapes (engine/model/runtime/profile_shapes.py), the largest peak counted: fresh prefills
of ``max_num_batched_tokens`` prompt tokens (split into sequences of at most
``max_model_len``), a prefill chunk behind a cached prefix that brings its context to
``max_model_len``, and a prefix-hit prefill (a block-aligned cached prefix). Each forward
runs against a scratch KV pool just big enough for it, whose bytes are taken off.

On CUDA every shape is measured with the allocator's peak. On the CPU the fresh shape is
measured from the process's peak resident set (VmHWM, reset first through
/proc/self/clear_refs) and the cached-context shapes are computed: their extra over the
fresh peak is bounded by ``context_attention_bytes`` (a forward over a long context on the
CPU would slow every start, and RSS cannot tell its peak from the allocator's reuse).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.config import EngineArgs
from engine.kv.accounting import KVShape
from engine.model.kernels.metadata import SequenceChunk, build_metadata
from engine.model.layers.decoder import DecoderModel
from engine.model.runtime.kv_cache import KVPool, KVPoolLayout, PagedKVCache
from engine.model.runtime.profile_shapes import (
    chunked_chunks,
    context_attention_bytes,
    fresh_chunks,
    prefix_hit_chunks,
    scratch_blocks,
    scratch_pool_bytes,
)

logger = logging.getLogger(__name__)


def profile_shapes(tokens: int, max_len: int, block_size: int) -> dict[str, list[SequenceChunk]]:
    """The profiled steps by name; a cached-context shape is left out when ``max_len``
    leaves it no room."""
    shapes = {
        "fresh": fresh_chunks(tokens, max_len, block_size),
        "chunked": chunked_chunks(tokens, max_len, block_size),
        "prefix-hit": prefix_hit_chunks(tokens, max_len, block_size),
    }
    return {name: chunks for name, chunks in shapes.items() if chunks}


def run_profile_forward(
    model: DecoderModel, kv_shape: KVShape, chunks: list[SequenceChunk], block_size: int
) -> None:
    """One forward over ``chunks`` (cached prefixes read from a zeroed scratch pool), and
    the logits of one row per chunk."""
    pool = KVPool(KVPoolLayout(kv_shape, scratch_blocks(chunks), block_size), model.device)
    cache = PagedKVCache(pool, model.dtype)
    meta = build_metadata(chunks, block_size, model.device)
    tokens = sum(c.num_new for c in chunks)
    token_ids = torch.zeros(tokens, dtype=torch.long, device=model.device)
    hidden = model.forward(token_ids, meta, cache)
    model.logits(hidden[: len(chunks)])


def measure_activation_peak(
    model: DecoderModel, kv_shape: KVShape, args: EngineArgs, max_model_len: int
) -> int:
    """Bytes the largest step needs beyond weights and KV pool."""
    peaks = activation_peaks(
        model, kv_shape, args.max_num_batched_tokens, max_model_len, args.block_size
    )
    largest = max(peaks, key=lambda name: peaks[name])
    logger.info("activation peaks by profiled step: %s; reserving the %s one", peaks, largest)
    return peaks[largest]


def activation_peaks(
    model: DecoderModel, kv_shape: KVShape, tokens: int, max_len: int, block_size: int
) -> dict[str, int]:
    """The activation peak of each profiled step, by ``profile_shapes`` name."""
    shapes = profile_shapes(tokens, max_len, block_size)
    if model.device.type == "cuda":
        return {name: _cuda_peak(model, kv_shape, c, block_size) for name, c in shapes.items()}
    return _cpu_peaks(model, kv_shape, shapes, block_size)


def _cuda_peak(
    model: DecoderModel, kv_shape: KVShape, chunks: list[SequenceChunk], block_size: int
) -> int:
    torch.cuda.synchronize(model.device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(model.device)
    baseline = torch.cuda.memory_allocated(model.device)
    run_profile_forward(model, kv_shape, chunks, block_size)
    torch.cuda.synchronize(model.device)
    peak = torch.cuda.max_memory_allocated(model.device) - baseline
    torch.cuda.empty_cache()
    return max(0, peak - scratch_pool_bytes(kv_shape, chunks, block_size))


def _cpu_peaks(
    model: DecoderModel,
    kv_shape: KVShape,
    shapes: dict[str, list[SequenceChunk]],
    block_size: int,
) -> dict[str, int]:
    """The fresh shape measured; each cached-context shape as the fresh peak plus what
    attending to its cached context adds (its new tokens are at most the fresh ones)."""
    fresh = _cpu_fresh_peak(model, kv_shape, shapes["fresh"], block_size)
    element = torch.finfo(model.dtype).bits // 8
    peaks = {"fresh": fresh}
    for name, chunks in shapes.items():
        if name != "fresh":
            first = chunks[0]  # the chunk behind the cached prefix
            context = len(first.block_ids) * block_size  # what a gather copies
            extra = context_attention_bytes(
                model.spec, model.kernels.name, kv_shape.kv_dtype, first.num_new, context, element
            )
            peaks[name] = fresh + extra
    return peaks


def _cpu_fresh_peak(
    model: DecoderModel, kv_shape: KVShape, chunks: list[SequenceChunk], block_size: int
) -> int:
    tokens = sum(c.num_new for c in chunks)
    if not _reset_peak_rss():
        estimate = _estimate_cpu_activation(model, tokens)
        logger.warning("cannot reset peak RSS; using an activation estimate of %d bytes", estimate)
        run_profile_forward(model, kv_shape, chunks, block_size)
        return estimate
    baseline = _read_status_kib("VmRSS")
    run_profile_forward(model, kv_shape, chunks, block_size)
    peak = (_read_status_kib("VmHWM") - baseline) * 1024
    scratch_kv = scratch_pool_bytes(kv_shape, chunks, block_size)
    # The allocator may reuse memory freed earlier, hiding part of the peak from RSS:
    # never plan below a conservative estimate of the live tensors.
    return max(peak - scratch_kv, _estimate_cpu_activation(model, tokens))


def _estimate_cpu_activation(model: DecoderModel, tokens: int) -> int:
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
