"""gpt-oss: alternating sliding-window (128 tokens) and full-attention layers with learned
attention sinks and biased projections, and a mixture-of-experts feed-forward.

- Attention: Q, K, V and O projections with biases, one learned sink logit per query
  head (``self_attn.sinks``, in the softmax's denominator only), YaRN RoPE;
  ``config.layer_types`` says which layers slide (the KV cache's groups follow).
- Norms multiply in float32 before rounding (kept in float32, as OLMo 2's).
- Experts (layers/moe.py), routed top-k then softmax over the k, with a biased router.
  transformers 5 stores them as ``x @ W``: ``gate_up_proj [experts, hidden, 2 * inter]``
  with the gate and up columns interleaved (gate even, up odd) and ``down_proj [experts,
  inter, hidden]``, each with a bias; they are transposed and de-interleaved at load into
  the shared layout (gate rows, then up rows). The activation is the clamped SwiGLU.
- MXFP4 checkpoints (the released ones) are dequantized by transformers as they load
  (loader.py asks for it), to the serving dtype; ``--quantization int4`` then stores the
  experts 4-bit again (Q4_1, not MXFP4's grid).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.families.hf_names import (
    TensorReader,
    attention_weights,
    float32_norm,
    model_weights,
)
from engine.model.layers.attention import AttentionWeights
from engine.model.layers.decoder import DecoderOptions, LayerWeights, ModelWeights
from engine.model.layers.linear import DenseLinear
from engine.model.layers.mlp import ClampedSwiGLU, GatedMLP
from engine.model.layers.moe import MoEMLP
from engine.model.layers.routing import TOPK_SOFTMAX, Routing
from engine.model.spec import ModelSpec


def decoder_options(config: Any, dtype: torch.dtype) -> DecoderOptions:
    return DecoderOptions()


def load_weights(config: Any, spec: ModelSpec, tensors: TensorReader) -> ModelWeights:
    activation = ClampedSwiGLU(float(config.swiglu_alpha), float(config.swiglu_limit))
    routing = Routing(top_k=int(config.num_experts_per_tok), rule=TOPK_SOFTMAX)

    def layer(prefix: str) -> LayerWeights:
        return LayerWeights(
            attention=_attention(tensors, prefix + "self_attn."),
            mlp=_experts(tensors, prefix + "mlp.", activation, routing),
            input_norm=float32_norm(tensors, prefix + "input_layernorm.weight"),
            pre_mlp_norm=float32_norm(tensors, prefix + "post_attention_layernorm.weight"),
        )

    return model_weights(tensors, spec, layer, norm=float32_norm)


def _attention(tensors: TensorReader, prefix: str) -> AttentionWeights:
    weights = attention_weights(tensors, prefix)
    weights.sinks = tensors.place(tensors.raw(prefix + "sinks").to(torch.float32))
    return weights


def _experts(
    tensors: TensorReader, prefix: str, activation: ClampedSwiGLU, routing: Routing
) -> MoEMLP:
    gate_up = tensors.take(prefix + "experts.gate_up_proj")  # [E, hidden, 2I] interleaved
    gate_up_bias = tensors.take(prefix + "experts.gate_up_proj_bias")  # [E, 2I]
    down = tensors.take(prefix + "experts.down_proj")  # [E, I, hidden]
    down_bias = tensors.take(prefix + "experts.down_proj_bias")  # [E, hidden]
    experts = []
    for e in range(gate_up.shape[0]):
        rows = gate_up[e].t()  # [2I, hidden], gate and up rows interleaved
        fused = torch.cat([rows[0::2], rows[1::2]]).contiguous()
        bias = torch.cat([gate_up_bias[e, 0::2], gate_up_bias[e, 1::2]]).contiguous()
        projection = DenseLinear(down[e].t().contiguous(), down_bias[e].contiguous())
        experts.append(GatedMLP(DenseLinear(fused, bias), projection, activation))
    router = prefix + "router."
    return MoEMLP(tensors.take(router + "weight"), tensors.take(router + "bias"), experts, routing)
