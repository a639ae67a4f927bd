"""The runner's side of LoRA: the model's projections wrapped with adapter slots, and the
slots filled for each step.

``attach_lora`` wraps a decoder's projections in ``LoRALinear``s holding ``max_loras``
zeroed slots. Before each forward ``LoRARuntime.prepare`` gives every adapter of the step
a slot: one it already holds, else the lowest free one, else the least recently used one
no row of this step needs (the scheduler admits at most ``max_loras`` distinct adapters,
so one always exists). A slot is filled from the host cache, an LRU of
``max_cpu_loras`` adapters in slot layout; an adapter not there is read from its
directory. Then it tells the model's ``LoRABatch`` which slot each row takes.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable

import torch

from engine.config import LoRAConfig
from engine.errors import AdapterUnavailable
from engine.lora.adapter import LoRAAdapter, LoRAError, read_adapter
from engine.lora.targets import DOWN, GATE_UP, O_PROJ, QKV, LoRATargets
from engine.model.layers.decoder import DecoderModel, LayerWeights
from engine.model.layers.linear import Linear
from engine.model.layers.lora import BASE_SLOT, LoRABatch, LoRALinear
from engine.model.layers.mlp import GatedMLP
from engine.outputs import ScheduledRequest
from engine.request import LoRARequest


class LoRARuntime:
    """Adapter slots of one model, and the host cache they are filled from."""

    def __init__(
        self,
        layers: dict[tuple[int, str], LoRALinear],
        batch: LoRABatch,
        targets: LoRATargets,
        config: LoRAConfig,
        dtype: torch.dtype,
    ) -> None:
        self.layers = layers
        self.batch = batch
        self.targets = targets
        self.dtype = dtype
        self.slots: list[int | None] = [None] * config.max_loras  # adapter id per slot
        self._last_used = [0] * config.max_loras
        self._steps = 0
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._host_capacity = config.host_capacity
        self.slot_bytes = targets.slot_bytes(dtype.itemsize)  # one adapter, slot or host
        self.slot_fills = 0  # slots filled (from the host cache or from disk)
        self.disk_reads = 0  # adapters read from their directory

    def prepare(self, batch: list[ScheduledRequest], device: torch.device) -> None:
        """Slot every adapter of ``batch`` and map the forward's rows (``batch``'s new
        tokens, in order) to their slots."""
        self._steps += 1
        adapters = {r.lora.id: r.lora for r in batch if r.lora is not None}
        if not adapters:
            self.batch.clear()
            return
        assert len(adapters) <= len(self.slots), "the scheduler bounds adapters per step"
        slot_of = {adapter_id: self._slot(lora, adapters) for adapter_id, lora in adapters.items()}
        rows = [
            slot_of[r.lora.id] if r.lora is not None else BASE_SLOT
            for r in batch
            for _ in range(r.num_new_tokens)
        ]
        self.batch.set(rows, device, self.dtype)

    def finish(self) -> None:
        """The forward is done: later model calls (the LM head) see no adapter rows."""
        self.batch.clear()

    def _slot(self, lora: LoRARequest, needed: dict[int, LoRARequest]) -> int:
        if lora.id in self.slots:
            slot = self.slots.index(lora.id)
        else:
            slot = self._free_slot(needed)
            self._fill(slot, self._adapter(lora))
            self.slots[slot] = lora.id
        self._last_used[slot] = self._steps
        return slot

    def _free_slot(self, needed: dict[int, LoRARequest]) -> int:
        """The lowest empty slot, else the least recently used one this step does not need."""
        if None in self.slots:
            return self.slots.index(None)
        spare = [s for s, held in enumerate(self.slots) if held not in needed]
        return min(spare, key=lambda s: self._last_used[s])

    def _adapter(self, lora: LoRARequest) -> LoRAAdapter:
        adapter = self._host.get(lora.id)
        if adapter is not None:
            self._host.move_to_end(lora.id)
            return adapter
        adapter = self._read(lora)
        self.disk_reads += 1
        self._host[lora.id] = adapter
        while len(self._host) > self._host_capacity:
            self._host.popitem(last=False)
        return adapter

    def _read(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter's files, as they were when it was loaded (its fingerprint)."""
        try:
            adapter = read_adapter(lora.path, self.targets, self.dtype)
            if adapter.fingerprint != lora.fingerprint:
                raise LoRAError("its files changed since it was loaded; load it again")
            return adapter
        except (LoRAError, OSError) as exc:
            message = f"LoRA adapter {lora.name!r} cannot be read back from {lora.path}: {exc}"
            raise AdapterUnavailable(lora.id, message) from exc

    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter`` into ``slot`` of every projection; zero where it has none."""
        for key, layer in self.layers.items():
            rows = slice(slot * layer.width, (slot + 1) * layer.width)
            weights = adapter.slots.get(key)
            if weights is None:
                layer.a[rows].zero_()
                layer.bt[rows].zero_()
            else:
                layer.a[rows].copy_(weights[0], non_blocking=True)
                layer.bt[rows].copy_(weights[1], non_blocking=True)
            layer.refresh(slot)
        self.slot_fills += 1


def attach_lora(model: DecoderModel, config: LoRAConfig) -> tuple[DecoderModel, LoRARuntime]:
    """``model`` with every adapter-capable projection a ``LoRALinear`` of ``max_loras``
    empty slots, and the runtime that fills them."""
    dense_mlp = all(isinstance(layer.mlp, GatedMLP) for layer in model.weights.layers)
    targets = LoRATargets.of(model.spec, config.max_lora_rank, dense_mlp)
    batch = LoRABatch()
    native = model.kernels.name == "native" and model.device.type == "cpu"
    wrapped: dict[tuple[int, str], LoRALinear] = {}

    def wrap(index: int, name: str, base: Linear) -> LoRALinear:
        projection = targets.get(name)
        assert projection is not None
        width = targets.width(name)
        rows = config.max_loras * width
        dtype, device = model.dtype, model.device
        a = torch.zeros(rows, projection.in_features, dtype=dtype, device=device)
        bt = torch.zeros(rows, projection.out_features, dtype=dtype, device=device)
        layer = LoRALinear(base, a, bt, width, batch, native=native, parts=len(projection.parts))
        wrapped[(index, name)] = layer
        return layer

    layers = [
        _wrap_layer(index, layer, dense_mlp, wrap)
        for index, layer in enumerate(model.weights.layers)
    ]
    weights = dataclasses.replace(model.weights, layers=layers)
    runtime = LoRARuntime(wrapped, batch, targets, config, model.dtype)
    return model.replace(weights=weights, lora_batch=batch), runtime


def _wrap_layer(
    index: int, layer: LayerWeights, dense_mlp: bool, wrap: Callable[[int, str, Linear], LoRALinear]
) -> LayerWeights:
    attention = dataclasses.replace(
        layer.attention,
        qkv=wrap(index, QKV, layer.attention.qkv),
        o_proj=wrap(index, O_PROJ, layer.attention.o_proj),
    )
    mlp = layer.mlp
    if dense_mlp:
        assert isinstance(mlp, GatedMLP)
        mlp = dataclasses.replace(
            mlp, gate_up=wrap(index, GATE_UP, mlp.gate_up), down=wrap(index, DOWN, mlp.down)
        )
    return dataclasses.replace(layer, attention=attention, mlp=mlp)
