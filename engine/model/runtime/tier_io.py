"""Moves the bytes of the tiered prefix cache: the runner side of engine/kv/tiers.py.

``TierIO.apply(ops)`` executes a step's ``TierOp``s in order, before the step's other
block moves. Consecutive ops between the same two tiers run as one batched copy unless
two of them write the same block (a small host tier can be refilled twice in one step).

- device <-> host: ``copy_blocks`` between the device pool and the host tier's pool.
- -> disk: the block is copied out on the step's thread (it may be overwritten by this
  very step) and handed to the disk store's writer thread, which packs, checksums and
  writes it; a busy writer drops it. Serialization and file I/O never block the step.
- disk -> device: read and verified by the store, then copied into the device block.
  A load that fails (missing, corrupt) is reported: the scheduler recomputes from there.

Returns, per loading request, how many of its (leading) blocks arrived intact.

``TierIO.start_writes_ahead(ops)`` runs the step's write-ahead copies (device -> host, and
the disk stores of the host blocks they reuse) on one writer thread while the forward
runs; the core calls ``wait_writes_ahead()`` before the step returns, so the next step
sees them done.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from engine.compute_thread import ComputeThread
from engine.kv.disk_store import DiskStore
from engine.kv.tiers import DEVICE, DISK, HOST, TierCounters
from engine.model.kernels.native import load_native_ops
from engine.model.runtime.kv_cache import CopyStaging, KVPool, copy_blocks, copy_blocks_serially
from engine.outputs import TierOp


class TierIO:
    """Applies tier ops to the device pool, the host tier's pool and the disk store."""

    def __init__(
        self,
        device_pool: KVPool,
        host_pool: KVPool | None,
        disk: DiskStore | None,
        counters: dict[str, TierCounters],
        staging: CopyStaging,
    ) -> None:
        self.pools = {DEVICE: device_pool}
        self.staging = staging  # the runner's: tier copies are bounded like swaps
        if host_pool is not None:
            self.pools[HOST] = host_pool
        self.disk = disk
        self.counters = counters
        self.block_bytes = sum(t[:, :, 0].numel() * t.element_size() for t in device_pool.tensors())
        self._writer: ComputeThread | None = None  # started with the first write-ahead
        self._writing: Future[None] | None = None
        # The writer copies CPU pools with memcpy on its own thread: torch's copies would
        # start a second OpenMP team beside the forward's, which stalls the forward far more
        # than the copy costs (loaded now, not on the writer mid-step, if it must be built).
        on_cpu = device_pool.key.device.type == "cpu" and host_pool is not None
        self._memcpy_writes = on_cpu and load_native_ops()

    def apply(self, ops: list[TierOp], *, wait_for_disk: bool = False) -> dict[str, int]:
        """Execute ``ops`` in order; ``wait_for_disk`` blocks on a full write queue instead
        of dropping (shutdown only). Returns request id -> leading blocks loaded."""
        loaded: dict[str, int] = {}
        broken: set[str] = set()
        for group in _groups(ops):
            first = group[0]
            if first.target == DISK:
                self._store_to_disk(group, wait_for_disk)
                continue
            started = time.perf_counter()
            if first.source == DISK:  # past a request's first failure, nothing is read
                arrived = []
                for op in group:
                    ok = op.request_id not in broken and self._load_from_disk(op)
                    _note_load(op, ok, loaded, broken)
                    arrived.append(ok)
            else:
                self._copy(group)
                arrived = [True] * len(group)
                for op in group:
                    _note_load(op, True, loaded, broken)
                if first.target != DEVICE:
                    self.counters[first.target].in_step_stores += len(group)
            self._count_move(first, sum(arrived), time.perf_counter() - started)
        return loaded

    def start_writes_ahead(self, ops: list[TierOp]) -> None:
        """Run ``ops`` (tier stores only) in order on the writer thread; the caller calls
        ``wait_writes_ahead`` before the next step."""
        if self._writer is None:
            self._writer = ComputeThread("kvserve-tier-writer")
        self._writing = self._writer.submit(lambda: self._write_ahead(ops))

    def wait_writes_ahead(self) -> BaseException | None:
        """Block until the last write-ahead is done; what it raised, or None."""
        writing, self._writing = self._writing, None
        return writing.exception() if writing is not None else None

    def _write_ahead(self, ops: list[TierOp]) -> None:
        for group in _groups(ops):
            first = group[0]
            assert not first.is_load, "a load among the writes ahead"
            if first.target == DISK:
                self._store_to_disk(group, wait=False)
                continue
            if self._memcpy_writes:
                pairs = [(op.source_block, op.target_block) for op in group]
                copy_blocks_serially(self.pools[first.source], self.pools[first.target], pairs)
            else:
                self._copy(group)
            self._count_move(first, len(group), 0.0)

    def _copy(self, group: list[TierOp]) -> None:
        pairs = [(op.source_block, op.target_block) for op in group]
        copy_blocks(self.pools[group[0].source], self.pools[group[0].target], pairs, self.staging)

    def close(self) -> None:
        """Stop the writer thread, let queued disk writes finish (bounded), stop those."""
        self.wait_writes_ahead()
        if self._writer is not None:
            self._writer.close()
        if self.disk is not None:
            self.disk.close()

    # -- disk ----------------------------------------------------------------------------------

    def _store_to_disk(self, group: list[TierOp], wait: bool) -> None:
        assert self.disk is not None, "a disk store op without a disk tier"
        if not self.disk.writable:
            return
        source = self.pools[group[0].source]
        ids = torch.tensor([op.source_block for op in group], device=source.key.device)
        # One copy per tensor for the whole group, taken now: the blocks may be reused
        # by this step. Packing and checksumming happen on the writer thread.
        copies = [t.index_select(2, ids).to("cpu") for t in source.tensors()]
        counters = self.counters[DISK]
        for index, op in enumerate(group):
            parts = [c[:, :, index] for c in copies]
            if self.disk.submit(op.block_hash, _packer(parts), block=wait):
                counters.stored_bytes += self.block_bytes

    def _load_from_disk(self, op: TierOp) -> bool:
        assert self.disk is not None, "a disk load op without a disk tier"
        payload = self.disk.read(op.block_hash)
        if payload is None or len(payload) != self.block_bytes:
            self.counters[DISK].failed_loads += 1
            return False
        target = self.pools[DEVICE]
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for tensor in target.tensors():
            block = tensor[:, :, op.target_block]
            size = block.numel() * block.element_size()
            chunk = buffer[offset : offset + size].view(tensor.dtype).view(block.shape)
            block.copy_(chunk)
            offset += size
        return True

    def _count_move(self, op: TierOp, num_blocks: int, seconds: float) -> None:
        moved = num_blocks * self.block_bytes
        if op.target == DEVICE:
            counters = self.counters[op.source]
            counters.loaded_bytes += moved
            counters.load_seconds += seconds
        else:
            self.counters[op.target].stored_bytes += moved


def _packer(parts: list[torch.Tensor]) -> Callable[[], bytes]:
    def pack() -> bytes:
        return b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)

    return pack


def _note_load(op: TierOp, ok: bool, loaded: dict[str, int], broken: set[str]) -> None:
    """Count a load towards its request's leading run; after one failure, none count."""
    rid = op.request_id
    if rid is None:
        return
    if not ok:
        broken.add(rid)
    elif rid not in broken:
        loaded[rid] = loaded.get(rid, 0) + 1


def _groups(ops: list[TierOp]) -> Iterator[list[TierOp]]:
    """Runs of consecutive ops between the same two tiers in which no block is written
    twice and no block written earlier in the run is read again."""
    group: list[TierOp] = []
    written: set[int] = set()
    for op in ops:
        same_kind = group and (op.source, op.target) == (group[0].source, group[0].target)
        conflict = op.target_block in written or (
            op.source == op.target and op.source_block in written
        )
        if group and (not same_kind or (op.target_block >= 0 and conflict)):
            yield group
            group, written = [], set()
        group.append(op)
        if op.target_block >= 0:
            written.add(op.target_block)
    if group:
        yield group
