"""The CUDA backend: attention and the KV write in Triton, the rest in torch.

``TritonKernels`` keeps ``TorchKernels``' norms, rotary and activation (single eager ops
on a GPU) and replaces what the torch backend does worst there: decode attention no longer
gathers a padded copy of every request's context per layer, and prefill chunks are no
longer attended one request at a time behind a boolean mask. Both go through
``unified_attention``, which reads K/V (bf16/fp16/fp32, int8 or fp8 with their scales)
straight from the block tables. The kernels also run on the CPU under TRITON_INTERPRET=1,
which is how the CPU test suite checks this backend end to end.

``unified_attention`` takes each layer's window (each program starts at its first query's
window: blocks before it are never read), soft-cap and sinks.
"""

from __future__ import annotations

import torch

from engine.model.kernels.base import TorchKernels
from engine.model.kernels.metadata import AttentionMetadata
from engine.model.kernels.params import AttentionParams
from engine.model.kernels.triton.triton_attention import (
    choose_num_splits,
    interpreting,
    unified_attention,
)
from engine.model.kernels.triton.triton_kv_write import write_kv
from engine.model.runtime.kv_cache import PagedKVCache
from engine.model.spec import ModelSpec

# Streaming multiprocessors assumed when there is no GPU to ask (interpreter runs).
_SMS_WITHOUT_GPU = 8


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: CUDA, or the CPU interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


class TritonKernels(TorchKernels):
    """Triton attention and KV write (engine/model/kernels/triton/) over torch's elementwise ops."""

    name = "triton"

    def __init__(self, device: torch.device):
        if not triton_usable(device):
            raise ValueError(
                "--kernels triton runs on CUDA (or on the CPU under TRITON_INTERPRET=1, "
                f"for tests), not on {device.type}"
            )
        self.num_sms = _SMS_WITHOUT_GPU
        if device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count

    def write_kv(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        slots: torch.Tensor,
        spec: ModelSpec,
    ) -> None:
        key, value = cache.layer(layer)
        write_kv(qkv, slots, key, value, spec.num_heads, *cache.layer_scales(layer))

    def decode_attention(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        meta: AttentionMetadata,
        spec: ModelSpec,
        params: AttentionParams,
    ) -> torch.Tensor:
        assert meta.decode_block_table is not None and meta.decode_context_lens is not None
        rows = meta.num_decodes
        # The padded table's width bounds every context: a host-side number, no sync.
        longest = meta.decode_block_table.shape[1] * cache.block_size
        splits = choose_num_splits(rows, spec.num_kv_heads, longest, self.num_sms)
        return _attend(
            cache,
            layer,
            qkv[:rows],
            spec,
            meta.decode_block_table,
            meta.decode_context_lens,
            params,
            num_splits=splits,
        )

    def prefill_attention(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        meta: AttentionMetadata,
        spec: ModelSpec,
        params: AttentionParams,
    ) -> torch.Tensor:
        tables = meta.prefill_tables
        assert tables is not None
        starts = tables.query_starts
        seq_lens = tables.num_computed + (starts[1:] - starts[:-1])
        return _attend(
            cache,
            layer,
            qkv[meta.num_decodes :],
            spec,
            tables.block_table,
            seq_lens,
            params,
            query_starts=starts,
            max_query_len=max(span.end - span.start for span in meta.prefills),
        )

    def varlen_attention(
        self,
        cache: PagedKVCache,
        layer: int,
        qkv: torch.Tensor,
        meta: AttentionMetadata,
        spec: ModelSpec,
        params: AttentionParams,
    ) -> torch.Tensor:
        """The whole step in one launch. When every sequence has one row (decodes and
        drafts only) row ``i`` is sequence ``i``: the launch is ``decode_attention``'s,
        context splits included, so those rows come out as a decode step computes them."""
        tables = meta.varlen
        assert tables is not None
        one_row_each = tables.max_query_len == 1
        splits = 1  # prefill tiles already fill the device
        if one_row_each:
            longest = tables.block_table.shape[1] * cache.block_size
            splits = choose_num_splits(qkv.shape[0], spec.num_kv_heads, longest, self.num_sms)
        return _attend(
            cache,
            layer,
            qkv,
            spec,
            tables.block_table,
            tables.seq_lens,
            params,
            query_starts=None if one_row_each else tables.query_starts,
            max_query_len=tables.max_query_len,
            num_splits=splits,
        )


def _attend(
    cache: PagedKVCache,
    layer: int,
    qkv_rows: torch.Tensor,
    spec: ModelSpec,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    params: AttentionParams,
    query_starts: torch.Tensor | None = None,
    max_query_len: int = 1,
    num_splits: int = 1,
) -> torch.Tensor:
    """One ``unified_attention`` launch for the queries of ``qkv_rows`` against layer
    ``layer``'s cache (with its scales); returns ``[rows, q_size]``."""
    rows = qkv_rows.shape[0]
    out = qkv_rows.new_empty(rows, spec.num_heads, spec.head_dim)
    key, value = cache.layer(layer)
    key_scale, value_scale = cache.layer_scales(layer)
    window, softcap, sinks = params.kernel_args()
    unified_attention(
        out,
        _query_heads(qkv_rows, spec),
        key,
        value,
        block_table,
        seq_lens,
        params.scale,
        query_starts=query_starts,
        max_query_len=max_query_len,
        key_scale=key_scale,
        value_scale=value_scale,
        num_splits=num_splits,
        window=window,
        softcap=softcap,
        sinks=sinks,
    )
    return out.view(rows, spec.q_size)


def _query_heads(qkv: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """The query heads of qkv rows as a strided ``[rows, heads, head_dim]`` view (no copy)."""
    return qkv[:, : spec.q_size].unflatten(1, (spec.num_heads, spec.head_dim))
