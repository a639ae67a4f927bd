"""Gemma 2: alternating sliding-window and full layers (``config.layer_types``), sandwich
norms, GeGLU, scaled embeddings, soft-capped attention and final logits.

- Norms are Gemma's: ``x_norm * (1 + w)`` in float32 (folded to ``1 + w`` at load). Each
  sublayer has a pre- and a post-norm: ``input_layernorm`` / ``post_attention_layernorm``
  around attention, ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around
  the MLP.
- Embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model dtype.
- Attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (not ``head_dim``) and
  soft-capped at ``attn_logit_softcapping``; logits at ``final_logit_softcapping``.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.families.hf_names import (
    TensorReader,
    attention_weights,
    gated_mlp,
    model_weights,
    offset_norm,
)
from engine.model.layers.decoder import DecoderOptions, LayerWeights, ModelWeights
from engine.model.layers.mlp import activation_from_config
from engine.model.spec import ModelSpec


def decoder_options(config: Any, dtype: torch.dtype) -> DecoderOptions:
    return DecoderOptions(
        attention_scale=float(config.query_pre_attn_scalar) ** -0.5,
        attn_softcap=config.attn_logit_softcapping,
        final_softcap=config.final_logit_softcapping,
        embedding_scale=embedding_scale(config, dtype),
    )


def load_weights(config: Any, spec: ModelSpec, tensors: TensorReader) -> ModelWeights:
    activation = activation_from_config(config)

    def layer(prefix: str) -> LayerWeights:
        return LayerWeights(
            attention=attention_weights(tensors, prefix + "self_attn."),
            mlp=gated_mlp(tensors, prefix + "mlp.", activation),
            **sandwich_norms(tensors, prefix),
        )

    return model_weights(tensors, spec, layer, norm=offset_norm)


def embedding_scale(config: Any, dtype: torch.dtype) -> float:
    """``sqrt(hidden_size)`` as Gemma multiplies by it: a tensor in the model dtype."""
    return float(torch.tensor(config.hidden_size**0.5, dtype=dtype))


def sandwich_norms(tensors: TensorReader, prefix: str) -> dict[str, torch.Tensor]:
    """The four Gemma norms of layer ``prefix``, by ``LayerWeights`` field."""
    names = {
        "input_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "pre_mlp_norm": "pre_feedforward_layernorm",
        "post_mlp_norm": "post_feedforward_layernorm",
    }
    return {field: offset_norm(tensors, f"{prefix}{name}.weight") for field, name in names.items()}
