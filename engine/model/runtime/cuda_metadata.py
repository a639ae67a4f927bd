"""Step metadata for the Triton backend, staged in pinned memory, copied without blocking.

``StepMetadataBuilder.build`` turns any step (decodes, speculative drafts as one-row
sequences, prefill chunks starting anywhere, prefix hits) into ``VarlenTables`` for one
attention launch per layer. Everything the step needs on the device (token ids,
positions, slots, sequence lengths, query offsets, the rows whose logits are wanted and
the block table) is packed into one int64 host buffer with numpy and moved by one
``non_blocking`` copy into a device buffer; the metadata are views of it. On CUDA the
host buffer is pinned (a pageable copy would wait for the stream), so building a step
never waits for the device: the step's only sync is the sampler reading its ids back.

Buffers grow on demand (doubling) and are reused. Two host buffers alternate, each
guarded by a CUDA event recorded after its copy: a step that samples nothing has no
sync, so the host could otherwise overwrite a buffer whose copy has not run yet. Off
CUDA (the CPU tests, under TRITON_INTERPRET) nothing is pinned and copies are plain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.model.kernels.metadata import AttentionMetadata, SequenceChunk, VarlenTables

_INITIAL_ELEMENTS = 1 << 12


@dataclass(frozen=True)
class StagedStep:
    """A step's device inputs: token ids, attention metadata, and the hidden rows whose
    logits the runner wants (``None``: every row, in order; possibly empty)."""

    token_ids: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor | None


@dataclass(frozen=True)
class _Layout:
    """Host-side shape of one step; offsets of each field in the flat buffer follow."""

    tokens: int
    seqs: int
    rows: int  # logits rows staged
    width: int  # block-table columns
    select: bool  # False: the logits of every row, in order (nothing staged, no gather)

    @property
    def numel(self) -> int:
        return 3 * self.tokens + 2 * self.seqs + 1 + self.rows + self.seqs * self.width


class _Staging:
    """One host buffer (pinned on CUDA) and the event guarding its last copy."""

    def __init__(self, numel: int, pin: bool):
        self.host = torch.empty(numel, dtype=torch.long, pin_memory=pin)
        self.copied: torch.cuda.Event | None = None

    def wait_for_copy(self) -> None:
        """Returns at once in steady state: the copy ran before the last sampler sync
        (``query`` asks without waiting; only a copy still queued is waited for)."""
        if self.copied is not None and not self.copied.query():
            self.copied.synchronize()


class StepMetadataBuilder:
    """Builds ``StagedStep``s on ``device`` for a cache of ``block_size``-token blocks."""

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device
        self.on_cuda = device.type == "cuda"
        self._staging = [_Staging(_INITIAL_ELEMENTS, self.on_cuda) for _ in range(2)]
        self._turn = 0
        self.device_buffer = torch.empty(_INITIAL_ELEMENTS, dtype=torch.long, device=device)

    def build(
        self, chunks: list[SequenceChunk], token_ids: list[int], logits_rows: list[int]
    ) -> StagedStep:
        """Stage ``chunks`` (in row order; ``token_ids`` flattened the same way) and the
        hidden rows to take logits from, start the copy, and return device views."""
        tokens = len(token_ids)
        select = logits_rows != list(range(tokens))
        rows = len(logits_rows) if select else 0
        layout = _Layout(tokens, len(chunks), rows, self._width(chunks), select)
        staging = self._next_staging(layout.numel)
        host = staging.host.numpy()[: layout.numel]
        max_query_len = _fill(host, layout, chunks, token_ids, logits_rows, self.block_size)
        device = self._device_view(layout.numel)
        device.copy_(staging.host[: layout.numel], non_blocking=True)
        if self.on_cuda:
            staging.copied = torch.cuda.Event()
            staging.copied.record()
        return _views(device, layout, max_query_len)

    def _width(self, chunks: list[SequenceChunk]) -> int:
        return max(-(-(c.num_computed + c.num_new) // self.block_size) for c in chunks)

    def _next_staging(self, numel: int) -> _Staging:
        self._turn ^= 1
        staging = self._staging[self._turn]
        staging.wait_for_copy()
        if staging.host.numel() < numel:
            staging = _Staging(_grown(staging.host.numel(), numel), self.on_cuda)
            self._staging[self._turn] = staging
        return staging

    def _device_view(self, numel: int) -> torch.Tensor:
        if self.device_buffer.numel() < numel:
            # The old buffer is freed to the caching allocator in stream order: the
            # kernels still queued on it run before anything reuses its memory.
            size = _grown(self.device_buffer.numel(), numel)
            self.device_buffer = torch.empty(size, dtype=torch.long, device=self.device)
        return self.device_buffer[:numel]


def _grown(current: int, needed: int) -> int:
    while current < needed:
        current *= 2
    return current


def _fill(
    host: np.ndarray,
    layout: _Layout,
    chunks: list[SequenceChunk],
    token_ids: list[int],
    logits_rows: list[int],
    block_size: int,
) -> int:
    """Write the step into ``host`` (laid out as ``_views`` reads it); returns the longest
    chunk. Vectorised over tokens: only the block table is written row by row."""
    tokens, seqs = layout.tokens, layout.seqs
    ids, positions, slots, seq_lens, starts, rows, table = _split(host, layout)
    new = np.fromiter((c.num_new for c in chunks), dtype=np.int64, count=seqs)
    computed = np.fromiter((c.num_computed for c in chunks), dtype=np.int64, count=seqs)
    starts[0] = 0
    np.cumsum(new, out=starts[1:])
    np.add(computed, new, out=seq_lens)
    owner = np.repeat(np.arange(seqs), new)  # the sequence of every token
    positions[:] = np.arange(tokens) - starts[owner] + computed[owner]
    table[:] = 0  # padding: never read, the kernel stops at each sequence's length
    for index, chunk in enumerate(chunks):
        used = -(-int(seq_lens[index]) // block_size)
        table[index, :used] = chunk.block_ids[:used]
    slots[:] = table[owner, positions // block_size] * block_size + positions % block_size
    ids[:] = token_ids
    rows[:] = logits_rows[: layout.rows]
    return int(new.max())


def _split(host: np.ndarray | torch.Tensor, layout: _Layout) -> list:
    """The fields of the flat buffer, in order: token ids, positions, slots, sequence
    lengths, query starts, logits rows ``[tokens]*3, [seqs], [seqs+1], [rows]``, then the
    block table ``[seqs, width]``."""
    sizes = [layout.tokens] * 3 + [layout.seqs, layout.seqs + 1, layout.rows]
    fields = []
    offset = 0
    for size in sizes:
        fields.append(host[offset : offset + size])
        offset += size
    fields.append(host[offset : offset + layout.seqs * layout.width].reshape(layout.seqs, -1))
    return fields


def _views(device: torch.Tensor, layout: _Layout, max_query_len: int) -> StagedStep:
    ids, positions, slots, seq_lens, starts, rows, table = _split(device, layout)
    tables = VarlenTables(
        block_table=table, seq_lens=seq_lens, query_starts=starts, max_query_len=max_query_len
    )
    meta = AttentionMetadata(
        slots=slots,
        positions=positions,
        num_decodes=0,
        decode_block_table=None,
        decode_context_lens=None,
        prefills=[],
        prefill_tables=None,
        varlen=tables,
    )
    return StagedStep(ids, meta, rows if layout.select else None)
