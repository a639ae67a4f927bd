"""The shape of a Llama-family decoder, read once from a Hugging Face config.

Llama, Mistral, Qwen2 and SmolLM share one block structure (RMSNorm, RoPE, grouped-query
attention, SwiGLU MLP); they differ only in the numbers kept here and in whether the
attention projections carry a bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.kv.accounting import KVShape

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


@dataclass(frozen=True)
class ModelSpec:
    """Everything the forward pass needs to know about the model's shape."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Attention window of Mistral-style models. kvserve attends to the full context, which
    # equals windowed attention only while sequences stay within the window.
    sliding_window: int | None = None

    @property
    def context_limit(self) -> int:
        """Longest sequence this full-attention implementation serves exactly."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 = multi-head attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_shape(self, kv_dtype: str) -> KVShape:
        return KVShape(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            kv_dtype=kv_dtype,
        )


def spec_from_hf_config(config: Any) -> ModelSpec:
    """Read a ModelSpec from a transformers config; rejects architectures we cannot run."""
    model_type = getattr(config, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model type {model_type!r}; kvserve runs {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    num_heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return ModelSpec(
        model_type=model_type,
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        num_heads=num_heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
        head_dim=int(head_dim),
        intermediate_size=int(config.intermediate_size),
        vocab_size=int(config.vocab_size),
        rms_norm_eps=float(config.rms_norm_eps),
        max_position_embeddings=int(config.max_position_embeddings),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_window=_sliding_window(config),
    )


def _sliding_window(config: Any) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return None
    return int(window)


def rope_inverse_frequencies(config: Any, spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and the attention scaling factor for the config's RoPE type.

    The default type is computed here from theta; scaled variants (linear, llama3, yarn, ...)
    use transformers' own initialisers so that the frequencies match the reference exactly.
    """
    params = _rope_parameters(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        exponents = torch.arange(0, spec.head_dim, 2, dtype=torch.int64).to(torch.float32)
        return 1.0 / (theta ** (exponents / spec.head_dim)), 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE scaling is not supported (it depends on length)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.to(torch.float32), float(scaling)


def _rope_parameters(config: Any) -> dict[str, Any]:
    """transformers 5 keeps RoPE settings in ``rope_parameters``; 4.x in theta + scaling."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return dict(params)
    merged: dict[str, Any] = {"rope_theta": getattr(config, "rope_theta", 10000.0)}
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        merged.update(scaling)
    return merged
