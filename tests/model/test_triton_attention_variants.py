"""The Triton unified attention with a sliding window, logit soft-capping and sinks, against
a dense float64 reference: mixed batches of decodes and prefill chunks (chunks starting
inside a block, several windows long), decodes split over the context, GQA groups, every
KV cache dtype. The blocks before each sequence's window are a placeholder block of NaN,
as is every slot no sequence owns. Under TRITON_INTERPRET on the CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.model.triton_setup import DEVICE  # isort: skip  (sets TRITON_INTERPRET first)
from engine.model.kernels.triton.triton_attention import unified_attention
from tests.model.attention_variants import PagedProblem, make_problem, reference_attention

# (cached tokens before the step, new tokens): decodes first, then prefill chunks from 0,
# inside a block and deep in a context several windows long.
MIXED = [(39, 1), (0, 1), (200, 1), (0, 70), (37, 45), (150, 20)]
DECODES = [(70, 1), (3, 1), (260, 1), (33, 1)]
# (query heads, KV heads, head_dim): MHA, GQA 3 with a padded head dim, GQA 8.
HEAD_LAYOUTS = [(4, 4, 16), (6, 2, 24), (8, 1, 16)]
MODEL_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
BLOCK_SIZE = 16
WINDOWS = [5, 16, 40, 1000]  # within a block, a block, blocks, past every context
SOFTCAP = 3.0


def build(seqs, layout, kv_dtype: str, window: int) -> PagedProblem:
    heads, kv_heads, head_dim = layout
    dtype = MODEL_DTYPE.get(kv_dtype, torch.float32)
    return make_problem(seqs, heads, kv_heads, head_dim, BLOCK_SIZE, kv_dtype, dtype, window)


def run(problem: PagedProblem, scale: float, decodes_only=False, splits=1, **variants):
    def on_device(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return tensor.to(DEVICE) if tensor is not None else None

    query = problem.query.to(DEVICE)
    out = torch.full_like(query, float("nan"))
    if "sinks" in variants:
        variants["sinks"] = variants["sinks"].to(DEVICE)
    return unified_attention(
        out,
        query,
        problem.key_cache.to(DEVICE),
        problem.value_cache.to(DEVICE),
        problem.block_table.to(torch.int32).to(DEVICE),
        torch.tensor(problem.lengths, dtype=torch.int32, device=DEVICE),
        scale,
        query_starts=None
        if decodes_only
        else torch.tensor(problem.query_starts, dtype=torch.int32, device=DEVICE),
        max_query_len=max(new for _, new in problem.seqs),
        key_scale=on_device(problem.key_scale),
        value_scale=on_device(problem.value_scale),
        num_splits=splits,
        **variants,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tolerance = TOLERANCE[actual.dtype]
    torch.testing.assert_close(
        actual.cpu().double(), expected, atol=tolerance, rtol=tolerance, check_dtype=False
    )


def sinks_for(heads: int) -> torch.Tensor:
    return torch.randn(heads, generator=torch.Generator().manual_seed(heads)) * 2


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("layout", HEAD_LAYOUTS, ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
def test_triton_mixed_batch_sees_only_its_window(layout, kv_dtype, window):
    problem = build(MIXED, layout, kv_dtype, window)
    scale = layout[2] ** -0.5
    expected = reference_attention(problem, scale, window=window)
    assert_close(run(problem, scale, window=window), expected)


@pytest.mark.parametrize("variant", ["softcap", "sinks", "all"])
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16", "int8", "fp8"])
def test_triton_softcap_and_sinks(kv_dtype, variant):
    layout = (6, 2, 24)
    args: dict = {"softcap": SOFTCAP} if variant != "sinks" else {}
    if variant != "softcap":
        args["sinks"] = sinks_for(layout[0])
    if variant == "all":
        args["window"] = 40
    problem = build(MIXED, layout, kv_dtype, args.get("window", 0))
    expected = reference_attention(problem, 0.2, **args)
    assert_close(run(problem, 0.2, **args), expected)


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("window", [16, 40])
def test_triton_decodes_split_over_the_window(window, kv_dtype, splits):
    """Splits share the window's range, not the context's, and count the sink once."""
    problem = build(DECODES, (8, 2, 16), kv_dtype, window)
    args = {"window": window, "softcap": SOFTCAP, "sinks": sinks_for(8)}
    expected = reference_attention(problem, 0.25, **args)
    assert_close(run(problem, 0.25, decodes_only=True, splits=splits, **args), expected)


@pytest.mark.parametrize("splits", [1, 2])
def test_triton_inert_variants_change_nothing_bit_for_bit(splits):
    """A window past every context and sinks of -inf give a plain launch's bits."""
    problem = build(MIXED, (6, 2, 24), "float32", 0)
    plain = run(problem, 0.2, splits=splits)
    sinks = torch.full((6,), float("-inf"))
    assert torch.equal(run(problem, 0.2, splits=splits, window=5000, sinks=sinks), plain)


def test_triton_prefill_chunks_split_over_the_window():
    problem = build(MIXED, (6, 2, 24), "float32", 40)
    args = {"window": 40, "softcap": SOFTCAP, "sinks": sinks_for(6)}
    expected = reference_attention(problem, 0.2, **args)
    assert_close(run(problem, 0.2, splits=2, **args), expected)
