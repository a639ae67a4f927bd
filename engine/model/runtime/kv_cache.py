"""KV block tensors: allocated once, written by slot, read by block table.

Layout per pool: K and V are each ``[page_layers, kv_heads, blocks, block_size, head_dim]``.
Putting the head dimension before the block dimension means that gathering a batch's
block tables for one layer is a single ``index_select`` whose result already has the
``[kv_heads, batch, tokens, head_dim]`` shape batched matmul wants: no permute copies on
the decode hot path.

A block is a page of ``page_layers`` layer slots (engine/kv/groups.py): every layer for a
model of one KV group; for a hybrid model the slots a group's layers take, so the j-th
layer of every group shares slot j and a block id means one page whichever group holds
it. ``PagedKVCache.layer(l)`` resolves layer l to its slot.

Quantized caches (int8, fp8) store one float32 scale per (token, KV head) for K and for V
beside the blocks, exactly as engine/kv/accounting.py counts them.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from dataclasses import dataclass

import torch

from engine.kv import accounting
from engine.kv.accounting import KVShape
from engine.kv.groups import layer_slots

_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    # fp8 bytes are stored as uint8: CPU index_copy_/index_select do not take float8.
    "fp8": torch.uint8,
}
_FP8 = torch.float8_e4m3fn
# Largest magnitude each quantized format represents; scales map absmax onto it.
_QUANT_MAX: dict[str, float] = {"int8": 127.0, "fp8": 448.0}


@dataclass(frozen=True)
class KVPoolLayout:
    """Shape of one KV pool (device or host)."""

    shape: KVShape
    num_blocks: int
    block_size: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back an untouched CPU tensor with 2 MiB pages (``MADV_HUGEPAGE``).

    Why: a request's blocks are scattered across the pool, so decode attention touches a new
    4 KiB page at every block; with 4 KiB pages each is a TLB miss and a prefetcher restart
    (measured: paged decode attention ~1.4x faster on huge pages here). Must run before the
    memory is first written. Returns whether the advice was taken; failure is harmless.
    """
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    aligned_start = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    aligned_end = end // _HUGE_PAGE * _HUGE_PAGE
    if aligned_end <= aligned_start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, libc among them
    length = aligned_end - aligned_start
    return (
        libc.madvise(ctypes.c_void_p(aligned_start), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0
    )


def _zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin: bool
) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
    if not pin:
        advise_huge_pages(tensor)
    return tensor.zero_()


class KVPool:
    """One set of KV block tensors (the device pool or the host offload pool)."""

    def __init__(self, layout: KVPoolLayout, device: torch.device, pin_memory: bool = False):
        self.layout = layout
        kv = layout.shape
        dims = (kv.page_layers, kv.num_kv_heads, layout.num_blocks, layout.block_size)
        dtype = _STORAGE_DTYPES[kv.kv_dtype]
        pin = pin_memory and device.type == "cpu" and torch.cuda.is_available()
        self.key = _zeros((*dims, kv.head_dim), dtype, device, pin)
        self.value = _zeros((*dims, kv.head_dim), dtype, device, pin)
        self.key_scale: torch.Tensor | None = None
        self.value_scale: torch.Tensor | None = None
        if kv.is_quantized:
            self.key_scale = _zeros(dims, torch.float32, device, pin)
            self.value_scale = _zeros(dims, torch.float32, device, pin)

    def tensors(self) -> list[torch.Tensor]:
        """All tensors indexed by block on dim 2 (values and, when quantized, scales)."""
        out = [self.key, self.value]
        if self.key_scale is not None and self.value_scale is not None:
            out += [self.key_scale, self.value_scale]
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class CopyStaging:
    """The fixed buffers every block copy goes through, allocated once: one on the device
    pool's device and, when that is not the CPU, a pinned one on the host (so
    host-to-device copies are true asynchronous DMA, not a pageable temporary). Each holds
    ``chunk_blocks`` blocks of one layer's K (or V, or their scales); its size is
    ``accounting.copy_staging_bytes`` and the capacity plan counts it. The tier writer
    thread shares the buffers with the step's own copies: ``lock`` is held for one chunk.
    """

    def __init__(
        self,
        layout: KVPoolLayout,
        device: torch.device,
        staging_bytes: int = accounting.COPY_STAGING_BYTES,
    ):
        kv, block_size = layout.shape, layout.block_size
        self.chunk_blocks = accounting.copy_chunk_blocks(kv, block_size, staging_bytes)
        self.lock = threading.Lock()
        nbytes = accounting.copy_staging_bytes(kv, block_size, staging_bytes)
        self._buffers = {device: torch.empty(nbytes, dtype=torch.uint8, device=device)}
        if device.type != "cpu":
            cpu = torch.device("cpu")
            pin = torch.cuda.is_available()
            self._buffers[cpu] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    @property
    def nbytes(self) -> int:
        """Bytes per buffer (the device one is what the plan counts)."""
        return next(iter(self._buffers.values())).numel()

    def view(self, device: torch.device, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """The front of the buffer on ``device`` as a contiguous tensor of ``shape``."""
        buffer = self._buffers[_canonical(device, self._buffers)]
        count = shape.numel() * torch.empty((), dtype=dtype).element_size()
        return buffer[:count].view(dtype).view(shape)


def _canonical(device: torch.device, buffers: dict[torch.device, torch.Tensor]) -> torch.device:
    # torch.device("cuda") and torch.device("cuda:0") name the same buffer.
    for known in buffers:
        if known.type == device.type and (known.index or 0) == (device.index or 0):
            return known
    raise KeyError(f"no copy staging buffer on {device}")


def copy_blocks(
    src: KVPool, dst: KVPool, pairs: list[tuple[int, int]], staging: CopyStaging
) -> None:
    """Copy whole blocks ``src_block -> dst_block`` for every pair (across pools/devices),
    in chunks of ``staging.chunk_blocks`` blocks, one layer and tensor at a time, through
    the staging buffers: the copy allocates nothing but two small index tensors.

    Chunks run in order; within a chunk all sources are read before any destination is
    written. The scheduler never names a block as the destination of one pair and the
    source of a later one.
    """
    chunk = staging.chunk_blocks
    for start in range(0, len(pairs), chunk):
        part = pairs[start : start + chunk]
        src_ids = torch.tensor([p[0] for p in part], dtype=torch.long, device=src.key.device)
        dst_ids = torch.tensor([p[1] for p in part], dtype=torch.long, device=dst.key.device)
        with staging.lock:
            for src_tensor, dst_tensor in zip(src.tensors(), dst.tensors(), strict=True):
                for layer in range(src_tensor.shape[0]):
                    _copy_chunk(src_tensor[layer], dst_tensor[layer], src_ids, dst_ids, staging)


def copy_blocks_serially(src: KVPool, dst: KVPool, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks ``src_block -> dst_block`` between two CPU pools with memcpy on
    the calling thread alone: for a thread that copies beside the forward, where torch's
    own copies would start a second OpenMP team on the forward's cores. Needs the native
    ops loaded (``engine.model.kernels.native.load_native_ops``)."""
    sources, targets = [p[0] for p in pairs], [p[1] for p in pairs]
    for src_tensor, dst_tensor in zip(src.tensors(), dst.tensors(), strict=True):
        torch.ops.kvserve.copy_blocks_serial_(dst_tensor, src_tensor, sources, targets)


def _copy_chunk(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    staging: CopyStaging,
) -> None:
    """One layer's blocks (dim 1) of one tensor: gather into the source side's staging,
    move it to the destination side's staging if the devices differ, scatter."""
    shape = torch.Size((src.shape[0], len(src_ids), *src.shape[2:]))
    gathered = staging.view(src.device, src.dtype, shape)
    torch.index_select(src, 1, src_ids, out=gathered)
    if src.device != dst.device:
        landed = staging.view(dst.device, dst.dtype, shape)
        # Pinned on the host side, so the copy is asynchronous DMA on CUDA.
        landed.copy_(gathered, non_blocking=True)
        # Device -> host must land before the CPU scatters it; host -> device must finish
        # before the next chunk rewrites the pinned buffer it reads.
        torch.cuda.current_stream(_cuda_side(src.device, dst.device)).synchronize()
        gathered = landed
    dst.index_copy_(1, dst_ids, gathered)


def _cuda_side(a: torch.device, b: torch.device) -> torch.device:
    return a if a.type == "cuda" else b


class PagedKVCache:
    """The device pool the forward pass reads and writes, one layer at a time."""

    def __init__(self, pool: KVPool, compute_dtype: torch.dtype):
        self.pool = pool
        self.compute_dtype = compute_dtype
        kv = pool.layout.shape
        self.block_size = pool.layout.block_size
        self.quant_max = _QUANT_MAX.get(kv.kv_dtype)
        # Layer -> its slot in a page (the layer itself for a model of one group).
        self.slots = layer_slots(kv.groups, kv.num_layers)

    @property
    def is_quantized(self) -> bool:
        return self.pool.key_scale is not None

    @property
    def holds_exact_kv(self) -> bool:
        """Whether the cache holds K/V exactly as the forward computed them (not quantized,
        not narrower): only then may a fresh chunk attend to its own K/V unread, and still
        see what a later step reading the cache sees."""
        return not self.is_quantized and self.pool.key.dtype == self.compute_dtype

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V blocks, ``[kv_heads, num_blocks, block_size, head_dim]`` each."""
        slot = self.slots[layer]
        return self.pool.key[slot], self.pool.value[slot]

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A quantized cache's per-token K and V scales for one layer,
        ``[kv_heads, num_blocks, block_size]`` each; (None, None) when unquantized."""
        if self.pool.key_scale is None or self.pool.value_scale is None:
            return None, None
        slot = self.slots[layer]
        return self.pool.key_scale[slot], self.pool.value_scale[slot]

    def write(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Store ``key``/``value`` ([tokens, kv_heads, head_dim]) into flat slot indices."""
        self._write_one(layer, key, slots, self.pool.key, self.pool.key_scale)
        self._write_one(layer, value, slots, self.pool.value, self.pool.value_scale)

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks as ``[kv_heads, len(block_ids) * block_size, head_dim]``
        in the compute dtype (dequantized when the cache is quantized)."""
        key = self._gather_one(layer, block_ids, self.pool.key, self.pool.key_scale)
        value = self._gather_one(layer, block_ids, self.pool.value, self.pool.value_scale)
        return key, value

    def _write_one(
        self,
        layer: int,
        states: torch.Tensor,
        slots: torch.Tensor,
        cache: torch.Tensor,
        scales: torch.Tensor | None,
    ) -> None:
        heads, _, _, head_dim = cache.shape[1:]
        layer = self.slots[layer]
        flat = cache[layer].view(heads, -1, head_dim)
        per_head = states.transpose(0, 1)  # [kv_heads, tokens, head_dim]
        if scales is None or self.quant_max is None:
            flat.index_copy_(1, slots, per_head.to(cache.dtype))
            return
        absmax = per_head.abs().amax(dim=-1).float().clamp_min(1e-8)
        scale = absmax / self.quant_max
        quantized = per_head.float() / scale.unsqueeze(-1)
        if cache.dtype == torch.int8:
            stored = quantized.round().clamp(-127, 127).to(torch.int8)
        else:
            stored = quantized.to(_FP8).view(torch.uint8)
        flat.index_copy_(1, slots, stored)
        scales[layer].view(heads, -1).index_copy_(1, slots, scale)

    def _gather_one(
        self,
        layer: int,
        block_ids: torch.Tensor,
        cache: torch.Tensor,
        scales: torch.Tensor | None,
    ) -> torch.Tensor:
        heads, num_blocks, _, head_dim = cache.shape[1:]
        layer = self.slots[layer]
        # Selecting whole flattened blocks (rows of block_size * head_dim) is several times
        # faster on the CPU than index_select over a 4-D tensor's block dimension.
        rows = cache[layer].view(heads, num_blocks, -1)
        tokens = rows.index_select(1, block_ids).view(heads, -1, head_dim)
        if scales is None:
            return tokens if tokens.dtype == self.compute_dtype else tokens.to(self.compute_dtype)
        token_scales = scales[layer].index_select(1, block_ids).view(heads, -1, 1)
        if tokens.dtype == torch.uint8:
            tokens = tokens.view(_FP8)
        return (tokens.to(torch.float32) * token_scales).to(self.compute_dtype)
