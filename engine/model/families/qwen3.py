"""Qwen3: Llama's layers with an RMSNorm over each query and key head before the rotary
(``q_norm`` / ``k_norm``, one ``[head_dim]`` weight shared by the heads), no QKV bias, and
an explicit ``head_dim`` that need not be ``hidden_size / num_heads``."""

from __future__ import annotations

from typing import Any

import torch

from engine.model.families.hf_names import TensorReader, attention_weights, gated_mlp, model_weights
from engine.model.layers.attention import QK_NORM_PER_HEAD
from engine.model.layers.decoder import DecoderOptions, LayerWeights, ModelWeights
from engine.model.layers.mlp import activation_from_config
from engine.model.spec import ModelSpec


def decoder_options(config: Any, dtype: torch.dtype) -> DecoderOptions:
    return DecoderOptions(qk_norm=QK_NORM_PER_HEAD)


def load_weights(config: Any, spec: ModelSpec, tensors: TensorReader) -> ModelWeights:
    activation = activation_from_config(config)

    def layer(prefix: str) -> LayerWeights:
        attention = prefix + "self_attn."
        return LayerWeights(
            attention=attention_weights(tensors, attention, "q_norm.weight", "k_norm.weight"),
            mlp=gated_mlp(tensors, prefix + "mlp.", activation),
            input_norm=tensors.take(prefix + "input_layernorm.weight"),
            pre_mlp_norm=tensors.take(prefix + "post_attention_layernorm.weight"),
        )

    return model_weights(tensors, spec, layer)
