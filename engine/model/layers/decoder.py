"""A Llama-family decoder whose attention reads and writes a paged KV cache.

Weights are plain tensors in a fused layout (QKV in one matrix, gate and up in one
matrix) so that each layer costs few kernel launches and little Python. The forward
returns final hidden states only for the rows the caller asks for, so a long prefill
never materialises a ``[tokens, vocab]`` logits matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.kernels.base import TorchKernels
from engine.model.kernels.metadata import AttentionMetadata, paged_attention
from engine.model.layers.linear import DenseLinear, Linear
from engine.model.runtime.cpu_decode import DecodeLayers
from engine.model.runtime.kv_cache import PagedKVCache
from engine.model.spec import ModelSpec


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [q_size + 2 * kv_size, hidden], with the QKV bias when the model has one
    o_proj: Linear  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear  # [hidden, intermediate]

    @property
    def nbytes(self) -> int:
        norms = _tensor_bytes(self.input_norm) + _tensor_bytes(self.post_norm)
        projections = (self.qkv, self.o_proj, self.gate_up, self.down)
        return norms + sum(linear.nbytes for linear in projections)

    @property
    def decode_nbytes(self) -> int:
        norms = _tensor_bytes(self.input_norm) + _tensor_bytes(self.post_norm)
        projections = (self.qkv, self.o_proj, self.gate_up, self.down)
        return norms + sum(linear.decode_nbytes for linear in projections)


@dataclass
class LlamaWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Linear  # a DenseLinear over the embedding tensor itself when tied

    @property
    def lm_head_tied(self) -> bool:
        return isinstance(self.lm_head, DenseLinear) and self.lm_head.weight is self.embed

    @property
    def nbytes(self) -> int:
        """Bytes of every stored parameter; a tied LM head is the embedding, counted once."""
        total = _tensor_bytes(self.embed) + _tensor_bytes(self.final_norm)
        total += sum(layer.nbytes for layer in self.layers)
        return total if self.lm_head_tied else total + self.lm_head.nbytes

    @property
    def decode_nbytes(self) -> int:
        """Bytes of weights one decode step of a single sequence streams: every layer's
        norms and few-row projection copies, the final norm and the LM head (the
        embedding itself only when the head is tied to it; a lookup reads one row). The
        memory floor of a batch-1 token is this over the read bandwidth."""
        layers = sum(layer.decode_nbytes for layer in self.layers)
        return layers + _tensor_bytes(self.final_norm) + self.lm_head.decode_nbytes


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by position (rotate-half convention)."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        attention_scaling: float,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq.to(torch.float32))
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = (angles.cos() * attention_scaling).to(dtype=dtype, device=device)
        self.sin = (angles.sin() * attention_scaling).to(dtype=dtype, device=device)


class LlamaModel:
    """The decoder: ``forward`` over a flattened mixed batch, ``logits`` for chosen rows.

    ``kernels`` does the norms, rotary, activation and attention (engine/model/kernels/base.py);
    the projections are the weights' own ``Linear`` objects. With the native CPU kernels, a
    step of a few decodes runs every layer in one native call instead (``fast_decode``,
    engine/model/runtime/cpu_decode.py: the same kernels in the same order, bit-identical).
    """

    def __init__(
        self,
        spec: ModelSpec,
        weights: LlamaWeights,
        rope: RotaryEmbedding,
        kernels: TorchKernels | None = None,
    ):
        self.spec = spec
        self.weights = weights
        self.rope = rope
        self.kernels = kernels if kernels is not None else TorchKernels()
        self.scale = spec.head_dim**-0.5
        native = self.kernels.name == "native"
        self.fast_decode = DecodeLayers.build(weights) if native else None

    def replace(
        self, weights: LlamaWeights | None = None, kernels: TorchKernels | None = None
    ) -> LlamaModel:
        """The same model with other weights (e.g. quantized) or another kernel backend."""
        return LlamaModel(self.spec, weights or self.weights, self.rope, kernels or self.kernels)

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache
    ) -> torch.Tensor:
        """Hidden states ``[tokens, hidden]`` after the last layer (before the final norm).

        The residual stream is one tensor updated in place; ``add_rms_norm`` folds each
        sublayer's output into it and normalises for the next sublayer in one call.
        """
        eps = self.spec.rms_norm_eps
        kernels = self.kernels
        layers = self.weights.layers
        residual = F.embedding(token_ids, self.weights.embed)
        fast = self.fast_decode
        if fast is not None and kernels.name == "native" and fast.serves(meta, cache):
            rope = (self.rope.cos, self.rope.sin)
            return fast.run(residual, meta, cache, self.spec, rope, self.scale)
        hidden = kernels.rms_norm(residual, layers[0].input_norm, eps)
        for index, layer in enumerate(layers):
            if index:
                hidden = kernels.add_rms_norm(hidden, residual, layer.input_norm, eps)
            hidden = self._attention(index, layer, hidden, meta, cache)
            hidden = kernels.add_rms_norm(hidden, residual, layer.post_norm, eps)
            hidden = layer.down(kernels.silu_and_mul(layer.gate_up(hidden)))
        return residual.add_(hidden)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given final hidden rows."""
        normed = self.kernels.rms_norm(hidden, self.weights.final_norm, self.spec.rms_norm_eps)
        return self.weights.lm_head(normed).to(torch.float32)

    def _attention(
        self,
        index: int,
        layer: LayerWeights,
        x: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        qkv = layer.qkv(x)
        qkv = self.kernels.rotary(qkv, meta.positions, self.rope.cos, self.rope.sin, self.spec)
        attended = paged_attention(index, qkv, self.spec, cache, meta, self.scale, self.kernels)
        return layer.o_proj(attended)
