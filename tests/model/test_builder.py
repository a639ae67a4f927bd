"""build_engine: load, profile, plan, allocate and serve a tiny HF-directory model."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import builder
from engine.builder import BuiltEngine, build_engine, find_embedded_model, resolve_dtype
from engine.config import EngineArgs
from engine.kv import accounting
from engine.request import FinishReason, Request, SamplingParams, StructuredOutputs

SMALL_KV_GIB = 4 / 1024  # 4 MiB of KV: a few hundred blocks of the tiny model


# Every dtype a CPU serves, forced: `--dtype auto` picks one by the CPU's features, so a
# test that left it to auto would check a different path on each machine.
CPU_DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module", params=CPU_DTYPES)
def built(request, tiny_model_dir) -> BuiltEngine:
    args = EngineArgs(
        model=str(tiny_model_dir),
        device="cpu",
        dtype=request.param,
        kv_cache_memory_gib=SMALL_KV_GIB,
        max_model_len=256,
        max_num_batched_tokens=256,
        swap_space_gib=1 / 1024,
    )
    return build_engine(args)


def test_plan_matches_the_allocated_pools(built):
    plan, shape = built.plan, built.kv_shape
    assert built.device == "cpu" and built.dtype in CPU_DTYPES
    assert shape == accounting.KVShape(2, 2, 16, built.dtype)
    assert plan.bytes_per_block == accounting.bytes_per_block(shape, 16)
    assert plan.kv_budget_bytes == int(SMALL_KV_GIB * accounting.GIB)
    assert plan.num_blocks == plan.kv_budget_bytes // plan.bytes_per_block
    assert plan.activation_reserve_bytes > 0
    runner = built.core.runner
    assert runner.device_pool.nbytes == plan.kv_pool_bytes
    assert runner.host_pool.layout.num_blocks == accounting.GIB // 1024 // plan.bytes_per_block
    assert built.core.scheduler.cache_config.num_device_blocks == plan.num_blocks
    assert built.weight_bytes == runner.model.weights.nbytes
    assert built.eos_token_ids == (built.tokenizer.eos_token_id,)
    assert built.max_model_len == 256


def test_generates_through_the_core(built):
    text = built.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
    )
    prompt = built.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    built.core.add_request([Request("r1", prompt, params, eos_token_ids=built.eos_token_ids)])
    tokens = []
    while built.core.has_unfinished():
        for delta in built.core.step():
            tokens += delta.new_token_ids
    assert len(tokens) == 5
    assert all(0 <= t < len(built.tokenizer) for t in tokens)


def test_the_grammar_compiler_feeds_the_runner(built):
    """The server compiles through ``built.grammar_compiler``; the runner then finds the
    grammar in the same cache instead of compiling again."""
    compiler = built.grammar_compiler
    assert compiler is not None and compiler.vocab_size == built.core.runner.model.spec.vocab_size
    spec = StructuredOutputs.choice(["red", "green", "blue"])
    compiler.compile(spec)
    params = SamplingParams(max_tokens=10, temperature=0.0, structured_outputs=spec)
    built.core.add_request([Request("g1", [1, 2, 3], params, eos_token_ids=built.eos_token_ids)])
    tokens, finish = [], None
    while built.core.has_unfinished():
        for delta in built.core.step():
            tokens += delta.new_token_ids
            finish = delta.finish_reason
    assert built.tokenizer.decode(tokens) in ("red", "green", "blue")
    assert finish is FinishReason.STOP and compiler.num_compiled == 1


def test_startup_log_reports_the_accounting(tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="kvserve.engine")
    args = EngineArgs(
        model=str(tiny_model_dir), dtype="float32", num_kv_blocks=40, max_model_len=64
    )
    built = build_engine(args)
    text = caplog.text
    assert built.plan.num_blocks == 40
    assert "40 blocks x 16 tokens = 640 tokens" in text
    assert accounting.format_bytes(built.weight_bytes) in text
    assert "max concurrent sequences at max_model_len 64: 10" in text


@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        (dict(num_kv_blocks=3, max_model_len=256), "--num-kv-blocks"),
        (dict(kv_cache_memory_gib=1e-5, max_model_len=256), "--kv-cache-memory"),
    ],
)
def test_cache_too_small_for_one_sequence_names_the_flag(tiny_model_dir, overrides, flag):
    with pytest.raises(ValueError, match=flag) as info:
        build_engine(EngineArgs(model=str(tiny_model_dir), dtype="float32", **overrides))
    assert "--max-model-len" in str(info.value)


def test_max_model_len_beyond_the_model_is_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match="--max-model-len"):
        build_engine(EngineArgs(model=str(tiny_model_dir), max_model_len=4096))


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        build_engine(EngineArgs(model=str(tmp_path / "nope")))


def test_embedded_model_is_found():
    path = find_embedded_model()
    assert path.suffix == ".gguf" and path.is_file()


@pytest.mark.parametrize(
    ("native_bf16", "expected"), [(True, torch.bfloat16), (False, torch.float32)]
)
def test_auto_dtype_follows_the_cpu_features(monkeypatch, native_bf16, expected):
    """`--dtype auto` on a CPU: bfloat16 with bf16 matrix units (AVX512-BF16, AMX), float32
    without them; both branches run on every machine, whatever its CPU."""
    monkeypatch.setattr(builder, "cpu_has_native_bf16", lambda: native_bf16)
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
