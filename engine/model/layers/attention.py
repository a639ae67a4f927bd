"""The attention sublayer: fused QKV projection (optional bias), optional QK RMSNorm,
rotary, the paged attention call with the layer's ``AttentionParams``, output projection.

QK-norm comes in two shapes: per head (Qwen3, Gemma 3: one ``[head_dim]`` weight shared
by the heads) and over all heads (OLMo 2: ``[q_size]`` / ``[kv_size]`` weights over each
row's whole query / key part). Both normalise before the rotary, as the references do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.kernels.base import Kernels
from engine.model.kernels.metadata import AttentionMetadata
from engine.model.kernels.params import AttentionParams
from engine.model.layers.linear import Linear
from engine.model.layers.rotary import RotaryEmbedding
from engine.model.runtime.kv_cache import PagedKVCache
from engine.model.spec import ModelSpec

QK_NORM_PER_HEAD = "per_head"
QK_NORM_ALL_HEADS = "all_heads"


@dataclass
class AttentionWeights:
    qkv: Linear  # [q_size + 2 * kv_size, hidden], with the QKV bias when the model has one
    o_proj: Linear  # [hidden, q_size], with its bias when the model has one (gpt-oss)
    q_norm: torch.Tensor | None = None  # [head_dim] per head, or [q_size] over all heads
    k_norm: torch.Tensor | None = None  # [head_dim] per head, or [kv_size] over all heads
    sinks: torch.Tensor | None = None  # [num_heads] float32 (gpt-oss)


@dataclass(frozen=True)
class AttentionLayer:
    """One layer's attention: which cache layer, which RoPE table, which parameters."""

    index: int
    params: AttentionParams
    rope: RotaryEmbedding
    qk_norm: str | None = None  # None, QK_NORM_PER_HEAD or QK_NORM_ALL_HEADS

    def __call__(
        self,
        weights: AttentionWeights,
        x: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        spec: ModelSpec,
        kernels: Kernels,
    ) -> torch.Tensor:
        qkv = weights.qkv(x)
        if self.qk_norm is not None:
            qkv = normalize_qk(qkv, weights, self.qk_norm, spec, kernels)
        qkv = kernels.rotary(qkv, meta.positions, self.rope.cos, self.rope.sin, spec)
        attended = paged_attention(self.index, qkv, spec, cache, meta, self.params, kernels)
        return weights.o_proj(attended)


def paged_attention(
    layer: int,
    qkv: torch.Tensor,
    spec: ModelSpec,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    params: AttentionParams,
    kernels: Kernels,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend every row to its context.

    ``qkv`` is the rotated ``[tokens, q_size + 2 * kv_size]`` projection output.
    Returns ``[tokens, heads * head_dim]``. ``meta`` is the step's; the layer reads its KV
    group's block tables and slots (``AttentionMetadata.for_layer``).
    """
    meta = meta.for_layer(layer)
    kernels.write_kv(cache, layer, qkv, meta.slots, spec)
    if meta.varlen is not None:  # the whole batch in one launch
        return kernels.varlen_attention(cache, layer, qkv, meta, spec, params)
    parts: list[torch.Tensor] = []
    if meta.num_decodes:
        decodes = qkv[: meta.num_decodes]
        parts.append(kernels.decode_attention(cache, layer, decodes, meta, spec, params))
    if meta.prefills:
        parts.append(kernels.prefill_attention(cache, layer, qkv, meta, spec, params))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def normalize_qk(
    qkv: torch.Tensor, weights: AttentionWeights, mode: str, spec: ModelSpec, kernels: Kernels
) -> torch.Tensor:
    """RMSNorm the query and key parts of ``qkv`` in place (values untouched)."""
    assert weights.q_norm is not None and weights.k_norm is not None
    tokens = qkv.shape[0]
    eps = spec.rms_norm_eps
    parts = ((0, spec.q_size, weights.q_norm), (spec.q_size, spec.kv_size, weights.k_norm))
    for start, width, weight in parts:
        part = qkv[:, start : start + width]
        rows = part.reshape(-1, spec.head_dim) if mode == QK_NORM_PER_HEAD else part
        normed = kernels.rms_norm(rows.contiguous(), weight, eps)
        part.copy_(normed.view(tokens, width))
    return qkv
