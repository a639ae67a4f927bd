"""Hugging Face tensor names -> the shared layers' weights, for the families to compose.

Most decoders on the Hub name their tensors as Llama does (``model.layers.{i}.self_attn.
{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``model.norm``, ``lm_head``); these helpers
read that layout into the fused one (QKV in one matrix, gate and up in one), so a family
module only says which norms it has and how they are stored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from engine.model.layers.attention import AttentionWeights
from engine.model.layers.decoder import LayerWeights, ModelWeights
from engine.model.layers.linear import DenseLinear
from engine.model.layers.mlp import GatedMLP
from engine.model.layers.norms import offset_norm_weight, plain_norm_weight
from engine.model.spec import ModelSpec

# Tensors outside the decoder's ``model.``: the LM head, or a classifier head (``score``).
HEAD_PREFIXES = ("lm_head.", "score.")


@dataclass(frozen=True)
class TensorReader:
    """A model's HF-named tensors, handed out in ``dtype`` on ``device``. ``prefix`` is
    where the decoder's ``model.`` tensors live (a multimodal checkpoint nests its text
    model, e.g. ``model.language_model.``)."""

    state: Mapping[str, torch.Tensor]
    dtype: torch.dtype
    device: torch.device
    prefix: str = "model."

    def has(self, name: str) -> bool:
        return self.name(name) in self.state

    def name(self, name: str) -> str:
        """The full key of ``name`` given relative to ``prefix`` (the heads, ``lm_head.``
        and a classifier's ``score.``, are not: they sit beside the decoder)."""
        return name if name.startswith(HEAD_PREFIXES) else self.prefix + name

    def raw(self, name: str) -> torch.Tensor:
        """The tensor as stored (any dtype, any device)."""
        return self.state[self.name(name)]

    def take(self, name: str) -> torch.Tensor:
        return self.raw(name).to(device=self.device, dtype=self.dtype).contiguous()

    def fuse(self, *names: str) -> torch.Tensor:
        """The tensors concatenated along their first dim (fused projections)."""
        parts = [self.raw(n).to(self.dtype) for n in names]
        return torch.cat(parts, dim=0).to(self.device).contiguous()

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor derived at load (e.g. a folded norm) moved to the device as it is."""
        return tensor.to(self.device).contiguous()


# Reads the norm weight named ``name`` (Llama style in the model dtype, Gemma's folded).
NormReader = Callable[[TensorReader, str], torch.Tensor]


def attention_weights(
    tensors: TensorReader,
    prefix: str,
    q_norm: str | None = None,
    k_norm: str | None = None,
    norm: NormReader | None = None,
) -> AttentionWeights:
    """``{prefix}{q,k,v,o}_proj`` (biases where stored) and the named QK-norm weights."""
    projections = [f"{prefix}{x}_proj" for x in ("q", "k", "v")]
    biased = tensors.has(projections[0] + ".bias")
    qkv_bias = tensors.fuse(*(p + ".bias" for p in projections)) if biased else None
    o_bias_name = f"{prefix}o_proj.bias"
    o_bias = tensors.take(o_bias_name) if tensors.has(o_bias_name) else None
    read = norm if norm is not None else plain_norm
    return AttentionWeights(
        qkv=DenseLinear(tensors.fuse(*(p + ".weight" for p in projections)), qkv_bias),
        o_proj=DenseLinear(tensors.take(f"{prefix}o_proj.weight"), o_bias),
        q_norm=None if q_norm is None else read(tensors, prefix + q_norm),
        k_norm=None if k_norm is None else read(tensors, prefix + k_norm),
    )


def gated_mlp(tensors: TensorReader, prefix: str, activation: str) -> GatedMLP:
    """``{prefix}{gate,up,down}_proj`` as one gate-up matrix and a down projection."""
    gate_up = tensors.fuse(f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight")
    down = tensors.take(f"{prefix}down_proj.weight")
    return GatedMLP(DenseLinear(gate_up), DenseLinear(down), activation)


def model_weights(
    tensors: TensorReader,
    spec: ModelSpec,
    layer: Callable[[str], LayerWeights],
    norm: NormReader | None = None,
) -> ModelWeights:
    """The embedding, ``layer(prefix)`` for every ``layers.{i}.``, the final norm, the
    LM head (the embedding itself when tied or absent, as in a classifier checkpoint) and
    a classifier checkpoint's head."""
    read = norm if norm is not None else plain_norm
    embed = tensors.take("embed_tokens.weight")
    tied = spec.tie_word_embeddings or not tensors.has("lm_head.weight")
    return ModelWeights(
        embed=embed,
        layers=[layer(f"layers.{i}.") for i in range(spec.num_layers)],
        final_norm=read(tensors, "norm.weight"),
        lm_head=DenseLinear(embed if tied else tensors.take("lm_head.weight")),
        classifier=classifier_head(tensors, spec),
    )


def classifier_head(tensors: TensorReader, spec: ModelSpec) -> torch.Tensor | None:
    """``score.weight`` (``[num_labels, hidden]``, no bias in transformers'
    ``*ForSequenceClassification``) when the spec says the checkpoint has one."""
    if not spec.num_labels:
        return None
    head = tensors.take("score.weight")
    if tuple(head.shape) != (spec.num_labels, spec.hidden_size):
        raise ValueError(
            f"score.weight is {tuple(head.shape)}, not [num_labels {spec.num_labels}, "
            f"hidden {spec.hidden_size}]"
        )
    return head


def plain_norm(tensors: TensorReader, name: str) -> torch.Tensor:
    """A Llama-style norm weight, in the model dtype."""
    return tensors.place(plain_norm_weight(tensors.raw(name), tensors.dtype))


def offset_norm(tensors: TensorReader, name: str) -> torch.Tensor:
    """A Gemma-style norm weight ``w``, stored as ``1 + w`` in float32 (layers/norms.py)."""
    return tensors.place(offset_norm_weight(tensors.raw(name)))


def float32_norm(tensors: TensorReader, name: str) -> torch.Tensor:
    """A norm weight multiplied before rounding to the model dtype (OLMo 2, gpt-oss): kept
    in float32, which tells the kernels to (layers/norms.py)."""
    return tensors.place(tensors.raw(name).to(torch.float32))
