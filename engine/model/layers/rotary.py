"""Rotary position embedding tables, one per ``LayerSpec.rope`` name.

The default RoPE is computed here from its theta; scaled variants (linear, llama3, yarn,
longrope, ...) use transformers' own initialisers so the frequencies match the reference
exactly. A ``partial_rotary_factor`` below 1 gives tables narrower than a head: only each
head's leading ``factor * head_dim`` channels rotate. transformers 5 may key
``rope_parameters`` by layer type (Gemma 3: a local and a global base); each key is then
a table of its own.

LongRoPE (Phi-3) has two sets of per-frequency factors: short ones for sequences up to
``original_max_position_embeddings`` and long ones beyond. transformers re-rotates the
whole cache when a sequence crosses that length; a paged cache cannot, so kvserve picks
one set per server from the context it serves (``context_len``: long factors when it
exceeds the original length, as llama.cpp does from its context size). Either way a
sequence gets exactly what transformers computes for it at that context length.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.spec import DEFAULT_ROPE, ModelSpec


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by position (rotate-half convention),
    ``[max_positions, rotary_dim]`` each."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        attention_scaling: float,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq.to(torch.float32))
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = (angles.cos() * attention_scaling).to(dtype=dtype, device=device)
        self.sin = (angles.sin() * attention_scaling).to(dtype=dtype, device=device)


def rotary_tables(
    config: Any,
    spec: ModelSpec,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    context_len: int | None = None,
) -> dict[str, RotaryEmbedding]:
    """One table per RoPE name the model's layers use, for a server of ``context_len``
    tokens (``max_positions``, the table's length, when not given)."""
    tables = {}
    served = max_positions if context_len is None else context_len
    for name in dict.fromkeys(layer.rope for layer in spec.layers):
        inv_freq, scaling = rope_inverse_frequencies(config, spec.head_dim, name, served)
        tables[name] = RotaryEmbedding(inv_freq, scaling, max_positions, dtype, device)
    return tables


def rope_inverse_frequencies(
    config: Any, head_dim: int, name: str = DEFAULT_ROPE, context_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and the attention scaling factor of table ``name``
    (LongRoPE's factors for sequences of ``context_len`` tokens; short ones without it)."""
    layer_type = None if name == DEFAULT_ROPE else name
    params = _rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32)
        return 1.0 / (theta ** (exponents / dim)), 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE scaling is not supported (it depends on length)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported RoPE type {rope_type!r}")
    kwargs: dict[str, Any] = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "longrope" and context_len is not None:
        kwargs["seq_len"] = context_len
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return inv_freq.to(torch.float32), float(scaling)


def _rope_parameters(config: Any, layer_type: str | None) -> dict[str, Any]:
    """transformers 5 keeps RoPE settings in ``rope_parameters`` (per layer type for some
    models); 4.x in theta + scaling, and Phi-3 style partial rotary beside them."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return dict(params[layer_type] if layer_type is not None else params)
    merged: dict[str, Any] = {"rope_theta": getattr(config, "rope_theta", 10000.0)}
    factor = getattr(config, "partial_rotary_factor", None)
    if factor is not None:
        merged["partial_rotary_factor"] = factor
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        merged.update(scaling)
    return merged
