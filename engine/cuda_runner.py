"""The CUDA runner: decode steps through persistent buffers and CUDA graphs.

``CudaModelRunner`` is a ``ModelRunner`` whose all-decode steps (every request one new
token, no speculative draft) go through ``DecodeGraphs`` (engine/model/cuda_graphs.py):
the step's inputs are staged in pinned host memory and copied to persistent device
buffers without blocking, the forward is replayed as the CUDA graph of the next padded
batch size (or run eagerly on the same buffers with ``--enforce-eager``), and the only
host sync of the step is the sampler reading the sampled ids back. Steps with prefill
chunks, drafts, or more requests than were captured take ``ModelRunner``'s path.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.kv.accounting import KVShape, format_bytes
from engine.model.cuda_graphs import DecodeGraphs, DecodeRow, batch_size_ladder
from engine.model.kv_cache import KVPool, KVPoolLayout, PagedKVCache
from engine.model.llama import LlamaModel
from engine.outputs import ScheduledRequest
from engine.runner import ModelRunner

logger = logging.getLogger("kvserve.engine")
# Largest decode batch captured as a graph; bigger steps run eagerly (and are long
# enough that launch overhead matters little).
MAX_CAPTURED_BATCH = 256


def uses_decode_graphs(model: LlamaModel) -> bool:
    """Whether the model can run decode steps from persistent buffers: its attention must
    read the block tables directly and mask by length (the Triton backend's does)."""
    return model.kernels.name == "triton"


class CudaModelRunner(ModelRunner):
    """``ModelRunner`` plus decode steps from persistent buffers, as CUDA graphs."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.decode_graphs: DecodeGraphs | None = None

    def start_decode_graphs(self, max_num_seqs: int, max_model_len: int, eager: bool) -> int:
        """Allocate the step buffers and, unless ``eager``, capture the graphs (the KV pool
        must exist). Returns the bytes the graphs hold."""
        max_batch = min(max_num_seqs, MAX_CAPTURED_BATCH)
        graphs = DecodeGraphs(self.model, self.cache, max_batch, max_model_len, not eager)
        captured = graphs.capture()
        self.decode_graphs = graphs
        return captured

    def _hidden(self, batch: list[ScheduledRequest]) -> torch.Tensor:
        graphs = self.decode_graphs
        if graphs is None or not _plain_decodes(batch) or len(batch) > graphs.ladder[-1]:
            return super()._hidden(batch)
        rows = [DecodeRow(r.token_ids[0], r.num_computed_tokens, r.block_ids) for r in batch]
        return graphs.hidden(rows)


def _plain_decodes(batch: list[ScheduledRequest]) -> bool:
    return all(
        r.num_new_tokens == 1
        and r.num_computed_tokens > 0
        and not getattr(r, "num_draft_tokens", 0)
        for r in batch
    )


def decode_graph_reserve(
    model: LlamaModel, kv_shape: KVShape, block_size: int, max_num_seqs: int, max_model_len: int
) -> int:
    """Device bytes the decode graphs will hold, measured by capturing them once against a
    one-block scratch pool (graph capture reads no block: every row is padding), so the
    capacity plan can count them before the real pool is sized. 0 off CUDA."""
    if model.device.type != "cuda" or not uses_decode_graphs(model):
        return 0
    pool = KVPool(KVPoolLayout(kv_shape, 1, block_size), model.device)
    max_batch = min(max_num_seqs, MAX_CAPTURED_BATCH)
    graphs = DecodeGraphs(model, PagedKVCache(pool, model.dtype), max_batch, max_model_len, True)
    captured = graphs.capture()
    del graphs, pool
    torch.cuda.empty_cache()
    logger.info(
        "decode CUDA graphs (batch sizes %s): %s, counted in the activation reserve",
        batch_size_ladder(max_batch),
        format_bytes(captured),
    )
    return captured
