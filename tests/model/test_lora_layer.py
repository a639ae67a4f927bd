"""The LoRA projection (engine/model/layers/lora.py) on its own: the native op and the
stacked-and-masked torch path against the plain formula, rows without an adapter left
exactly as the base computed them, and a row's result independent of its batch-mates."""

from __future__ import annotations

import pytest
import torch

from engine.model.kernels.native import load_native_ops
from engine.model.layers.linear import DenseLinear
from engine.model.layers.lora import BASE_SLOT, LoRABatch, LoRALinear

IN, OUT, WIDTH, SLOTS = 96, 80, 12, 3
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def make_layer(dtype: torch.dtype, native: bool, seed: int = 0) -> LoRALinear:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(OUT, IN, generator=generator).to(dtype)
    a = torch.randn(SLOTS * WIDTH, IN, generator=generator).to(dtype) * 0.3
    bt = torch.randn(SLOTS * WIDTH, OUT, generator=generator).to(dtype) * 0.3
    return LoRALinear(DenseLinear(weight), a, bt, WIDTH, LoRABatch(), native=native)


def expected(layer: LoRALinear, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """The formula row by row, in float64."""
    base = DenseLinear.__call__(layer.base, x).double()  # type: ignore[arg-type]
    for row, slot in enumerate(slots):
        if slot != BASE_SLOT:
            rows = slice(slot * WIDTH, (slot + 1) * WIDTH)
            shrunk = x[row].double() @ layer.a[rows].double().T
            base[row] += shrunk @ layer.bt[rows].double()
    return base


def paths() -> list[bool]:
    return [False, True] if load_native_ops() else [False]


@pytest.mark.parametrize("native", paths())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_gets_its_own_adapter_and_base_rows_stay_the_base(
    native: bool, dtype: torch.dtype
) -> None:
    layer = make_layer(dtype, native)
    x = torch.randn(7, IN).to(dtype)
    slots = [2, BASE_SLOT, 0, 2, 1, BASE_SLOT, 0]
    layer.batch.set(slots, x.device, dtype)
    got = layer(x)
    scale = expected(layer, x, slots).abs().max()
    torch.testing.assert_close(
        got.double(), expected(layer, x, slots), atol=TOLERANCE[dtype] * scale, rtol=0
    )
    base = layer.base(x)
    assert torch.equal(got[[1, 5]], base[[1, 5]])  # not an ulp moved
    layer.batch.clear()
    assert torch.equal(layer(x), base)  # no adapter rows: the base alone


@pytest.mark.skipif(not load_native_ops(), reason="needs the native kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_op_gives_a_row_the_same_bits_alone_and_in_a_batch(dtype: torch.dtype) -> None:
    """What the op adds to a row does not depend on the other rows (on zeros, the sum is
    the delta itself: the base's own GEMM is not what this checks)."""
    layer = make_layer(dtype, native=True)
    x = torch.randn(32, IN).to(dtype)
    slots = torch.tensor([row % SLOTS for row in range(32)])
    batched = torch.zeros(32, OUT, dtype=dtype)
    torch.ops.kvserve.lora_apply(batched, x, layer.a, layer.bt, slots, WIDTH)
    for row in (0, 13, 31):
        alone = torch.zeros(1, OUT, dtype=dtype)
        one = slice(row, row + 1)
        torch.ops.kvserve.lora_apply(alone, x[one], layer.a, layer.bt, slots[one], WIDTH)
        assert torch.equal(alone[0], batched[row])


@pytest.mark.skipif(not load_native_ops(), reason="needs the native kernels")
def test_the_native_op_refuses_a_slot_past_the_stack() -> None:
    layer = make_layer(torch.float32, native=True)
    x = torch.randn(2, IN)
    with pytest.raises(RuntimeError, match="past the 3 slots"):
        torch.ops.kvserve.lora_apply(
            layer.base(x), x, layer.a, layer.bt, torch.tensor([0, 3]), WIDTH
        )
