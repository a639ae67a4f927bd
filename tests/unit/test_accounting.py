"""The worked examples of the KV arithmetic, pinned."""

import pytest

from engine.kv import accounting as acc

SHAPE = acc.KVShape(num_layers=24, num_kv_heads=8, head_dim=128, kv_dtype="bfloat16")


def test_payload_of_1000_tokens_is_93_75_mib() -> None:
    assert acc.payload_bytes(SHAPE, 1000) == 98_304_000
    assert acc.payload_bytes(SHAPE, 1000) / acc.MIB == 93.75


def test_payload_scales_linearly_with_sequences_and_tokens() -> None:
    one = acc.payload_bytes(SHAPE, 1000)
    assert 10 * one == sum(acc.payload_bytes(SHAPE, 1000) for _ in range(10))
    assert acc.payload_bytes(SHAPE, 4000) == 4 * one


def test_17_tokens_in_16_token_blocks() -> None:
    assert acc.blocks_for_tokens(17, 16) == 2
    assert acc.padding_slots(17, 16) == 15
    assert acc.padding_slots(32, 16) == 0
    assert acc.blocks_for_tokens(0, 16) == 0


def test_quantized_cache_counts_scales() -> None:
    int8 = acc.KVShape(24, 8, 128, "int8")
    # 1 byte per element plus one float32 scale per token, head, K/V and layer.
    assert acc.bytes_per_token(int8) == 2 * 24 * 8 * (128 + 4)
    assert acc.bytes_per_token(int8) < acc.bytes_per_token(SHAPE)


def test_capacity_plan() -> None:
    per_block = acc.bytes_per_block(SHAPE, 16)
    plan = acc.plan_capacity(
        SHAPE,
        memory_budget_bytes=10 * acc.GIB,
        weight_bytes=4 * acc.GIB,
        activation_reserve_bytes=1 * acc.GIB,
        block_size=16,
        max_model_len=4096,
        avg_len=1000,
    )
    staging = acc.copy_staging_bytes(SHAPE, 16, acc.COPY_STAGING_BYTES)
    assert plan.copy_staging_bytes == staging > 0
    assert plan.kv_budget_bytes == 5 * acc.GIB - staging
    assert plan.num_blocks == (5 * acc.GIB - staging) // per_block
    assert plan.token_capacity == plan.num_blocks * 16
    assert plan.max_seqs_at_max_len == plan.num_blocks // 256
    assert plan.max_seqs_at_avg_len == plan.num_blocks // 63
    assert plan.kv_pool_bytes <= plan.kv_budget_bytes


def test_capacity_plan_override_and_overcommit() -> None:
    plan = acc.plan_capacity(
        SHAPE,
        memory_budget_bytes=1,
        weight_bytes=10,
        activation_reserve_bytes=0,
        block_size=16,
        max_model_len=64,
    )
    assert plan.num_blocks == 0 and not plan.fits_one_max_len_sequence
    plan = acc.plan_capacity(
        SHAPE,
        memory_budget_bytes=0,
        weight_bytes=0,
        activation_reserve_bytes=0,
        block_size=16,
        max_model_len=64,
        num_blocks_override=8,
    )
    assert plan.num_blocks == 8 and plan.max_seqs_at_max_len == 2


def test_copy_staging_holds_whole_layer_blocks_within_its_bound() -> None:
    # One layer's K of one block: 8 heads x 16 tokens x 128 dims x 2 bytes = 32 KiB.
    assert acc.copy_chunk_blocks(SHAPE, 16, 8 * acc.MIB) == 256
    assert acc.copy_staging_bytes(SHAPE, 16, 8 * acc.MIB) == 8 * acc.MIB
    assert acc.copy_chunk_blocks(SHAPE, 16, 1) == 1  # never below one block
    assert acc.copy_staging_bytes(SHAPE, 16, 1) == 32 * 1024
    # int8 with head_dim 2: the float32 scale (4 bytes) outweighs the values (2 bytes).
    tiny = acc.KVShape(1, 1, 2, "int8")
    assert acc.copy_staging_bytes(tiny, 4, 1) == 4 * 4


def test_unknown_dtype_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        acc.KVShape(1, 1, 1, "float64")


@pytest.mark.parametrize(
    ("kv_cache_dtype", "serving", "requested", "expected"),
    [
        ("auto", "bfloat16", "auto", "bfloat16"),
        ("auto", "float32", "auto", "bfloat16"),  # widened for arithmetic, not for the cache
        ("auto", "float32", "float32", "float32"),  # asked for by name
        ("auto", "float16", "float16", "float16"),
        ("float32", "float32", "auto", "float32"),
        ("int8", "bfloat16", "auto", "int8"),
    ],
)
def test_kv_dtype_resolution(
    kv_cache_dtype: str, serving: str, requested: str, expected: str
) -> None:
    assert acc.resolve_kv_dtype(kv_cache_dtype, serving, requested) == expected


def test_an_unknown_kv_cache_dtype_is_named_in_the_error() -> None:
    with pytest.raises(ValueError, match="'float64'"):
        acc.resolve_kv_dtype("float64", "float32", "auto")


def test_format_bytes() -> None:
    assert acc.format_bytes(98_304_000) == "93.75 MiB"
    assert acc.format_bytes(12) == "12 B"
