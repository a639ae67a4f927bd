"""`kvserve plan --enable-lora` against a built engine: the adapter bytes the plan computes
from the config alone are the slots the engine allocates, they sit inside the engine's
weight bytes, and the KV pool is sized around them as the server sizes it.

Tiny random models saved with SmolLM2's tokenizer: Llama (split projections), Qwen3 (head
dim apart from hidden / heads), Phi-3 (fused qkv_proj and gate_up_proj in the checkpoint)
and Mixtral (experts, which take no adapter).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from engine.builder import build_engine
from engine.config import EngineArgs, LoRAConfig
from server.plan import build_report
from tests.model.family_models import FAMILIES
from tests.model.test_family_serving import saved_model
from tests.model.test_weight_quant import parse_plan

pytestmark = pytest.mark.slow

KV_GIB = 4 / 1024
MAX_LEN = 256


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "mixtral"])
def test_plan_adapter_slots_are_the_engines(
    family: str, smollm_tokenizer: Any, tmp_path: Path
) -> None:
    saved_model(FAMILIES[family][0], smollm_tokenizer, tmp_path)
    flags = ["--model", str(tmp_path), "--device", "cpu", "--dtype", "float32"]
    flags += ["--kv-cache-memory", str(KV_GIB), "--max-model-len", str(MAX_LEN)]
    report = build_report(
        parse_plan(*flags, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
    )
    args = EngineArgs(
        model=str(tmp_path),
        device="cpu",
        dtype="float32",
        kv_cache_memory_gib=KV_GIB,
        max_model_len=MAX_LEN,
        swap_space_gib=0,
    )
    base = build_engine(args)
    built = build_engine(dataclasses.replace(args, lora=LoRAConfig(max_loras=2, max_lora_rank=8)))
    runtime = built.core.runner.lora
    assert runtime is not None
    assert report.lora_adapter_bytes == runtime.slot_bytes
    assert report.lora_slots_bytes == runtime.slot_bytes * 2
    # The slots are inside the engine's weight bytes (LoRALinear.nbytes), as in the plan's.
    assert built.weight_bytes == base.weight_bytes + report.lora_slots_bytes
    assert report.weight_bytes == built.weight_bytes
    # On the CPU --kv-cache-memory is the pool's own budget: the slots come on top of it,
    # and the plan's pool is the engine's, block for block.
    assert report.kv_budget_bytes == built.plan.kv_budget_bytes == base.plan.kv_budget_bytes
    assert report.num_blocks == built.plan.num_blocks
    assert built.plan.weight_bytes == built.weight_bytes
