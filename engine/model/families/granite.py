"""IBM Granite 3.x dense (``granite``): Llama's layers with four scalar multipliers.

``embedding_multiplier`` scales the embeddings, ``residual_multiplier`` every sublayer's
output before it joins the residual stream, ``attention_multiplier`` replaces
``head_dim ** -0.5`` as the attention scale, and the logits are divided by
``logits_scaling``.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.families import llama
from engine.model.families.hf_names import TensorReader
from engine.model.layers.decoder import DecoderOptions, ModelWeights
from engine.model.spec import ModelSpec


def decoder_options(config: Any, dtype: torch.dtype) -> DecoderOptions:
    return DecoderOptions(
        attention_scale=float(config.attention_multiplier),
        embedding_scale=float(config.embedding_multiplier),
        residual_multiplier=float(config.residual_multiplier),
        logits_divisor=float(config.logits_scaling),
    )


def load_weights(config: Any, spec: ModelSpec, tensors: TensorReader) -> ModelWeights:
    return llama.load_weights(config, spec, tensors)
