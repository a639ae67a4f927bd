"""The fused CPU kernels (engine/model/kernels/csrc/) against the torch backend, op by op.

Whole-model parity with transformers for both backends lives in test_forward_parity.py and
test_engine_greedy.py; these tests pin each kernel down on its own, in float32 (tight) and
bfloat16 (within bf16 rounding), including shapes the tiny models do not reach.
The few-row linear kernels have their own file, test_linear_kernels.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from engine.model.kernels.base import TorchKernels
from engine.model.kernels.metadata import SequenceChunk, build_metadata
from engine.model.kernels.native import NativeKernels
from engine.model.kernels.params import AttentionParams
from engine.model.kernels.select import select_kernels
from engine.model.runtime.kv_cache import KVPool, KVPoolLayout, PagedKVCache
from engine.model.spec import ModelSpec
from tests.model.paged import BlockTables

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# Plain attention at head_dim 64's scale.
ATTENTION = AttentionParams(0.125)


@pytest.fixture(scope="module")
def native() -> NativeKernels:
    return NativeKernels()


def make_spec(num_heads: int, num_kv_heads: int, head_dim: int) -> ModelSpec:
    return ModelSpec(
        model_type="llama",
        num_layers=2,
        hidden_size=num_heads * head_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=64,
        vocab_size=100,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_norms_and_activation_match_torch(native, dtype, rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 96, dtype=dtype) * 3
    weight = torch.rand(96, dtype=dtype) + 0.5
    reference = TorchKernels()
    close(native.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    gate_up = torch.randn(rows, 2 * 80, dtype=dtype) * 4
    gate_up[:, :4] = torch.tensor([-100.0, -30.0, 30.0, 100.0])  # where exp saturates
    close(native.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))

    residual = torch.randn(rows, 96, dtype=dtype)
    residual_ref = residual.clone()
    normed = native.add_rms_norm(x.clone(), residual, weight, 1e-6)
    normed_ref = reference.add_rms_norm(x.clone(), residual_ref, weight, 1e-6)
    close(residual, residual_ref)
    close(normed, normed_ref)


@pytest.mark.parametrize("width", [1, 7, 16, 33, 49152])  # under, at and past 16 lanes
def test_greedy_tokens_are_torch_argmax_ties_nans_and_infinities_included(native, width):
    """The native argmax picks argmax's token in every row: the first of tied maxima
    (within a 16-lane chunk, across lanes, and in the tail), the first NaN over any number,
    +inf, and index 0 of an all -inf row; each row whatever the others hold."""
    generator = torch.Generator().manual_seed(width)
    logits = torch.randn(12, width, generator=generator)
    last = width - 1
    logits[1, [last, 0]] = 9.0  # tie: first and last
    logits[2, [min(3, last), last]] = 9.0
    logits[3, last] = float("nan")
    logits[4, [last, width // 2]] = float("nan")  # two NaNs: the first wins
    logits[5] = float("-inf")
    logits[6, width // 3] = float("inf")
    logits[7, [width // 3, last]] = float("inf")
    logits[8] = 0.0  # all tied
    logits[9, [width // 2, last]] = float("-inf")
    logits[10] = torch.randint(0, 3, (width,), generator=generator).float()  # many ties
    logits[11, last] = float("nan")
    logits[11, 0] = float("inf")
    expected = logits.argmax(dim=-1)
    assert torch.equal(native.greedy_tokens(logits), expected)
    for r in range(logits.shape[0]):  # alone, a row gets the token it got among the others
        assert native.greedy_tokens(logits[r : r + 1].clone()).item() == expected[r].item()


def test_greedy_tokens_of_other_dtypes_and_views_take_the_torch_path(native):
    logits = torch.randn(4, 100, dtype=torch.bfloat16)
    assert torch.equal(native.greedy_tokens(logits), logits.argmax(dim=-1))
    wide = torch.randn(3, 200)
    assert torch.equal(native.greedy_tokens(wide[:, ::2]), wide[:, ::2].argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rotates_query_and_key_heads_only(native, dtype):
    spec = make_spec(num_heads=6, num_kv_heads=2, head_dim=32)
    tokens = 9
    qkv = torch.randn(tokens, spec.q_size + 2 * spec.kv_size, dtype=dtype)
    positions = torch.tensor([0, 1, 2, 50, 51, 300, 7, 1000, 4095])
    angles = torch.outer(torch.arange(4096.0), 1.0 / 10000 ** (torch.arange(0, 32, 2) / 32))
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = TorchKernels().rotary(qkv.clone(), positions, cos, sin, spec)
    actual = native.rotary(qkv.clone(), positions, cos, sin, spec)
    close(actual, expected)
    values = slice(spec.q_size + spec.kv_size, None)
    assert torch.equal(actual[:, values], qkv[:, values])  # values are never rotated


def fill_cache(
    kernels: TorchKernels,
    spec: ModelSpec,
    dtype: torch.dtype,
    block_size: int,
    contexts: list[int],
) -> tuple[PagedKVCache, list[list[int]]]:
    """A cache holding random K/V for every context, written through ``kernels.write_kv``
    into scrambled (never contiguous) blocks."""
    shape = spec.kv_shape({torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype])
    pool = KVPool(KVPoolLayout(shape, 256, block_size), torch.device("cpu"))
    cache = PagedKVCache(pool, dtype)
    tables = BlockTables(256, seed=block_size)
    blocks = [tables.allocate(ctx, block_size) for ctx in contexts]
    generator = torch.Generator().manual_seed(len(contexts))
    width = spec.q_size + 2 * spec.kv_size
    for layer in range(spec.num_layers):
        for ctx, ids in zip(contexts, blocks, strict=True):
            qkv = torch.randn(ctx, width, generator=generator).to(dtype)
            slots = [ids[p // block_size] * block_size + p % block_size for p in range(ctx)]
            kernels.write_kv(cache, layer, qkv, torch.tensor(slots), spec)
    return cache, blocks


# (heads, KV heads, head_dim). On AVX-512 builds decode attention takes whole-partition
# kernels for head_dim 32/64/128 (wide: a group of 8, four heads a call in column slices)
# and the per-token loops for 16 (mha); KVSERVE_CPU_ISA=avx2 reruns these with the
# whole-partition kernels for head_dim 16-64 (gqa: three heads a call, values in half
# rows) and the per-token loops for 128.
SHAPES = {"mha": (4, 4, 16), "gqa": (9, 3, 64), "mqa": (4, 1, 32), "wide": (16, 2, 128)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_write_and_decode_attention_match_torch(native, dtype, shape, block_size):
    spec = make_spec(*SHAPES[shape])
    contexts = [2, 3, 17, 40, 129]  # attended lengths: the new token is the last one
    torch_cache, blocks = fill_cache(TorchKernels(), spec, dtype, block_size, contexts)
    native_cache, _ = fill_cache(native, spec, dtype, block_size, contexts)
    for ours, theirs in zip(native_cache.pool.tensors(), torch_cache.pool.tensors(), strict=True):
        assert torch.equal(ours, theirs)  # the write is a copy: bit-identical

    chunks = [SequenceChunk(ctx - 1, 1, ids) for ctx, ids in zip(contexts, blocks, strict=True)]
    meta = build_metadata(chunks, block_size, torch.device("cpu"))
    qkv = torch.randn(len(contexts), spec.q_size + 2 * spec.kv_size).to(dtype)
    for layer in range(spec.num_layers):
        expected = TorchKernels().decode_attention(torch_cache, layer, qkv, meta, spec, ATTENTION)
        actual = native.decode_attention(native_cache, layer, qkv, meta, spec, ATTENTION)
        close(actual, expected)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_float32_rows_narrow_into_the_cache_as_torch_rounds_them(native, kv_dtype):
    """A float32 model's K/V written into a 16-bit cache (bf16 is what `--dtype auto` keeps
    where it computes in float32): the native write rounds exactly as torch's cast, ties to
    even, infinities and NaNs included, in rows of whole vectors and with a tail."""
    for head_dim in (64, 20):
        spec = make_spec(4, 2, head_dim)
        shape = spec.kv_shape(kv_dtype)
        caches = [
            PagedKVCache(KVPool(KVPoolLayout(shape, 8, 4), torch.device("cpu")), torch.float32)
            for _ in range(2)
        ]
        qkv = torch.randn(6, spec.q_size + 2 * spec.kv_size) * 1e3
        # Exact ties between two bf16 values (a 1 in bit 15 only), and the specials.
        qkv[0, :8] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1e38 * 3.4, 0.0])[
            torch.arange(8) % 5
        ]
        specials = [float("inf"), float("-inf"), float("nan"), -0.0]
        qkv[1, spec.q_size : spec.q_size + 4] = torch.tensor(specials)
        slots = torch.tensor([0, 5, 9, 14, 22, 31])
        native.write_kv(caches[0], 0, qkv, slots, spec)
        TorchKernels().write_kv(caches[1], 0, qkv, slots, spec)
        for ours, theirs in zip(caches[0].pool.tensors(), caches[1].pool.tensors(), strict=True):
            nan = theirs.isnan()  # a NaN's payload is torch's own choice (it differs by path)
            assert torch.equal(ours.isnan(), nan)
            assert torch.equal(ours.view(torch.int16)[~nan], theirs.view(torch.int16)[~nan])


@pytest.mark.parametrize("shape", ["mha", "gqa", "wide"])
def test_decode_attention_with_scores_past_exps_range_matches_torch(native, shape):
    """Scores in the thousands overflow exp unless each partition subtracts its true peak
    first (a peak taken over part of a row gives inf / inf = NaN). Contexts put the largest
    score anywhere in a partition: its first lanes, past them, in a short tail partition."""
    spec = make_spec(*SHAPES[shape])
    contexts = [9, 130, 300]
    cache, blocks = fill_cache(native, spec, torch.float32, 16, contexts)
    for pool in cache.pool.tensors():
        pool.mul_(40.0)
    chunks = [SequenceChunk(ctx - 1, 1, ids) for ctx, ids in zip(contexts, blocks, strict=True)]
    meta = build_metadata(chunks, 16, torch.device("cpu"))
    width = spec.q_size + 2 * spec.kv_size
    qkv = torch.randn(len(contexts), width, generator=torch.Generator().manual_seed(7)) * 40.0
    expected = TorchKernels().decode_attention(cache, 0, qkv, meta, spec, ATTENTION)
    actual = native.decode_attention(cache, 0, qkv, meta, spec, ATTENTION)
    assert torch.isfinite(actual).all()
    # Scores this large carry float32 rounding of ~1e-4 into near-tied softmax weights of
    # values ~40 in size: compare at that scale (a wrong peak gives NaN, caught above).
    torch.testing.assert_close(actual, expected, rtol=1e-3, atol=0.05)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "float16", "bfloat16"])
def test_quantized_cache_decode_attention_matches_torch(native, kv_dtype):
    """int8 caches are read natively (scores scaled by the key scale, softmax weights by the
    value scale); fp8 ones defer to torch. Both backends write quantized caches alike. A
    float16 or bfloat16 cache under float32 compute (bf16: what `--dtype auto` keeps where
    it computes in float32) is widened as it is read."""
    spec = make_spec(9, 3, 64)
    shape = spec.kv_shape(kv_dtype)
    block_size, contexts = 4, [2, 9, 31, 300]  # 300: three 128-token partitions, merged
    cache = PagedKVCache(
        KVPool(KVPoolLayout(shape, 128, block_size), torch.device("cpu")), torch.float32
    )
    tables = BlockTables(128, seed=5)
    blocks = [tables.allocate(ctx, block_size) for ctx in contexts]
    width = spec.q_size + 2 * spec.kv_size
    for ctx, ids in zip(contexts, blocks, strict=True):
        slots = [ids[p // block_size] * block_size + p % block_size for p in range(ctx)]
        native.write_kv(cache, 0, torch.randn(ctx, width) * 3, torch.tensor(slots), spec)
    if kv_dtype in ("int8", "fp8"):
        assert cache.pool.key_scale is not None and cache.pool.key_scale[0].abs().sum() > 0
    chunks = [SequenceChunk(ctx - 1, 1, ids) for ctx, ids in zip(contexts, blocks, strict=True)]
    meta = build_metadata(chunks, block_size, torch.device("cpu"))
    qkv = torch.randn(len(contexts), width)
    expected = TorchKernels().decode_attention(cache, 0, qkv, meta, spec, ATTENTION)
    actual = native.decode_attention(cache, 0, qkv, meta, spec, ATTENTION)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


# (cached tokens before the chunk, new tokens): fresh prompts, chunks that start inside a
# block, a chunk longer than one query tile (64) and one longer than a key tile (128).
PREFILL_CHUNKS = [(0, 1), (0, 7), (3, 5), (17, 70), (40, 1), (0, 150), (130, 33)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [3, 16])  # 3: every chunk boundary inside a block
def test_prefill_attention_matches_torch(native, dtype, shape, block_size):
    """All of a step's prefill chunks in one native call (read through the block tables,
    causal within each chunk) equal torch's SDPA per chunk over the gathered context."""
    spec = make_spec(*SHAPES[shape])
    contexts = [cached + new for cached, new in PREFILL_CHUNKS]
    cache, blocks = fill_cache(native, spec, dtype, block_size, contexts)
    chunks = [
        SequenceChunk(cached, new, ids)
        for (cached, new), ids in zip(PREFILL_CHUNKS, blocks, strict=True)
    ]
    meta = build_metadata(chunks, block_size, torch.device("cpu"))
    rows = sum(new for _, new in PREFILL_CHUNKS)
    qkv = torch.randn(rows, spec.q_size + 2 * spec.kv_size).to(dtype)
    for layer in range(spec.num_layers):
        native.write_kv(cache, layer, qkv, meta.slots, spec)  # as the model does, first
        expected = TorchKernels().prefill_attention(cache, layer, qkv, meta, spec, ATTENTION)
        actual = native.prefill_attention(cache, layer, qkv, meta, spec, ATTENTION)
        close(actual, expected)


@pytest.mark.parametrize("shape", ["gqa", "mqa"])
def test_bf16_prefill_over_many_key_tiles_matches_float32_math(native, shape):
    """A bf16 model's prefill attention (bf16 tile products on CPUs with AVX512_BF16, float32
    ones elsewhere) against float32 math on the same bf16 cache and queries: long contexts
    (six key tiles), odd key counts and peaked softmaxes, so the running max and rescale
    across tiles are exercised, within the rounding of bf16 probabilities and output."""
    spec = make_spec(*SHAPES[shape])
    spans = [(700, 150), (0, 301), (129, 1), (255, 2)]
    contexts = [cached + new for cached, new in spans]
    cache, blocks = fill_cache(native, spec, torch.bfloat16, 16, contexts)
    chunks = [SequenceChunk(c, n, ids) for (c, n), ids in zip(spans, blocks, strict=True)]
    meta = build_metadata(chunks, 16, torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(meta.slots.numel(), spec.q_size + 2 * spec.kv_size, generator=generator) * 4
    qkv = qkv.to(torch.bfloat16)
    native.write_kv(cache, 0, qkv, meta.slots, spec)
    exact = PagedKVCache(cache.pool, torch.float32)  # the same bf16 cache, float32 compute
    exact_meta = build_metadata(chunks, 16, torch.device("cpu"))
    expected = TorchKernels().prefill_attention(exact, 0, qkv.float(), exact_meta, spec, ATTENTION)
    actual = native.prefill_attention(cache, 0, qkv, meta, spec, ATTENTION)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kv_dtype", ["int8", "float16", "bfloat16"])
def test_prefill_attention_reads_narrow_caches(native, kv_dtype):
    """An int8 cache (rows times their per-token scales) and a float16 or bfloat16 one under
    float32 compute give what torch computes from the same cache. (Every chunk here has a cached
    prefix: for a fresh prompt torch attends the unrounded new K/V, the native kernel the
    cached, rounded ones, as decode does later.)"""
    spec = make_spec(9, 3, 64)
    block_size = 4
    cache = PagedKVCache(
        KVPool(KVPoolLayout(spec.kv_shape(kv_dtype), 128, block_size), torch.device("cpu")),
        torch.float32,
    )
    tables = BlockTables(128, seed=7)
    spans = [(2, 9), (5, 20), (31, 4)]
    blocks = [tables.allocate(cached + new, block_size) for cached, new in spans]
    width = spec.q_size + 2 * spec.kv_size
    for (cached, new), ids in zip(spans, blocks, strict=True):
        ctx = cached + new
        slots = [ids[p // block_size] * block_size + p % block_size for p in range(ctx)]
        TorchKernels().write_kv(cache, 0, torch.randn(ctx, width) * 3, torch.tensor(slots), spec)
    chunks = [SequenceChunk(c, n, ids) for (c, n), ids in zip(spans, blocks, strict=True)]
    meta = build_metadata(chunks, block_size, torch.device("cpu"))
    qkv = torch.randn(sum(n for _, n in spans), width) * 3
    TorchKernels().write_kv(cache, 0, qkv, meta.slots, spec)
    expected = TorchKernels().prefill_attention(cache, 0, qkv, meta, spec, ATTENTION)
    actual = native.prefill_attention(cache, 0, qkv, meta, spec, ATTENTION)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_prefill_reads_an_int8_cache(native, head_dim):
    """A bf16 model over an int8 cache: the bf16 kernels (AMX tiles or vdpbf16ps) widen each
    row times its token's scale to bf16 before the products; float32 math on the same
    cache agrees within bf16 rounding (unit-variance rows: with peaked scores the widened
    keys' own bf16 rounding moves the softmax by more than the kernel's). Rows past a tile's
    keys and block-padding rows mix in (spans shorter than a tile, a span crossing several)."""
    spec = make_spec(2 * (256 // head_dim), 256 // head_dim, head_dim)
    block_size = 16
    pool = KVPool(KVPoolLayout(spec.kv_shape("int8"), 64, block_size), torch.device("cpu"))
    cache = PagedKVCache(pool, torch.bfloat16)
    tables = BlockTables(64, seed=5)
    spans = [(5, 45), (300, 20), (17, 3)]  # each with a cached prefix, as in the test above
    blocks = [tables.allocate(cached + new, block_size) for cached, new in spans]
    width = spec.q_size + 2 * spec.kv_size
    generator = torch.Generator().manual_seed(11)
    for (cached, _), ids in zip(spans, blocks, strict=True):
        slots = [ids[p // block_size] * block_size + p % block_size for p in range(cached)]
        rows = torch.randn(cached, width, generator=generator)
        TorchKernels().write_kv(cache, 0, rows.bfloat16(), torch.tensor(slots), spec)
    chunks = [SequenceChunk(c, n, ids) for (c, n), ids in zip(spans, blocks, strict=True)]
    meta = build_metadata(chunks, block_size, torch.device("cpu"))
    qkv = torch.randn(sum(n for _, n in spans), width, generator=generator).bfloat16()
    TorchKernels().write_kv(cache, 0, qkv, meta.slots, spec)  # the chunk's own K/V, first
    exact = PagedKVCache(pool, torch.float32)
    exact_meta = build_metadata(chunks, block_size, torch.device("cpu"))
    expected = TorchKernels().prefill_attention(exact, 0, qkv.float(), exact_meta, spec, ATTENTION)
    actual = native.prefill_attention(cache, 0, qkv, meta, spec, ATTENTION)
    torch.testing.assert_close(actual.float(), expected, atol=2e-2, rtol=2e-2)


def test_amx_prefill_only_where_the_cpu_has_it(native):
    """The AMX prefill kernel is on exactly where the CPU reports AMX-BF16 (Linux lists the
    flag only when it can hand out tile state) and no KVSERVE_CPU_ISA narrows the choice."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    expected = (
        " amx_bf16" in flags
        and bool(torch.ops.kvserve.bf16_linear_supported())
        and "KVSERVE_CPU_ISA" not in os.environ
    )
    assert bool(torch.ops.kvserve.amx_available()) == expected


def test_prefill_attention_after_decodes_uses_only_prefill_rows(native):
    """In a mixed step the decodes come first; the prefill kernel reads the rows after them."""
    spec = make_spec(4, 2, 16)
    contexts = [6, 12, 9]
    cache, blocks = fill_cache(native, spec, torch.float32, 4, contexts)
    chunks = [
        SequenceChunk(5, 1, blocks[0]),  # decode
        SequenceChunk(4, 8, blocks[1]),
        SequenceChunk(0, 9, blocks[2]),
    ]
    meta = build_metadata(chunks, 4, torch.device("cpu"))
    qkv = torch.randn(18, spec.q_size + 2 * spec.kv_size)
    native.write_kv(cache, 1, qkv, meta.slots, spec)
    expected = TorchKernels().prefill_attention(cache, 1, qkv, meta, spec, AttentionParams(0.25))
    actual = native.prefill_attention(cache, 1, qkv, meta, spec, AttentionParams(0.25))
    assert actual.shape == (17, spec.q_size)
    close(actual, expected)


def test_bad_slot_or_block_is_an_error_not_a_crash(native):
    spec = make_spec(4, 2, 16)
    cache, _ = fill_cache(native, spec, torch.float32, 4, [5])
    qkv = torch.randn(1, spec.q_size + 2 * spec.kv_size)
    with pytest.raises(RuntimeError, match="slot out of range"):
        native.write_kv(cache, 0, qkv, torch.tensor([256 * 4]), spec)
    meta = build_metadata([SequenceChunk(4, 1, [999, 1])], 4, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="block id out of range"):
        native.decode_attention(cache, 0, qkv, meta, spec, AttentionParams(0.25))


def test_select_kernels():
    cpu = torch.device("cpu")
    assert select_kernels("torch", cpu, torch.float32).name == "torch"
    assert select_kernels("native", cpu, torch.float32).name == "native"
    assert select_kernels("auto", cpu, torch.float32).name == "native"
    if torch.cuda.is_available():  # triton is in the dev extra
        assert select_kernels("auto", torch.device("cuda"), torch.float16).name == "triton"
    with pytest.raises(ValueError, match="--kernels native runs on the CPU only"):
        select_kernels("native", torch.device("cuda"), torch.float16)
    with pytest.raises(ValueError, match="--kernels must be one of"):
        select_kernels("fast", cpu, torch.float32)


def test_auto_on_cuda_without_triton_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(
        sys.modules, "engine.model.kernels.triton.triton_kernels", None
    )  # import fails
    assert select_kernels("auto", torch.device("cuda"), torch.float16).name == "torch"
    with pytest.raises(ValueError, match="needs triton installed"):
        select_kernels("triton", torch.device("cuda"), torch.float16)


@pytest.mark.parametrize("vocab", [64, 100, 49152])  # 100: a partial last bitmask word
def test_token_bitmask_matches_xgrammars_kernel(native, vocab):
    """Structured outputs' mask: the native kernel blocks exactly what xgrammar's does, on
    random words, all-allowed words (skipped) and all-blocked ones, in the chosen rows only,
    reading each row's mask from the row it names."""
    import xgrammar

    torch.manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32)
    bitmask[1, ::2] = -1
    bitmask[2, 1::3] = 0
    logits = torch.randn(6, vocab + 5)  # wider than the vocabulary, as a padded head is
    original = logits.clone()
    expected = logits.clone()
    rows = [0, 1, 2, 4]
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab, indices=rows)
    torch.ops.kvserve.apply_token_bitmask_(logits, bitmask, rows, rows, vocab)
    assert torch.equal(logits, expected)
    # Masks kept elsewhere (one row per sequence): row r of the logits takes mask row 5 - r.
    shuffled = original.clone()
    torch.ops.kvserve.apply_token_bitmask_(
        shuffled, bitmask.flip(0), rows, [5 - r for r in rows], vocab
    )
    assert torch.equal(shuffled, logits)
    assert torch.isinf(logits[0, :vocab]).any() and not torch.isinf(logits[3]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])  # K/V, int8 KV
def test_serial_block_copy_moves_whole_blocks_between_pools_of_any_size(native, dtype):
    """The tier writer's memcpy copy: block i of the source pool lands in block j of the
    target for every (layer, head), K/V ([.., blocks, block_size, head_dim]) and scales
    ([.., blocks, block_size]) alike; nothing else is written; bad ids are refused."""
    torch.manual_seed(1)
    for tail in ((4, 8), (4,)):
        src = torch.randint(-100, 100, (3, 2, 7, *tail)).to(dtype)
        dst = torch.randint(-100, 100, (3, 2, 5, *tail)).to(dtype)
        pairs = [(6, 0), (1, 4), (3, 2)]
        expected = dst.clone()
        for source, target in pairs:
            expected[:, :, target] = src[:, :, source]
        sources, targets = [p[0] for p in pairs], [p[1] for p in pairs]
        torch.ops.kvserve.copy_blocks_serial_(dst, src, sources, targets)
        assert torch.equal(dst, expected)
    with pytest.raises(RuntimeError, match="target block out of range"):
        torch.ops.kvserve.copy_blocks_serial_(dst, src, [0], [5])
