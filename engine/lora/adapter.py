"""Reading a PEFT LoRA adapter directory into kvserve's slot layout.

A PEFT adapter is ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``,
``target_modules``, ...) beside ``adapter_model.safetensors`` (or ``.bin``) holding, per
targeted module, ``...layers.<i>.<...>.<module>.lora_A.weight`` ``[r, in]`` and
``lora_B.weight`` ``[out, r]``. ``read_adapter`` checks it against the base
(``LoRATargets``) and returns each projection's slot: A rows and B transposed, scaled by
``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), padded to the slot width, in the model's
dtype. Everything it cannot serve is a ``LoRAError`` that says what to change: a missing or
malformed directory, DoRA, trained biases or ``modules_to_save``, a rank above
``--max-lora-rank``, a module the base lacks, a shape that does not match the base.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.lora.targets import HF_MODULES, LoRATargets, Projection

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:[\w.]+\.)?(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoRAError(ValueError):
    """An adapter kvserve cannot serve; the message says why and what to change."""


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of ``adapter_config.json`` kvserve reads."""

    alpha: float
    rslora: bool
    alpha_pattern: dict[str, float]

    def scale(self, module: str, rank: int) -> float:
        """``alpha / r`` for ``module`` (``alpha / sqrt(r)`` with rsLoRA), as PEFT scales."""
        alpha = _pattern_value(self.alpha_pattern, module, self.alpha)
        return alpha / math.sqrt(rank) if self.rslora else alpha / rank


@dataclass
class LoRAAdapter:
    """One adapter in slot layout: ``slots[(layer, projection)] = (a, bt)`` with ``a``
    ``[width, in]`` and ``bt`` ``[width, out]`` (projections it does not target are absent),
    and the ``fingerprint`` of the files it was read from."""

    rank: int
    slots: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    fingerprint: str


def read_adapter(path: str | Path, targets: LoRATargets, dtype: torch.dtype) -> LoRAAdapter:
    """The adapter at ``path`` in slot layout for a base with ``targets``; each file is
    read once, for the tensors and the fingerprint alike."""
    path = Path(path)
    config_bytes = _config_bytes(path)
    config = _parse_config(_json_object(config_bytes, path / CONFIG_FILE), path / CONFIG_FILE)
    weights_name, weights_bytes = _weight_bytes(path)
    tensors = _load_tensors(path / weights_name, weights_bytes)
    pairs = _pair_modules(tensors, path)
    slots: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    max_rank = 0
    for (layer, module), (a, b) in sorted(pairs.items()):
        projection_name, part = _target(module, layer, targets)
        projection = targets.get(projection_name)
        assert projection is not None
        rank = _check_shapes(module, layer, a, b, projection, part, targets.max_rank)
        max_rank = max(max_rank, rank)
        slot = slots.get((layer, projection_name))
        if slot is None:
            slot = slots[(layer, projection_name)] = _empty_slot(targets, projection_name, dtype)
        _place(slot, a, b * config.scale(module, rank), projection, part, targets.max_rank)
    if not slots:
        raise LoRAError(f"the adapter at {str(path)!r} holds no LoRA weights")
    return LoRAAdapter(max_rank, slots, _digest(config_bytes, weights_name, weights_bytes))


def fingerprint(path: str | Path) -> str:
    """A digest of the adapter's config and weight file: the prefix-cache key of its KV
    (what ``read_adapter`` records, without parsing the tensors)."""
    path = Path(path)
    return _digest(_config_bytes(path), *_weight_bytes(path))


def _digest(config_bytes: bytes, weights_name: str, weights_bytes: bytes) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for part in (config_bytes, weights_name.encode(), weights_bytes):
        digest.update(part)
    return digest.hexdigest()


def _config_bytes(path: Path) -> bytes:
    if not path.is_dir():
        raise LoRAError(f"LoRA adapter path {str(path)!r} is not a directory")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoRAError(f"{str(path)!r} is not a PEFT adapter directory: it has no {CONFIG_FILE}")
    return file.read_bytes()


def _json_object(data: bytes, file: Path) -> dict[str, Any]:
    try:
        raw = json.loads(data)
    except ValueError as exc:
        raise LoRAError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise LoRAError(f"{file} must hold a JSON object")
    return raw


def _weight_bytes(path: Path) -> tuple[str, bytes]:
    """The first weight file's name and contents."""
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return name, (path / name).read_bytes()
    raise LoRAError(f"{str(path)!r} has no adapter weights ({' or '.join(WEIGHT_FILES)})")


def _parse_config(raw: dict[str, Any], file: Path) -> AdapterConfig:
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"{file}: peft_type {peft_type!r} is not LORA; kvserve serves LoRA only")
    if raw.get("use_dora"):
        raise LoRAError(f"{file}: DoRA adapters (use_dora) are not supported; merge them instead")
    if raw.get("bias", "none") not in ("none", None) or raw.get("lora_bias"):
        raise LoRAError(f"{file}: adapters with trained biases are not supported (bias 'none')")
    if raw.get("modules_to_save"):
        raise LoRAError(
            f"{file}: modules_to_save {raw['modules_to_save']} replaces whole base modules; "
            "kvserve serves only the LoRA deltas"
        )
    try:
        rank = int(raw.get("r", 8))
        alpha = float(raw.get("lora_alpha", rank))
        alphas = {str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()}
    except (TypeError, ValueError) as exc:
        raise LoRAError(f"{file}: r, lora_alpha and their patterns must be numbers") from exc
    if rank < 1:
        raise LoRAError(f"{file}: r must be >= 1, got {rank}")
    # A module's rank is its tensors' (rank_pattern overrides agree with them).
    return AdapterConfig(alpha, bool(raw.get("use_rslora")), alphas)


def _pattern_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override: the first key that matches the module's name's end."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _load_tensors(file: Path, data: bytes) -> dict[str, torch.Tensor]:
    try:
        if file.name.endswith(".safetensors"):
            from safetensors.torch import load

            return load(data)
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: say which
        raise LoRAError(f"cannot read {file}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise LoRAError(f"{file} does not hold a dict of tensors")
    return loaded


def _pair_modules(
    tensors: dict[str, torch.Tensor], path: Path
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """``(layer, module) -> (A, B)`` from the adapter's keys."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise LoRAError(
                f"the adapter at {str(path)!r} has weight {key!r}, which is not a LoRA A/B "
                "matrix of a decoder layer's projection (embedding and LM-head adapters are "
                "not supported)"
            )
        layer, module, half = int(match[1]), match[2], match[3]
        halves.setdefault((layer, module), {})[half] = tensor
    pairs = {}
    for (layer, module), found in halves.items():
        if set(found) != {"A", "B"}:
            raise LoRAError(f"layer {layer} {module}: the adapter holds lora_A or lora_B alone")
        pairs[(layer, module)] = (found["A"], found["B"])
    return pairs


def _target(module: str, layer: int, targets: LoRATargets) -> tuple[str, int]:
    mapped = HF_MODULES.get(module)
    if mapped is None or targets.get(mapped[0]) is None:
        raise LoRAError(
            f"the adapter targets module {module!r}, which this base model does not have "
            f"as a LoRA target; kvserve applies adapters to {', '.join(targets.module_names)}"
        )
    if not 0 <= layer < targets.num_layers:
        raise LoRAError(f"the adapter targets layer {layer}; the base has {targets.num_layers}")
    return mapped


def _check_shapes(
    module: str,
    layer: int,
    a: torch.Tensor,
    b: torch.Tensor,
    projection: Projection,
    part: int,
    max_rank: int,
) -> int:
    """The module's rank, after checking its A and B against the base."""
    if a.dim() != 2 or b.dim() != 2:
        raise LoRAError(
            f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
            "must be matrices"
        )
    rank = a.shape[0]
    if rank > max_rank:
        raise LoRAError(
            f"the adapter's rank {rank} (layer {layer} {module}) exceeds --max-lora-rank "
            f"{max_rank}; raise --max-lora-rank"
        )
    _, rows = projection.part_rows(part)
    expected_a, expected_b = (rank, projection.in_features), (rows, rank)
    if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
        raise LoRAError(
            f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
            f"not match the base model ({list(expected_a)} and {list(expected_b)} expected); "
            "was the adapter trained for another model?"
        )
    return rank


def _empty_slot(
    targets: LoRATargets, name: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    projection = targets.get(name)
    assert projection is not None
    width = targets.width(name)
    return (
        torch.zeros(width, projection.in_features, dtype=dtype),
        torch.zeros(width, projection.out_features, dtype=dtype),
    )


def _place(
    slot: tuple[torch.Tensor, torch.Tensor],
    a: torch.Tensor,
    b: torch.Tensor,
    projection: Projection,
    part: int,
    max_rank: int,
) -> None:
    """Write one module's A and scaled B into its part's rows of the slot."""
    rank = a.shape[0]
    first = max(part, 0) * max_rank
    start, rows = projection.part_rows(part)
    slot[0][first : first + rank].copy_(a)
    slot[1][first : first + rank, start : start + rows].copy_(b.T)
