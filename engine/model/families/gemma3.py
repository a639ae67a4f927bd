"""Gemma 3's text model (``gemma3_text``, and the text half of a multimodal ``gemma3``
checkpoint): Gemma 2's layers with QK-norm, five local layers to one global.

- ``config.layer_types`` says which layers slide; local and global layers rotate with
  different RoPE tables (``rope_parameters`` keyed by layer type: the local base
  ``rope_local_base_freq``, the global one with its own scaling), one table each.
- ``q_norm`` / ``k_norm`` are Gemma norms over each head (``1 + w``, float32).
- No attention soft-cap (transformers' Gemma 3 does not apply ``attn_logit_softcapping``);
  the text model's final logits are soft-capped when its config says so.
- A multimodal checkpoint keeps its text model under ``model.language_model.``; the
  vision tower is not loaded into kvserve's model and images are not served.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.model.families.gemma2 import embedding_scale, sandwich_norms
from engine.model.families.hf_names import (
    TensorReader,
    attention_weights,
    gated_mlp,
    model_weights,
    offset_norm,
)
from engine.model.layers.attention import QK_NORM_PER_HEAD
from engine.model.layers.decoder import DecoderOptions, LayerWeights, ModelWeights
from engine.model.layers.mlp import activation_from_config
from engine.model.spec import ModelSpec

MULTIMODAL_TEXT_PREFIX = "model.language_model."


def decoder_options(config: Any, dtype: torch.dtype) -> DecoderOptions:
    text = config.get_text_config()
    multimodal = config.model_type != "gemma3_text"
    return DecoderOptions(
        qk_norm=QK_NORM_PER_HEAD,
        attention_scale=float(text.query_pre_attn_scalar) ** -0.5,
        # transformers' multimodal model never soft-caps its logits (Gemma 3's own configs
        # set no cap, so the two agree on real checkpoints).
        final_softcap=None if multimodal else text.final_logit_softcapping,
        embedding_scale=embedding_scale(text, dtype),
    )


def load_weights(config: Any, spec: ModelSpec, tensors: TensorReader) -> ModelWeights:
    activation = activation_from_config(config.get_text_config())
    if config.model_type != "gemma3_text":  # the multimodal checkpoint
        tensors = dataclasses.replace(tensors, prefix=MULTIMODAL_TEXT_PREFIX)

    def layer(prefix: str) -> LayerWeights:
        attention = prefix + "self_attn."
        return LayerWeights(
            attention=attention_weights(
                tensors, attention, "q_norm.weight", "k_norm.weight", norm=offset_norm
            ),
            mlp=gated_mlp(tensors, prefix + "mlp.", activation),
            **sandwich_norms(tensors, prefix),
        )

    return model_weights(tensors, spec, layer, norm=offset_norm)
