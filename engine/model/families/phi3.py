"""Phi-3 and Phi-4 (``phi3``: Phi-3 mini/medium, Phi-3.5 mini, Phi-4, Phi-4 mini).

Llama's pre-norm layers with the projections already fused in the checkpoint
(``self_attn.qkv_proj``: query, key, value rows; ``mlp.gate_up_proj``: gate, then up rows),
which is the shared layers' own layout. RoPE is LongRoPE where configured (per-frequency
short and long factors, layers/rotary.py picks them by the served context length) and
partial where ``partial_rotary_factor`` is below 1 (Phi-4 mini: 0.75). A ``sliding_window``
in the config applies to every layer, as transformers' Phi-3 masks it.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.families.hf_names import TensorReader, model_weights
from engine.model.layers.attention import AttentionWeights
from engine.model.layers.decoder import DecoderOptions, LayerWeights, ModelWeights
from engine.model.layers.linear import DenseLinear
from engine.model.layers.mlp import GatedMLP, activation_from_config
from engine.model.spec import ModelSpec


def decoder_options(config: Any, dtype: torch.dtype) -> DecoderOptions:
    return DecoderOptions()


def load_weights(config: Any, spec: ModelSpec, tensors: TensorReader) -> ModelWeights:
    activation = activation_from_config(config)

    def layer(prefix: str) -> LayerWeights:
        attention, mlp = prefix + "self_attn.", prefix + "mlp."
        return LayerWeights(
            attention=AttentionWeights(
                qkv=DenseLinear(tensors.take(attention + "qkv_proj.weight")),
                o_proj=DenseLinear(tensors.take(attention + "o_proj.weight")),
            ),
            mlp=GatedMLP(
                DenseLinear(tensors.take(mlp + "gate_up_proj.weight")),
                DenseLinear(tensors.take(mlp + "down_proj.weight")),
                activation,
            ),
            input_norm=tensors.take(prefix + "input_layernorm.weight"),
            pre_mlp_norm=tensors.take(prefix + "post_attention_layernorm.weight"),
        )

    return model_weights(tensors, spec, layer)
