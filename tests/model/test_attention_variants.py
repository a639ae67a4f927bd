"""The native decode and prefill attention ops with a sliding window, logit soft-capping
and sinks, called directly, against a dense float64 reference.

The blocks before each sequence's window are a placeholder block of NaN, as every slot no
sequence owns: a kernel that read one would return NaN. Shapes reach every kernel of the
CPU the suite runs on: whole-partition decode loops (head_dim 32/64/128 on AVX-512,
16/32/64 on AVX2), per-token loops (the others) and portable ones (head_dim 20), prefill on
float32 tiles, bf16 tiles (AVX512_BF16) and AMX tiles (head_dim % 32 == 0, AMX-BF16).
test_cpu_isa.py reruns them under KVSERVE_CPU_ISA=avx2 and avx512.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.kernels.native import load_native_ops
from tests.model.attention_variants import NULL_BLOCK, PagedProblem, make_problem
from tests.model.attention_variants import reference_attention as reference

pytestmark = pytest.mark.skipif(not load_native_ops(), reason="needs the native kernels")

# (heads, KV heads, head_dim)
SHAPES = {
    "mha": (4, 4, 16),
    "gqa": (9, 3, 64),
    "mqa": (4, 1, 32),
    "wide": (16, 2, 128),
    "odd": (6, 2, 20),  # no vector loop takes head_dim 20
}
# (KV cache dtype, model dtype)
CACHES = {
    "float32": ("float32", torch.float32),
    "bfloat16": ("bfloat16", torch.bfloat16),
    "float16": ("float16", torch.float32),
    "int8": ("int8", torch.float32),
    "bf16-int8": ("int8", torch.bfloat16),
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
BLOCK_SIZE = 16
# Smaller than a block, a block, several blocks, several decode partitions / prefill key
# tiles (128 keys), longer than every context.
WINDOWS = [7, 16, 40, 300, 5000]
# Decode contexts: one token, within a block, several windows long.
DECODE_CONTEXTS = [1, 9, 40, 200, 700]
# Prefill spans (tokens cached before, new tokens): a whole prompt several windows long, a
# chunk starting inside a block, one over several query tiles, one deep in its context.
PREFILL_SPANS = [(0, 150), (37, 70), (300, 129), (1000, 33)]
SOFTCAP = 3.0  # scores here run to about +-8: well into tanh's bend


def sinks_for(heads: int) -> torch.Tensor:
    return torch.randn(heads, generator=torch.Generator().manual_seed(heads)) * 2


def decode(problem: PagedProblem, scale: float, **variants) -> torch.Tensor:
    rows, heads, head_dim = problem.query.shape
    kv_heads = problem.key_cache.shape[0]
    qkv = torch.zeros(rows, (heads + 2 * kv_heads) * head_dim, dtype=problem.query.dtype)
    qkv[:, : heads * head_dim] = problem.query.reshape(rows, -1)
    out = torch.full((rows, heads * head_dim), float("nan"), dtype=problem.query.dtype)
    torch.ops.kvserve.paged_decode_attention(
        out,
        qkv,
        problem.key_cache,
        problem.value_cache,
        problem.block_table,
        torch.tensor(problem.lengths),
        heads,
        kv_heads,
        scale,
        problem.key_scale,
        problem.value_scale,
        **variants,
    )
    return out.view(rows, heads, head_dim)


def prefill(problem: PagedProblem, scale: float, **variants) -> torch.Tensor:
    rows, heads, head_dim = problem.query.shape
    kv_heads = problem.key_cache.shape[0]
    qkv = torch.zeros(rows, (heads + 2 * kv_heads) * head_dim, dtype=problem.query.dtype)
    qkv[:, : heads * head_dim] = problem.query.reshape(rows, -1)
    out = torch.full((rows, heads * head_dim), float("nan"), dtype=problem.query.dtype)
    torch.ops.kvserve.paged_prefill_attention(
        out,
        qkv,
        problem.key_cache,
        problem.value_cache,
        problem.block_table,
        torch.tensor(problem.query_starts),
        torch.tensor([done for done, _ in problem.seqs]),
        heads,
        kv_heads,
        scale,
        problem.key_scale,
        problem.value_scale,
        **variants,
    )
    return out.view(rows, heads, head_dim)


def build(mode: str, shape: str, cache: str, window: int, seed: int = 0) -> PagedProblem:
    heads, kv_heads, head_dim = SHAPES[shape]
    kv_dtype, model_dtype = CACHES[cache]
    seqs = [(n - 1, 1) for n in DECODE_CONTEXTS] if mode == "decode" else PREFILL_SPANS
    return make_problem(
        seqs, heads, kv_heads, head_dim, BLOCK_SIZE, kv_dtype, model_dtype, window, seed
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tolerance = TOLERANCE[actual.dtype]
    torch.testing.assert_close(
        actual.double(), expected, atol=tolerance, rtol=tolerance, check_dtype=False
    )


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_native_decode_sees_only_its_window(shape, cache, window):
    problem = build("decode", shape, cache, window)
    scale = SHAPES[shape][2] ** -0.5
    actual = decode(problem, scale, window=window)
    assert_close(actual, reference(problem, scale, window=window))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_native_prefill_sees_only_its_window(shape, cache, window):
    problem = build("prefill", shape, cache, window)
    scale = SHAPES[shape][2] ** -0.5
    actual = prefill(problem, scale, window=window)
    assert_close(actual, reference(problem, scale, window=window))


VARIANTS = ["softcap", "sinks", "all"]


def variant_args(variant: str, heads: int) -> dict:
    if variant == "softcap":
        return {"softcap": SOFTCAP}
    if variant == "sinks":
        return {"sinks": sinks_for(heads)}
    return {"window": 40, "softcap": SOFTCAP, "sinks": sinks_for(heads)}


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_native_softcap_and_sinks(mode, shape, cache, variant):
    args = variant_args(variant, SHAPES[shape][0])
    problem = build(mode, shape, cache, args.get("window", 0))
    scale = SHAPES[shape][2] ** -0.5
    actual = (decode if mode == "decode" else prefill)(problem, scale, **args)
    assert_close(actual, reference(problem, scale, **args))


def test_native_decode_sinks_can_outweigh_every_key():
    """A sink far above every score takes almost all the weight: outputs shrink toward 0
    in the proportion the reference gives, not renormalised over the keys."""
    problem = build("decode", "gqa", "float32", 0)
    sinks = torch.full((9,), 20.0)
    actual = decode(problem, 0.125, sinks=sinks)
    expected = reference(problem, 0.125, sinks=sinks)
    assert expected.abs().max() < 0.01
    assert_close(actual, expected)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("shape", ["mha", "gqa", "wide"])
def test_native_inert_variants_change_nothing_bit_for_bit(mode, shape, cache):
    """A window longer than every context, a zero cap and sinks of -inf take the paths of
    a plain call and give the same bits."""
    problem = build(mode, shape, cache, 0)
    run = decode if mode == "decode" else prefill
    plain = run(problem, 0.125)
    sinks = torch.full((SHAPES[shape][0],), float("-inf"))
    assert torch.equal(run(problem, 0.125, window=5000, softcap=0.0, sinks=sinks), plain)
    assert torch.equal(run(problem, 0.125, window=5000), plain)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_native_placeholder_ids_before_the_window_are_not_checked(mode):
    """The table entries before a window may hold any placeholder id, even one no block
    has: the kernels neither check nor follow them."""
    problem = build(mode, "gqa", "float32", 40)
    expected = reference(problem, 0.125, window=40)
    problem.block_table[problem.block_table == NULL_BLOCK] = -1
    run = decode if mode == "decode" else prefill
    assert_close(run(problem, 0.125, window=40), expected)


def test_native_variants_reject_bad_arguments():
    problem = build("decode", "gqa", "float32", 0)
    with pytest.raises(RuntimeError, match="window"):
        decode(problem, 0.125, window=-1)
    with pytest.raises(RuntimeError, match="softcap"):
        decode(problem, 0.125, softcap=-1.0)
    with pytest.raises(RuntimeError, match="sinks"):
        decode(problem, 0.125, sinks=torch.zeros(3))
    with pytest.raises(RuntimeError, match="sinks"):
        prefill(build("prefill", "gqa", "float32", 0), 0.125, sinks=torch.zeros(9).double())
