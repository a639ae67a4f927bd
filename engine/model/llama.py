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

from engine.model.attention import AttentionMetadata, paged_attention
from engine.model.kv_cache import PagedKVCache
from engine.model.quant_linear import DenseLinear, Linear
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

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions``, shaped ``[tokens, 1, head_dim]`` to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 (as the reference does), returned in x's dtype."""
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class LlamaModel:
    """The decoder: ``forward`` over a flattened mixed batch, ``logits`` for chosen rows."""

    def __init__(self, spec: ModelSpec, weights: LlamaWeights, rope: RotaryEmbedding):
        self.spec = spec
        self.weights = weights
        self.rope = rope
        self.scale = spec.head_dim**-0.5

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
        """Hidden states ``[tokens, hidden]`` after the last layer (before the final norm)."""
        spec = self.spec
        residual = F.embedding(token_ids, self.weights.embed)
        cos, sin = self.rope.tables(meta.positions)
        for index, layer in enumerate(self.weights.layers):
            normed = rms_norm(residual, layer.input_norm, spec.rms_norm_eps)
            residual = residual + self._attention(index, layer, normed, cos, sin, meta, cache)
            normed = rms_norm(residual, layer.post_norm, spec.rms_norm_eps)
            residual = residual + self._mlp(layer, normed)
        return residual

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given final hidden rows."""
        normed = rms_norm(hidden, self.weights.final_norm, self.spec.rms_norm_eps)
        return self.weights.lm_head(normed).to(torch.float32)

    def _attention(
        self,
        index: int,
        layer: LayerWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        spec = self.spec
        tokens = x.shape[0]
        qkv = layer.qkv(x)
        # Rotate query and key heads in one pass: they sit side by side in the QKV output.
        rope_width = spec.q_size + spec.kv_size
        rope_heads = spec.num_heads + spec.num_kv_heads
        rotated = apply_rotary(qkv[:, :rope_width].view(tokens, rope_heads, -1), cos, sin)
        query, key = rotated.split([spec.num_heads, spec.num_kv_heads], dim=1)
        value = qkv[:, rope_width:].view(tokens, spec.num_kv_heads, spec.head_dim)
        attended = paged_attention(index, query, key, value, cache, meta, self.scale)
        return layer.o_proj(attended)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up(x).chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)
