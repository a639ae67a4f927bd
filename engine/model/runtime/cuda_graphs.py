"""Decode steps from persistent buffers, replayed as CUDA graphs at padded batch sizes.

A decode step's inputs (token id, position, cache slot, context length and block-table
row of every request) are written into pinned host tensors and moved to their device
twins with non-blocking copies; the forward reads views of those twins, so its addresses
never change and the forward can be captured once per batch size of a ladder (1, 2, 4, 8,
16, 24, 32, 48, 64, ...) and replayed. The graph ends at the final hidden states: the
runner's LM head and sampling run after it, as for any step. A batch is padded up to the
next captured size: padding rows have slot -1 (the KV write skips them) and context
length 0 (attention reads nothing and returns zeros), so they touch no real block.

Without graphs (``--enforce-eager``, or off CUDA, where the tests run it under the Triton
interpreter) the same buffers feed an eager forward: one code path, two ways to launch.
Needs a backend whose attention reads the block table directly (``TritonKernels``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.model.kernels.metadata import AttentionMetadata
from engine.model.layers.decoder import DecoderModel
from engine.model.runtime.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

# Rows of the packed per-request inputs; each is a contiguous [max_batch] vector (the
# kernels index them densely).
_TOKEN, _POSITION, _SLOT, _CONTEXT = 0, 1, 2, 3
_NUM_FIELDS = 4


def batch_size_ladder(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every 8 to 32, every 16 to 64, every 32 to
    128, every 64 beyond; ``max_batch`` itself always last. Padding wastes < 1/3 of a step."""
    sizes = [1, 2, 4, 8]
    step_by_limit = ((32, 8), (64, 16), (128, 32))
    while sizes[-1] < max_batch:
        step = next((s for limit, s in step_by_limit if sizes[-1] < limit), 64)
        sizes.append(sizes[-1] + step)
    return [s for s in sizes if s < max_batch] + [max_batch]


def padded_size(batch: int, ladder: list[int]) -> int:
    """The smallest captured size that holds ``batch`` rows."""
    for size in ladder:
        if size >= batch:
            return size
    raise ValueError(f"a decode batch of {batch} exceeds the largest captured size {ladder[-1]}")


@dataclass(frozen=True)
class DecodeRow:
    """One request's decode token, as the runner hands it over."""

    token_id: int
    position: int  # tokens already in the cache: the new token's position
    block_ids: list[int]


class StepInputs:
    """A decode step's inputs, pinned on the host (on CUDA) and persistent on the device:
    ``fields`` ``[4, max_batch]`` (token id, position, slot, context length) and
    ``block_table`` ``[max_batch, max_blocks]``, int64."""

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, device: torch.device):
        pin = device.type == "cuda"
        self.host_fields = torch.zeros(_NUM_FIELDS, max_batch, dtype=torch.long, pin_memory=pin)
        self.host_table = torch.zeros(max_batch, max_blocks, dtype=torch.long, pin_memory=pin)
        self.fields = torch.zeros_like(self.host_fields, device=device)
        self.block_table = torch.zeros_like(self.host_table, device=device)
        self.block_size = block_size

    def stage(self, rows: list[DecodeRow], padded: int) -> None:
        """Write ``rows`` and ``padded - len(rows)`` padding rows on the host, then start
        the copies to the device. The host buffers are rewritten only after the previous
        step's sampled ids were read back (the step's one sync), so those copies landed."""
        fields, table = self.host_fields.numpy(), self.host_table.numpy()
        size = self.block_size
        for index, row in enumerate(rows):
            blocks = row.block_ids[: row.position // size + 1]
            fields[:, index] = (
                row.token_id,
                row.position,
                blocks[-1] * size + row.position % size,
                row.position + 1,
            )
            table[index, : len(blocks)] = blocks
        fields[:, len(rows) : padded] = 0
        fields[_SLOT, len(rows) : padded] = -1
        self.fields.copy_(self.host_fields, non_blocking=True)
        self.block_table[:padded].copy_(self.host_table[:padded], non_blocking=True)

    def metadata(self, batch: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """Token ids and attention metadata over the first ``batch`` rows (device views)."""
        meta = AttentionMetadata(
            slots=self.fields[_SLOT, :batch],
            positions=self.fields[_POSITION, :batch],
            num_decodes=batch,
            decode_block_table=self.block_table[:batch],
            decode_context_lens=self.fields[_CONTEXT, :batch],
            prefills=[],
            prefill_tables=None,
        )
        return self.fields[_TOKEN, :batch], meta


class DecodeGraphs:
    """Decode steps of up to ``max_batch`` requests through persistent buffers, as CUDA
    graphs (``use_graphs``) or eagerly. ``capture`` must run after the KV pool exists and
    before serving; ``hidden`` (or ``logits``) then runs a step."""

    def __init__(
        self,
        model: DecoderModel,
        cache: PagedKVCache,
        max_batch: int,
        max_model_len: int,
        use_graphs: bool,
    ):
        self.model = model
        self.cache = cache
        self.ladder = batch_size_ladder(max_batch)
        max_blocks = -(-max_model_len // cache.block_size)
        self.inputs = StepInputs(max_batch, max_blocks, cache.block_size, model.device)
        # A mixture of experts reads its expert counts on the host: such steps run eagerly.
        self.use_graphs = use_graphs and model.device.type == "cuda" and not model.syncs_on_host
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_bytes = 0

    def capture(self) -> int:
        """Capture one graph per ladder size (largest first, sharing one memory pool);
        returns the device bytes the graphs hold, which the capacity plan counts."""
        if not self.use_graphs:
            return 0
        device = self.model.device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.ladder):
            self._graphs[size] = self._capture_one(size, pool)
        torch.cuda.synchronize(device)
        self.capture_bytes = torch.cuda.memory_reserved(device) - before
        return self.capture_bytes

    def _capture_one(
        self, size: int, pool: _POOL_HANDLE
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.inputs.stage([], size)  # padding only: writes nothing, reads nothing
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            self._forward(size)  # warm-up: Triton compiles, cuBLAS picks its kernels
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = self._forward(size)
        return graph, hidden

    def _forward(self, batch: int) -> torch.Tensor:
        token_ids, meta = self.inputs.metadata(batch)
        return self.model.forward(token_ids, meta, self.cache)

    def hidden(self, rows: list[DecodeRow]) -> torch.Tensor:
        """Final hidden states ``[len(rows), hidden]`` of one decode step (a view of the
        graph's output buffer when replayed: use it before the next step)."""
        padded = padded_size(len(rows), self.ladder)
        self.inputs.stage(rows, padded)
        captured = self._graphs.get(padded)
        if captured is None:
            return self._forward(padded)[: len(rows)]
        graph, hidden = captured
        graph.replay()
        return hidden[: len(rows)]

    def logits(self, rows: list[DecodeRow]) -> torch.Tensor:
        """Float32 logits ``[len(rows), vocab]`` of one decode step."""
        return self.model.logits(self.hidden(rows))
