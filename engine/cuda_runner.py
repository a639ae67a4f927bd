"""The CUDA runner: every step's inputs from pinned staging, decodes as CUDA graphs.

``CudaModelRunner`` is a ``ModelRunner`` for the Triton backend. All-decode steps (every
request one new token, no speculative draft) go through ``DecodeGraphs``
(engine/model/runtime/cuda_graphs.py): inputs staged in pinned host memory, copied to persistent
device buffers without blocking, the forward replayed as the CUDA graph of the next padded
batch size (or run eagerly on the same buffers with ``--enforce-eager``). Every other step
(prefill chunks, prefix hits, mixed batches, speculative verifications, decode batches
larger than captured) is staged by ``StepMetadataBuilder`` (engine/model/runtime/cuda_metadata.py)
the same way and runs eagerly with one attention launch per layer; the rows whose logits
are sampled are gathered through the same staged buffer. Neither path waits for the
device: the step's host sync is the sampler reading the sampled ids back.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.kv.accounting import KVShape, format_bytes
from engine.model.layers.decoder import DecoderModel
from engine.model.runtime.cuda_graphs import DecodeGraphs, DecodeRow, batch_size_ladder
from engine.model.runtime.cuda_metadata import StagedStep, StepMetadataBuilder
from engine.model.runtime.kv_cache import KVPool, KVPoolLayout, PagedKVCache
from engine.outputs import ScheduledRequest
from engine.runner import ModelRunner, chunks, logits_rows

logger = logging.getLogger("kvserve.engine")
# Largest decode batch captured as a graph; bigger steps run eagerly (and are long
# enough that launch overhead matters little).
MAX_CAPTURED_BATCH = 256


def uses_decode_graphs(model: DecoderModel) -> bool:
    """Whether the model can run decode steps from persistent buffers: its attention must
    read the block tables directly and mask by length (the Triton backend's does)."""
    return model.kernels.name == "triton"


class CudaModelRunner(ModelRunner):
    """``ModelRunner`` whose steps are staged without blocking (the Triton backend; with
    other kernels it is ``ModelRunner``) and whose decode steps can be CUDA graphs."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.decode_graphs: DecodeGraphs | None = None
        self.step_metadata: StepMetadataBuilder | None = None
        # A hybrid model's KV groups read a block table each: its steps run eagerly
        # through ModelRunner's metadata (one table per group), without staged buffers.
        if uses_decode_graphs(self.model) and self.num_groups == 1:
            self.step_metadata = StepMetadataBuilder(self.block_size, self.model.device)
        # The staged step of the batch being executed, for ``_sample_logits``.
        self._staged: tuple[list[ScheduledRequest], StagedStep] | None = None

    def start_decode_graphs(self, max_num_seqs: int, max_model_len: int, eager: bool) -> int:
        """Allocate the step buffers and, unless ``eager``, capture the graphs (the KV pool
        must exist). Returns the bytes the graphs hold (0 for a hybrid model: eager)."""
        if self.step_metadata is None:
            return 0
        max_batch = min(max_num_seqs, MAX_CAPTURED_BATCH)
        graphs = DecodeGraphs(self.model, self.cache, max_batch, max_model_len, not eager)
        captured = graphs.capture()
        self.decode_graphs = graphs
        return captured

    def _hidden(self, batch: list[ScheduledRequest]) -> torch.Tensor:
        self._staged = None
        graphs = self.decode_graphs
        if graphs is not None and _plain_decodes(batch) and len(batch) <= graphs.ladder[-1]:
            rows = [DecodeRow(r.token_ids[0], r.num_computed_tokens, r.block_ids) for r in batch]
            return graphs.hidden(rows)
        if self.step_metadata is None:
            return super()._hidden(batch)
        step_chunks = [chunk for r in batch for chunk in chunks(r)]
        flat_ids = [t for r in batch for t in r.token_ids]
        step = self.step_metadata.build(step_chunks, flat_ids, logits_rows(batch))
        self._staged = (batch, step)
        return self.model.forward(step.token_ids, step.meta, self.cache)

    def _sample_logits(self, batch: list[ScheduledRequest], hidden: torch.Tensor) -> torch.Tensor:
        """``ModelRunner``'s rows, gathered through the staged index (no blocking copy)."""
        staged, self._staged = self._staged, None
        if staged is None or staged[0] is not batch:
            return super()._sample_logits(batch, hidden)
        rows = staged[1].logits_rows
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        if not hidden.shape[0]:
            return hidden.new_empty(0, self.model.spec.vocab_size, dtype=torch.float32)
        return self.model.logits(hidden)


def _plain_decodes(batch: list[ScheduledRequest]) -> bool:
    return all(
        r.num_new_tokens == 1
        and r.num_computed_tokens > 0
        and not r.num_draft_tokens
        and r.lora is None  # the graphs hold no adapter rows: a LoRA step runs eagerly
        for r in batch
    )


def decode_graph_reserve(
    model: DecoderModel, kv_shape: KVShape, block_size: int, max_num_seqs: int, max_model_len: int
) -> int:
    """Device bytes the decode graphs will hold, measured by capturing them once against a
    one-block scratch pool (graph capture reads no block: every row is padding), so the
    capacity plan can count them before the real pool is sized. 0 off CUDA."""
    if model.device.type != "cuda" or not uses_decode_graphs(model) or kv_shape.is_hybrid:
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
