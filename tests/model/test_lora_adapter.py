"""Reading PEFT adapter directories: the slot layout, the scaling rules, and a clear
``LoRAError`` for everything kvserve cannot serve (written by hand, no peft needed)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from engine.lora.adapter import LoRAError, fingerprint, read_adapter
from engine.lora.catalog import LoRACatalog
from engine.lora.targets import LoRATargets

# Two layers, hidden 8, 2 query heads and 1 KV head of 4, MLP 12.
TARGETS = LoRATargets.for_decoder(2, hidden=8, q_size=8, kv_size=4, inter=12, max_rank=4)
PREFIX = "base_model.model.model.layers"


def write_adapter(
    path: Path, tensors: dict[str, torch.Tensor], **config: Any
) -> Path:  # a PEFT directory
    path.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(settings | config))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def module(layer: int, name: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    key = f"{PREFIX}.{layer}.{part}.{name}"
    return {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b}


def test_parts_of_fused_projections_land_in_their_rows_scaled_by_alpha_over_r(
    tmp_path: Path,
) -> None:
    a_k, b_k = torch.randn(2, 8), torch.randn(4, 2)
    a_up, b_up = torch.randn(2, 8), torch.randn(12, 2)
    tensors = module(1, "k_proj", a_k, b_k) | module(0, "up_proj", a_up, b_up)
    adapter = read_adapter(write_adapter(tmp_path, tensors), TARGETS, torch.float32)
    assert set(adapter.slots) == {(1, "qkv"), (0, "gate_up")}
    a, bt = adapter.slots[(1, "qkv")]
    assert a.shape == (3 * 4, 8) and bt.shape == (3 * 4, 16)  # 3 parts of max rank 4
    # k is part 1: A rows 4..6, B columns 8..12 (after q's 8), scale 4 / 2.
    delta = bt.T @ a
    expected = torch.zeros(16, 8)
    expected[8:12] = 2.0 * b_k @ a_k
    torch.testing.assert_close(delta, expected)
    a, bt = adapter.slots[(0, "gate_up")]
    torch.testing.assert_close((bt.T @ a)[12:], 2.0 * b_up @ a_up)  # up is the second part
    assert not (bt.T @ a)[:12].any()


def test_rslora_and_alpha_pattern_scale_as_peft_does(tmp_path: Path) -> None:
    a, b = torch.randn(2, 8), torch.randn(8, 2)
    tensors = module(0, "q_proj", a, b) | module(0, "o_proj", torch.randn(2, 8), torch.randn(8, 2))
    path = write_adapter(tmp_path, tensors, use_rslora=True, alpha_pattern={"o_proj": 1.0})
    adapter = read_adapter(path, TARGETS, torch.float32)
    q_a, q_bt = adapter.slots[(0, "qkv")]
    torch.testing.assert_close((q_bt.T @ q_a)[:8], 4 / math.sqrt(2) * b @ a)
    o_a, o_bt = adapter.slots[(0, "o_proj")]
    o_in, o_out = (
        tensors[f"{PREFIX}.0.self_attn.o_proj.lora_A.weight"],
        tensors[f"{PREFIX}.0.self_attn.o_proj.lora_B.weight"],
    )
    torch.testing.assert_close(o_bt.T @ o_a, 1 / math.sqrt(2) * o_out @ o_in)


def test_fingerprint_follows_the_files(tmp_path: Path) -> None:
    tensors = module(0, "q_proj", torch.ones(2, 8), torch.ones(8, 2))
    first = fingerprint(write_adapter(tmp_path / "one", tensors))
    assert fingerprint(write_adapter(tmp_path / "two", tensors)) == first
    tensors = module(0, "q_proj", torch.ones(2, 8), torch.full((8, 2), 2.0))
    assert fingerprint(write_adapter(tmp_path / "three", tensors)) != first


def good_tensors() -> dict[str, torch.Tensor]:
    return module(0, "q_proj", torch.randn(2, 8), torch.randn(8, 2))


def good_adapter(path: Path, **config: Any) -> Path:
    return write_adapter(path, good_tensors(), **config)


def replaced(path: Path, name: str, content: bytes | None) -> Path:
    """A good adapter with file ``name`` overwritten (None: deleted)."""
    good_adapter(path)
    if content is None:
        (path / name).unlink()
    else:
        (path / name).write_bytes(content)
    return path


def with_modules(path: Path, **modules: tuple[tuple[int, int], tuple[int, int]]) -> Path:
    """An adapter of ``key=(A shape, B shape)`` tensors (keys relative to the PEFT root)."""
    tensors = {}
    for key, (a, b) in modules.items():
        name = key.replace("__", ".")
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(*a)
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(*b)
    return write_adapter(path, tensors)


def half_module(path: Path) -> Path:
    return write_adapter(path, {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 8)})


BAD_ADAPTERS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "no directory": (lambda p: p / "missing", "is not a directory"),
    "no config": (lambda p: replaced(p, "adapter_config.json", None), "no adapter_config.json"),
    "config not JSON": (lambda p: replaced(p, "adapter_config.json", b"{"), "not valid JSON"),
    "no weights": (lambda p: replaced(p, "adapter_model.safetensors", None), "no adapter weights"),
    "truncated weights": (
        lambda p: replaced(p, "adapter_model.safetensors", bytes(12)),
        "cannot read",
    ),
    "prefix tuning": (lambda p: good_adapter(p, peft_type="PREFIX_TUNING"), "LORA"),
    "dora": (lambda p: good_adapter(p, use_dora=True), "DoRA"),
    "trained bias": (lambda p: good_adapter(p, bias="lora_only"), "biases"),
    "modules to save": (lambda p: good_adapter(p, modules_to_save=["lm_head"]), "modules_to_save"),
    "rank over the maximum": (
        lambda p: with_modules(p, model__layers__0__self_attn__q_proj=((8, 8), (8, 8))),
        "exceeds --max-lora-rank 4",
    ),
    "a module the base lacks": (
        lambda p: with_modules(p, model__layers__0__attn__c_attn=((2, 8), (24, 2))),
        "does not have as a LoRA target",
    ),
    "the LM head": (lambda p: with_modules(p, lm_head=((2, 8), (32, 2))), "LM-head"),
    "another model's shapes": (
        lambda p: with_modules(p, model__layers__0__self_attn__q_proj=((2, 16), (16, 2))),
        "do not match the base model",
    ),
    "a layer past the base": (
        lambda p: with_modules(p, model__layers__5__self_attn__q_proj=((2, 8), (8, 2))),
        "the base has 2",
    ),
    "A without B": (half_module, "lora_A or lora_B alone"),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_an_adapter_kvserve_cannot_serve_is_refused_saying_why(case: str, tmp_path: Path) -> None:
    make, message = BAD_ADAPTERS[case]
    path = make(tmp_path / "adapter")
    with pytest.raises(LoRAError, match=message):
        read_adapter(path, TARGETS, torch.float32)
    with pytest.raises(LoRAError, match=message):  # and the catalog serves nothing
        LoRACatalog(TARGETS, torch.float32).load("mine", str(path))


def test_catalog_ids_are_never_reused_and_names_are_unique(tmp_path: Path) -> None:
    catalog = LoRACatalog(TARGETS, torch.float32)
    path = str(write_adapter(tmp_path / "a", good_tensors()))
    first = catalog.load("mine", path)
    with pytest.raises(LoRAError, match="already loaded"):
        catalog.load("mine", path)
    catalog.unload("mine")
    again = catalog.load("mine", path)
    assert again.id != first.id and again.fingerprint == first.fingerprint
    assert catalog.adapters() == (again,) and catalog.get("mine") == again
    with pytest.raises(KeyError):
        catalog.unload("other")
    for bad in ("", "a,b", " padded"):  # the gateway's gauge lists names comma-separated
        with pytest.raises(LoRAError, match="without commas"):
            catalog.load(bad, path)
