"""LoRA on a projection: ``y = base(x) + scale * (x @ A.T) @ B.T`` with the adapter chosen
per row, for every adapter of a step in one pass (Punica / S-LoRA's batched LoRA).

A ``LoRALinear`` wraps any ``Linear`` (dense, int8, int4: the delta is added to whatever
the base returns) and holds ``max_loras`` adapter *slots* stacked in two matrices:

- ``a``  ``[slots * width, in]``: each slot's A rows (its parts' ranks, zero-padded to the
  slot width ``parts * max_rank``);
- ``bt`` ``[slots * width, out]``: each slot's B transposed, the scale folded in, each
  part's block placed at its output rows (q/k/v of a fused QKV, gate/up of a fused MLP).

With the native CPU kernels one op per projection applies every row's own slot
(``torch.ops.kvserve.lora_apply``, csrc/lora.cpp): a row reads only its adapter's A and B,
and rows without one are not touched. A slot's ``width`` rows are ``parts`` blocks of equal
rank, one per part of a fused projection; ``spans`` records the columns each block reaches
(re-read from ``bt`` by ``refresh`` whenever a slot is filled), so the kernel skips the
zeros a q-only block has over k and v. Elsewhere (CUDA, the torch kernels) a step whose rows
use slots ``0..n-1`` runs two GEMMs per projection over those slots: shrink
``x @ a[:n*width].T``, a 0/1 mask that keeps each row's own slot's columns, then expand
``+= shrunk @ bt[:n*width]``; a base row's mask is all zero, so its output is the base's
exactly. Neither loops over requests or adapters in Python. ``LoRABatch`` says which slot
each row of the forward under way takes; the runner sets it before a forward
(engine/lora/runtime.py fills the slots).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.layers.linear import Linear

BASE_SLOT = -1  # a row that runs the base model alone


class LoRABatch:
    """The slot of each row of the forward under way (``BASE_SLOT`` for the base), shared
    by every ``LoRALinear`` of one model; inactive when no row has an adapter."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None  # [rows] slot ids
        self.num_slots = 0  # the highest slot a row uses, plus one
        self._dtype = torch.float32
        self._masks: dict[int, torch.Tensor] = {}

    @property
    def active(self) -> bool:
        return self.rows is not None

    def set(self, slots: list[int], device: torch.device, dtype: torch.dtype) -> None:
        """Rows ``i`` of the next forward take slot ``slots[i]``."""
        self._masks.clear()
        self.num_slots = max(slots, default=BASE_SLOT) + 1
        if not self.num_slots:
            self.rows = None
            return
        self.rows = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
        self._dtype = dtype

    def clear(self) -> None:
        self.rows = None
        self.num_slots = 0
        self._masks.clear()

    def mask(self, width: int) -> torch.Tensor:
        """``[rows, num_slots * width]``: 1 where a column belongs to the row's slot."""
        mask = self._masks.get(width)
        if mask is None:
            assert self.rows is not None
            column_slot = torch.arange(self.num_slots * width, device=self.rows.device) // width
            mask = (column_slot[None, :] == self.rows[:, None]).to(self._dtype)
            self._masks[width] = mask
        return mask


class LoRALinear:
    """A ``Linear`` plus the LoRA delta of each row's adapter slot (module docstring)."""

    __slots__ = ("a", "base", "batch", "bt", "native", "spans", "width")

    def __init__(
        self,
        base: Linear,
        a: torch.Tensor,
        bt: torch.Tensor,
        width: int,
        batch: LoRABatch,
        native: bool = False,
        parts: int = 1,
    ):
        assert a.shape[0] == bt.shape[0] and a.shape[0] % width == 0, "a and bt stack slots"
        assert width % parts == 0, "a slot is parts blocks of one rank"
        self.base = base
        self.a = a
        self.bt = bt
        self.width = width  # rows of a and bt per slot
        self.batch = batch
        self.native = native  # torch.ops.kvserve.lora_apply (CPU tensors, kernels loaded)
        # [slots, parts, 2]: the columns [begin, end) each part's block of bt reaches.
        self.spans = torch.zeros(a.shape[0] // width, parts, 2, dtype=torch.long)
        for slot in range(self.spans.shape[0]):
            self.refresh(slot)

    def refresh(self, slot: int) -> None:
        """Re-read ``slot``'s column spans after its weights changed (native kernel only:
        the GEMM path reads every column)."""
        if not self.native:
            return
        parts, columns = self.spans.shape[1], self.bt.shape[1]
        rows = self.bt[slot * self.width : (slot + 1) * self.width]
        reached = rows.view(parts, -1, columns).ne(0).any(dim=1)  # [parts, columns]
        first = reached.int().argmax(dim=1)
        end = columns - reached.flip(1).int().argmax(dim=1)
        empty = ~reached.any(dim=1)
        self.spans[slot, :, 0] = first.masked_fill(empty, 0)
        self.spans[slot, :, 1] = end.masked_fill(empty, 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.batch
        if batch.rows is None:
            return y
        if self.native and x.is_contiguous() and y.is_contiguous() and x.dtype == y.dtype:
            torch.ops.kvserve.lora_apply(y, x, self.a, self.bt, batch.rows, self.spans)
            return y
        columns = batch.num_slots * self.width
        shrunk = F.linear(x, self.a[:columns])
        shrunk.mul_(batch.mask(self.width))
        return y.addmm_(shrunk, self.bt[:columns])

    @property
    def nbytes(self) -> int:
        return self.base.nbytes + _bytes(self.a) + _bytes(self.bt)

    @property
    def decode_nbytes(self) -> int:
        """The base's: a decode of the base model alone reads no adapter."""
        return self.base.decode_nbytes


def unwrap(linear: Linear) -> Linear:
    """The base projection of a ``LoRALinear``, any other projection as it is."""
    return linear.base if isinstance(linear, LoRALinear) else linear


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
