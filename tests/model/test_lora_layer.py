"""The LoRA projection (engine/model/layers/lora.py) on its own: the native op and the
stacked-and-masked torch path against the plain formula, rows without an adapter left
exactly as the base computed them, and a row's result independent of its batch-mates."""

from __future__ import annotations

import pytest
import torch

from engine.model.kernels.native import load_native_ops
from engine.model.layers.linear import DenseLinear
from engine.model.layers.lora import BASE_SLOT, LoRABatch, LoRALinear

IN, SLOTS = 100, 3  # 100: the dot products end in a partial chunk
# A fused projection of three parts (q, k, v), 83 columns: a whole 64-column tile, one
# vector and a few single columns at the end, so every path of the native expand runs.
PART_COLUMNS = (40, 20, 23)
OUT, RANK = sum(PART_COLUMNS), 4
WIDTH = len(PART_COLUMNS) * RANK
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def make_layer(dtype: torch.dtype, native: bool, seed: int = 0) -> LoRALinear:
    """Three slots laid out as the runtime fills them: each part's B block non-zero only
    at its own columns; slot 1 trains no k (its part 1 is all zeros)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(OUT, IN, generator=generator).to(dtype)
    a = torch.randn(SLOTS * WIDTH, IN, generator=generator) * 0.3
    bt = torch.zeros(SLOTS * WIDTH, OUT)
    for slot in range(SLOTS):
        first_column = 0
        for part, columns in enumerate(PART_COLUMNS):
            rows = slice(slot * WIDTH + part * RANK, slot * WIDTH + (part + 1) * RANK)
            block = slice(first_column, first_column + columns)
            first_column += columns
            if (slot, part) != (1, 1):
                bt[rows, block] = torch.randn(RANK, columns, generator=generator) * 0.3
    layer = LoRALinear(
        DenseLinear(weight), a.to(dtype), bt.to(dtype), WIDTH, LoRABatch(), native, parts=3
    )
    return layer


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
    torch.ops.kvserve.lora_apply(batched, x, layer.a, layer.bt, slots, layer.spans)
    for row in (0, 13, 31):
        alone = torch.zeros(1, OUT, dtype=dtype)
        one = slice(row, row + 1)
        torch.ops.kvserve.lora_apply(alone, x[one], layer.a, layer.bt, slots[one], layer.spans)
        assert torch.equal(alone[0], batched[row])


@pytest.mark.skipif(not load_native_ops(), reason="needs the native kernels")
def test_the_native_op_refuses_a_slot_past_the_stack() -> None:
    layer = make_layer(torch.float32, native=True)
    x = torch.randn(2, IN)
    with pytest.raises(RuntimeError, match="past the 3 slots"):
        torch.ops.kvserve.lora_apply(
            layer.base(x), x, layer.a, layer.bt, torch.tensor([0, 3]), layer.spans
        )


@pytest.mark.skipif(not load_native_ops(), reason="needs the native kernels")
def test_the_native_op_refuses_spans_outside_the_output() -> None:
    layer = make_layer(torch.float32, native=True)
    x = torch.randn(2, IN)
    spans = layer.spans.clone()
    spans[0, 0] = torch.tensor([10, OUT + 1])
    with pytest.raises(RuntimeError, match="within the output"):
        torch.ops.kvserve.lora_apply(
            layer.base(x), x, layer.a, layer.bt, torch.tensor([0, 1]), spans
        )


def test_spans_follow_each_parts_columns_and_a_refilled_slot() -> None:
    """The native kernel reads only these columns of each part's B block: they must cover
    every non-zero, and an untrained part has none."""
    layer = make_layer(torch.float32, native=True)
    q, k, v = (0, 40), (40, 60), (60, 83)
    assert layer.spans[0].tolist() == [list(q), list(k), list(v)]
    assert layer.spans[1].tolist() == [list(q), [0, 0], list(v)]
    rows = slice(2 * WIDTH, 3 * WIDTH)
    layer.bt[rows].zero_()
    layer.bt[2 * WIDTH + RANK, 45] = 1.0  # one weight of k, in the middle of its columns
    layer.refresh(2)
    assert layer.spans[2].tolist() == [[0, 0], [45, 46], [0, 0]]
