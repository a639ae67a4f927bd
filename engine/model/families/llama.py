"""Llama, Mistral and Qwen2 (and the checkpoints built on them: SmolLM, TinyLlama, ...).

Pre-norm layers: RMSNorm -> attention -> add, RMSNorm -> SwiGLU MLP -> add. Grouped-query
attention with RoPE (Llama 3 / YaRN / linear scaling through the rotary tables); Qwen2
stores a QKV bias, which the fused projection keeps. Mistral's sliding window (every layer)
and Qwen2's ``use_sliding_window`` layers come from the config via ``ModelSpec.layers``.

HF names: ``input_layernorm`` is the attention's pre-norm, ``post_attention_layernorm``
the MLP's pre-norm.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.families.hf_names import TensorReader, attention_weights, gated_mlp, model_weights
from engine.model.layers.decoder import DecoderOptions, LayerWeights, ModelWeights
from engine.model.layers.mlp import activation_from_config
from engine.model.spec import ModelSpec


def decoder_options(config: Any, dtype: torch.dtype) -> DecoderOptions:
    return DecoderOptions()


def load_weights(config: Any, spec: ModelSpec, tensors: TensorReader) -> ModelWeights:
    activation = activation_from_config(config)

    def layer(prefix: str) -> LayerWeights:
        return LayerWeights(
            attention=attention_weights(tensors, prefix + "self_attn."),
            mlp=gated_mlp(tensors, prefix + "mlp.", activation),
            input_norm=tensors.take(prefix + "input_layernorm.weight"),
            pre_mlp_norm=tensors.take(prefix + "post_attention_layernorm.weight"),
        )

    return model_weights(tensors, spec, layer)
