"""OLMo 2 (``olmo2``): norms after each sublayer instead of before it, and QK-norm over
all heads.

- Each sublayer is ``residual += norm(sublayer(residual))`` (``post_attention_layernorm``
  after attention, ``post_feedforward_layernorm`` after the MLP); there is no input norm.
- ``q_norm`` / ``k_norm`` are RMSNorms over a row's whole query (``[q_size]``) and key
  (``[kv_size]``) projection, before the rotary.
- OLMo 2 multiplies by the norm weight in float32 and rounds after (Llama rounds first):
  its weights are kept in float32, which tells the kernels to multiply before rounding
  (layers/norms.py).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.families.hf_names import (
    TensorReader,
    attention_weights,
    float32_norm,
    gated_mlp,
    model_weights,
)
from engine.model.layers.attention import QK_NORM_ALL_HEADS
from engine.model.layers.decoder import DecoderOptions, LayerWeights, ModelWeights
from engine.model.layers.mlp import activation_from_config
from engine.model.spec import ModelSpec


def decoder_options(config: Any, dtype: torch.dtype) -> DecoderOptions:
    return DecoderOptions(qk_norm=QK_NORM_ALL_HEADS)


def load_weights(config: Any, spec: ModelSpec, tensors: TensorReader) -> ModelWeights:
    activation = activation_from_config(config)

    def layer(prefix: str) -> LayerWeights:
        attention = attention_weights(
            tensors, prefix + "self_attn.", "q_norm.weight", "k_norm.weight", norm=float32_norm
        )
        return LayerWeights(
            attention=attention,
            mlp=gated_mlp(tensors, prefix + "mlp.", activation),
            post_attention_norm=float32_norm(tensors, prefix + "post_attention_layernorm.weight"),
            post_mlp_norm=float32_norm(tensors, prefix + "post_feedforward_layernorm.weight"),
        )

    return model_weights(tensors, spec, layer, norm=float32_norm)
