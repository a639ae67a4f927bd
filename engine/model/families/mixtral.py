"""Mixtral and Qwen3-MoE: Llama's pre-norm layers (Qwen3's with QK-norm per head) whose
feed-forward is a mixture of experts (layers/moe.py).

transformers 5 holds each layer's experts stacked: ``mlp.experts.gate_up_proj``
``[experts, 2 * intermediate, hidden]`` (gate rows, then up rows: the fused layout the
shared layers use) and ``mlp.experts.down_proj`` ``[experts, hidden, intermediate]``; the
router is ``mlp.gate.weight``. Routing is softmax then top-k, renormalised (Mixtral
always; Qwen3-MoE when ``norm_topk_prob``). Qwen3-MoE keeps a dense MLP in the layers
``mlp_only_layers`` names and in those off its ``decoder_sparse_step``.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.families.hf_names import TensorReader, attention_weights, gated_mlp, model_weights
from engine.model.layers.attention import QK_NORM_PER_HEAD
from engine.model.layers.decoder import DecoderOptions, LayerWeights, ModelWeights
from engine.model.layers.linear import DenseLinear
from engine.model.layers.mlp import MLP, GatedMLP, activation_from_config
from engine.model.layers.moe import MoEMLP
from engine.model.layers.routing import SOFTMAX_TOPK, Routing
from engine.model.spec import ModelSpec


def decoder_options(config: Any, dtype: torch.dtype) -> DecoderOptions:
    return DecoderOptions(qk_norm=QK_NORM_PER_HEAD if _is_qwen3(config) else None)


def load_weights(config: Any, spec: ModelSpec, tensors: TensorReader) -> ModelWeights:
    activation = activation_from_config(config)
    qk_norm = ("q_norm.weight", "k_norm.weight") if _is_qwen3(config) else ()
    routing = Routing(
        top_k=int(config.num_experts_per_tok),
        rule=SOFTMAX_TOPK,
        renormalize=bool(getattr(config, "norm_topk_prob", True)),
    )

    def layer(prefix: str) -> LayerWeights:
        index = int(prefix.split(".")[1])
        mlp: MLP
        if is_sparse_layer(config, index):
            mlp = stacked_experts(tensors, prefix + "mlp.", activation, routing)
        else:
            mlp = gated_mlp(tensors, prefix + "mlp.", activation)
        return LayerWeights(
            attention=attention_weights(tensors, prefix + "self_attn.", *qk_norm),
            mlp=mlp,
            input_norm=tensors.take(prefix + "input_layernorm.weight"),
            pre_mlp_norm=tensors.take(prefix + "post_attention_layernorm.weight"),
        )

    return model_weights(tensors, spec, layer)


def is_sparse_layer(config: Any, index: int) -> bool:
    """Whether layer ``index`` has experts (Qwen3-MoE may keep some layers dense)."""
    if index in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    return (index + 1) % int(getattr(config, "decoder_sparse_step", 1) or 1) == 0


def stacked_experts(
    tensors: TensorReader, prefix: str, activation: str, routing: Routing
) -> MoEMLP:
    """transformers 5's stacked expert tensors under ``prefix`` as one ``GatedMLP`` each."""
    gate_up = tensors.take(prefix + "experts.gate_up_proj")
    down = tensors.take(prefix + "experts.down_proj")
    experts = [
        GatedMLP(DenseLinear(up.contiguous()), DenseLinear(back.contiguous()), activation)
        for up, back in zip(gate_up, down, strict=True)
    ]
    return MoEMLP(tensors.take(prefix + "gate.weight"), None, experts, routing)


def _is_qwen3(config: Any) -> bool:
    return str(config.model_type) == "qwen3_moe"
