"""`kvserve plan` on configs written by the test: figures checked against hand arithmetic."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from engine import cpu_features
from engine.kv.accounting import GIB, format_bytes
from server.plan import PlanReport, add_plan_parser, build_report, format_report, run_plan
from tests.conftest import smollm_gguf_path, tiny_llama_config


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_plan_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["plan", *argv])


def write_config(tmp_path: Path, **overrides: object) -> Path:
    """A model directory with only config.json: the plan must not need weights."""
    tiny_llama_config(**overrides).save_pretrained(tmp_path)
    assert not any(tmp_path.glob("*.safetensors"))
    return tmp_path


def llama_parameters(
    *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, tied: bool
) -> int:
    head_dim = hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    return vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_and_weight_bytes(tmp_path: Path, tied: bool) -> None:
    model = write_config(tmp_path, num_layers=3, num_kv_heads=2, tie_embeddings=tied)
    report = build_report(parse("--model", str(model), "--device", "cpu", "--dtype", "float16"))
    expected = llama_parameters(
        vocab=256, hidden=64, layers=3, heads=4, kv_heads=2, inter=128, tied=tied
    )
    assert report.num_parameters == expected
    assert report.weight_bytes == expected * 2


@pytest.mark.parametrize("tied", [True, False])
def test_a_classifier_is_planned_as_served(tmp_path: Path, tied: bool) -> None:
    """A *ForSequenceClassification checkpoint: no LM head of its own (the server reads
    the embedding), plus its score head [num_labels, hidden]."""
    config = tiny_llama_config(num_layers=3, num_kv_heads=2, tie_embeddings=tied)
    config.architectures = ["LlamaForSequenceClassification"]
    config.num_labels = 1
    config.save_pretrained(tmp_path)
    report = build_report(parse("--model", str(tmp_path), "--device", "cpu", "--dtype", "float16"))
    expected = llama_parameters(
        vocab=256, hidden=64, layers=3, heads=4, kv_heads=2, inter=128, tied=True
    )
    assert report.num_parameters == expected + 64
    assert report.weight_bytes == (expected + 64) * 2


@pytest.mark.parametrize(
    ("kv_dtype", "per_head_bytes"),
    [("float32", 16 * 4), ("float16", 16 * 2), ("int8", 16 + 4)],  # int8: + float32 scale
)
def test_bytes_per_token_follow_the_formula(
    tmp_path: Path, kv_dtype: str, per_head_bytes: int
) -> None:
    model = write_config(tmp_path, num_layers=3, num_kv_heads=2)  # head_dim = 64 / 4 = 16
    report = build_report(parse("--model", str(model), "--kv-cache-dtype", kv_dtype))
    assert report.bytes_per_token == 2 * 3 * 2 * per_head_bytes
    assert report.bytes_per_block == 16 * report.bytes_per_token


@pytest.mark.parametrize(("native_bf16", "cpu_dtype"), [(True, "bfloat16"), (False, "float32")])
def test_kv_dtype_auto_is_16_bit_whatever_dtype_auto_computes_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native_bf16: bool, cpu_dtype: str
) -> None:
    # Both CPU kinds on every machine: `--dtype auto` follows cpu_has_native_bf16(); where it
    # widens to float32 for speed, the cache stays bf16 (half the bytes every token costs).
    monkeypatch.setattr(cpu_features, "cpu_has_native_bf16", lambda: native_bf16)
    model = str(write_config(tmp_path))
    cpu = build_report(parse("--model", model, "--device", "cpu"))
    assert (cpu.dtype, cpu.kv_cache_dtype) == (cpu_dtype, "bfloat16")
    cuda = build_report(parse("--model", model, "--device", "cuda"))
    assert (cuda.dtype, cuda.kv_cache_dtype) == ("bfloat16", "bfloat16")


def test_an_explicit_float32_dtype_keeps_a_float32_cache(tmp_path: Path) -> None:
    model = str(write_config(tmp_path))
    report = build_report(parse("--model", model, "--device", "cpu", "--dtype", "float32"))
    assert (report.dtype, report.kv_cache_dtype) == ("float32", "float32")
    narrowed = build_report(
        parse("--model", model, "--dtype", "float32", "--kv-cache-dtype", "bfloat16")
    )
    assert narrowed.bytes_per_token * 2 == report.bytes_per_token


def test_sequences_demand_and_fit(tmp_path: Path) -> None:
    model = str(write_config(tmp_path, num_layers=2, num_kv_heads=2))
    per_token = 2 * 2 * 2 * 16 * 4

    def plan(concurrency: int) -> PlanReport:
        flags = [
            "--model",
            model,
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-model-len",
            "1000",
        ]
        flags += ["--avg-len", "100", "--block-size", "16", "--num-kv-blocks", "640"]
        return build_report(parse(*flags, "-c", str(concurrency)))

    report = plan(90)
    assert report.at_max_len.blocks == 63  # ceil(1000 / 16)
    assert report.at_max_len.payload_bytes == 1000 * per_token
    assert report.at_max_len.padding_bytes == (63 * 16 - 1000) * per_token
    assert report.at_avg_len.blocks == 7  # ceil(100 / 16)
    assert report.demand_blocks == 90 * 7
    assert report.demand_bytes == 90 * 7 * 16 * per_token
    assert report.fits  # 630 <= 640 blocks
    assert report.max_concurrency_at_avg_len == 640 // 7
    assert report.max_concurrency_at_max_len == 640 // 63
    assert report.token_capacity == 640 * 16
    assert not plan(92).fits  # 644 > 640 blocks


def test_memory_budget_sizes_the_pool(tmp_path: Path) -> None:
    model = write_config(tmp_path)
    args = parse(
        "--model", str(model), "--device", "cpu", "--dtype", "float32", "--memory", "0.5",
        "--activation-reserve", "0.125", "--max-model-len", "512",
    )  # fmt: skip
    report = build_report(args)
    weights = report.num_parameters * 4
    staging = report.copy_staging_bytes  # the block-copy buffer comes out of --memory
    assert 0 < staging <= 8 * 1024 * 1024
    kv_budget = GIB // 2 - weights - GIB // 8 - staging
    assert report.kv_budget_bytes == kv_budget
    assert f"copy staging {format_bytes(staging)}" in format_report(report)
    assert report.num_blocks == kv_budget // report.bytes_per_block
    assert report.kv_pool_bytes == report.num_blocks * report.bytes_per_block


def test_memory_on_cuda_is_scaled_by_the_utilization(tmp_path: Path) -> None:
    model = str(write_config(tmp_path))
    flags = ["--model", model, "--device", "cuda", "--memory", "1", "--activation-reserve", "0"]
    report = build_report(parse(*flags, "--gpu-memory-utilization", "0.5"))
    assert report.memory_budget_bytes == GIB // 2
    assert report.kv_budget_bytes == GIB // 2 - report.weight_bytes - report.copy_staging_bytes


def test_kv_cache_memory_mirrors_serve_on_cpu(tmp_path: Path) -> None:
    model = write_config(tmp_path)
    report = build_report(parse("--model", str(model), "--kv-cache-memory", "0.25"))
    assert report.kv_budget_bytes == GIB // 4
    assert report.num_blocks == (GIB // 4) // report.bytes_per_block


def test_a_budget_below_the_weights_does_not_fit(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    model = write_config(tmp_path)
    assert run_plan(parse("--model", str(model), "--memory", "0.0001")) == 1
    assert "fits                NO" in capsys.readouterr().out


def test_json_output(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    model = write_config(tmp_path)
    assert run_plan(parse("--model", str(model), "--json", "--max-model-len", "256")) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["max_model_len"] == 256
    assert data["at_max_len"]["blocks"] == 16
    assert data["fits"] is True
    assert data["bytes_per_block"] == data["bytes_per_token"] * data["block_size"]


def test_text_output_names_every_figure(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    model = write_config(tmp_path)
    assert run_plan(parse("--model", str(model), "-c", "4", "--avg-len", "300")) == 0
    out = capsys.readouterr().out
    for words in ("bytes per token", "per seq (max len)", "per seq (avg len)", "demand at C=4",
                  "weights", "budget", "KV pool", "fits", "max concurrency"):  # fmt: skip
        assert words in out


def test_bad_input_exits_2_with_a_message(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert run_plan(parse("--model", str(tmp_path / "missing"))) == 2
    assert "does not exist" in capsys.readouterr().err
    assert run_plan(parse("--model", str(write_config(tmp_path)), "-c", "0")) == 2
    assert "--concurrency must be >= 1" in capsys.readouterr().err
    assert run_plan(parse("--model", str(tmp_path), "--gpu-memory-utilization", "1.5")) == 2
    assert "--gpu-memory-utilization" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--memory", "1", "--num-kv-blocks", "5")  # mutually exclusive budgets


@pytest.mark.slow
def test_embedded_gguf_reads_metadata_only() -> None:
    gguf = smollm_gguf_path()
    report = build_report(parse("--device", "cpu", "--dtype", "float32", "--max-model-len", "2048"))
    assert str(gguf) in report.config_source
    assert (report.num_layers, report.num_kv_heads, report.head_dim) == (30, 3, 64)
    # SmolLM2-135M: tied embeddings, 49152 x 576 vocabulary, 30 layers of 9/3 heads.
    expected = llama_parameters(
        vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, inter=1536, tied=True
    )
    assert report.num_parameters == expected
    assert report.weight_bytes == expected * 4
    assert "dequantised to float32" in report.weights_note
    assert report.bytes_per_token == 2 * 30 * 3 * 64 * 4


def write_gemma3_config(tmp_path: Path, window: int = 1024) -> Path:
    """A Gemma-3-shaped text config: 12 layers, five sliding to one global."""
    from transformers import Gemma3TextConfig

    Gemma3TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=window,
        max_position_embeddings=32768,
    ).save_pretrained(tmp_path)
    return tmp_path


def test_a_hybrid_model_plans_per_group_and_against_an_all_full_cache(tmp_path: Path) -> None:
    model = write_gemma3_config(tmp_path)
    flags = ("--model", str(model), "--max-model-len", "8192", "--kv-cache-dtype", "bfloat16")
    hybrid = build_report(parse(*flags, "--kv-cache-memory", "1"))
    full = build_report(
        parse(*flags, "--kv-cache-memory", "1", "--disable-hybrid-kv-cache-manager")
    )
    # 12 layers, 10 sliding and 2 global: five sliding groups and one global of 2 layers.
    assert [g["kind"] for g in hybrid.kv_groups] == ["sliding_1024"] * 5 + ["full"]
    assert all(g["layers"] == 2 for g in hybrid.kv_groups)
    sliding_blocks = -(-(1024 - 1) // 16) + 1
    assert [g["blocks_at_max_len"] for g in hybrid.kv_groups] == [sliding_blocks] * 5 + [512]
    # A block is a page of 2 layers (bytes per token still counts all 12 layers).
    per_layer_token = 2 * 1 * 16 * 2
    assert hybrid.bytes_per_token == 12 * per_layer_token
    assert hybrid.bytes_per_block == 2 * per_layer_token * 16
    assert hybrid.at_max_len.blocks == 5 * sliding_blocks + 512
    payload = 10 * per_layer_token * 1024 + 2 * per_layer_token * 8192
    assert hybrid.at_max_len.payload_bytes == payload
    # The same KV budget: whole 2-layer pages vs whole 12-layer blocks.
    assert hybrid.max_concurrency_at_max_len == hybrid.num_blocks // (5 * sliding_blocks + 512)
    assert full.kv_groups == () and full.at_max_len.blocks == 512
    assert hybrid.all_full_max_concurrency_at_max_len == full.max_concurrency_at_max_len
    predicted = (12 * 512) / (2 * (5 * sliding_blocks + 512))
    assert hybrid.hybrid_capacity_gain == pytest.approx(predicted, rel=1e-3)
    assert hybrid.max_concurrency_at_max_len / full.max_concurrency_at_max_len == pytest.approx(
        predicted, rel=0.05
    )
    text = format_report(hybrid)
    assert "KV group 5" in text and "hybrid KV cache" in text


# --- LoRA adapters ---------------------------------------------------------------------

LORA = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "5")


def adapter_bytes(
    *, layers: int, hidden: int, q: int, kv: int, inter: int, rank: int, dtype_bytes: int
) -> int:
    """One adapter slot by hand: for each projection A [parts * rank, in] and B [parts *
    rank, out], rank padded to --max-lora-rank; qkv has three parts, gate_up two."""
    projections = [(hidden, q + 2 * kv, 3), (q, hidden, 1)]
    if inter:
        projections += [(hidden, 2 * inter, 2), (inter, hidden, 1)]
    per_layer = sum(parts * rank * (fan_in + fan_out) for fan_in, fan_out, parts in projections)
    return layers * per_layer * dtype_bytes


def test_lora_slots_count_as_weights_and_the_host_cache_apart(tmp_path: Path) -> None:
    model = str(write_config(tmp_path, num_layers=3, num_kv_heads=2))
    flags = ("--model", model, "--device", "cpu", "--dtype", "float16")
    base = build_report(parse(*flags))
    report = build_report(parse(*flags, *LORA))
    adapter = adapter_bytes(layers=3, hidden=64, q=64, kv=32, inter=128, rank=8, dtype_bytes=2)
    assert report.lora_adapter_bytes == adapter
    assert (report.lora_max_loras, report.lora_max_rank) == (2, 8)
    assert report.lora_slots_bytes == 2 * adapter
    assert (report.lora_host_adapters, report.lora_host_cache_bytes) == (5, 5 * adapter)
    assert {"q_proj", "o_proj", "up_proj", "down_proj"} <= set(report.lora_modules)
    # The engine counts its slots in its weight bytes; a base-model decode reads none.
    assert report.weight_bytes == base.weight_bytes + 2 * adapter
    assert report.num_parameters == base.num_parameters
    assert report.active_weight_bytes == base.active_weight_bytes
    # --kv-cache-memory is the KV pool's own budget (as serve on the CPU): unchanged.
    assert report.kv_budget_bytes == base.kv_budget_bytes
    assert report.num_blocks == base.num_blocks
    assert (base.lora_max_loras, base.lora_slots_bytes, base.lora_modules) == (0, 0, ())


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_lora_slots_come_out_of_a_memory_budget(tmp_path: Path, device: str) -> None:
    """With --memory (on CUDA: a fraction of the device, as serve sizes it) the slots take
    their bytes from the KV pool."""
    model = str(write_config(tmp_path))
    flags = ("--model", model, "--device", device, "--dtype", "float32", "--memory", "0.5")
    flags += ("--activation-reserve", "0.125")
    base = build_report(parse(*flags))
    report = build_report(parse(*flags, *LORA))
    assert report.lora_slots_bytes > 0
    assert report.memory_budget_bytes == base.memory_budget_bytes
    assert report.kv_budget_bytes == base.kv_budget_bytes - report.lora_slots_bytes
    assert report.num_blocks == report.kv_budget_bytes // report.bytes_per_block


def test_an_moe_model_takes_adapters_on_attention_only(tmp_path: Path) -> None:
    """The experts take no adapter: the slot holds qkv and o_proj."""
    from transformers import MixtralConfig

    MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=1024,
    ).save_pretrained(tmp_path)  # fmt: skip
    flags = ("--model", str(tmp_path), "--device", "cpu", "--dtype", "float32", "--enable-lora")
    report = build_report(parse(*flags))
    assert report.experts == "2 of 4 experts a layer"
    assert report.lora_adapter_bytes == adapter_bytes(
        layers=2, hidden=64, q=64, kv=32, inter=0, rank=16, dtype_bytes=4
    )
    assert (report.lora_max_loras, report.lora_host_adapters) == (1, 1)  # the defaults
    assert "gate_proj" not in report.lora_modules


def test_lora_in_the_text_and_json_output(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    model = str(write_config(tmp_path))
    assert run_plan(parse("--model", model, "--dtype", "float32", *LORA)) == 0
    out = capsys.readouterr().out
    report = build_report(parse("--model", model, "--dtype", "float32", *LORA))
    slots = format_bytes(report.lora_slots_bytes)
    assert f"LoRA slots          2 x {format_bytes(report.lora_adapter_bytes)}" in out
    assert f"= {slots}, with the weights: {format_bytes(report.weight_bytes)} in all" in out
    assert f"5 adapters = {format_bytes(report.lora_host_cache_bytes)} of host memory" in out
    without = report.weight_bytes - report.lora_slots_bytes
    assert f"parameters = {format_bytes(without)}" in out
    assert run_plan(parse("--model", model, "--json", *LORA)) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["lora_slots_bytes"] == 2 * data["lora_adapter_bytes"] > 0
    assert data["lora_host_cache_bytes"] == 5 * data["lora_adapter_bytes"]
    assert run_plan(parse("--model", model)) == 0
    assert "LoRA" not in capsys.readouterr().out


def test_bad_lora_flags_exit_2(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    model = str(write_config(tmp_path))
    assert run_plan(parse("--model", model, "--lora-modules", "a=/adapters/a")) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
    assert run_plan(parse("--model", model, "--enable-lora", "--max-loras", "0")) == 2
    assert "max_loras must be >= 1" in capsys.readouterr().err
