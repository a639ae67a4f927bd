"""The one decoder every family instantiates: embeddings, layers of attention and MLP
sublayers over a residual stream, final norm, LM head; attention reads and writes a
paged KV cache.

A family (engine/model/families/) says how its layers combine through ``DecoderOptions``
and which norms its ``LayerWeights`` carry. Each sublayer computes
``residual += post_norm(sublayer(pre_norm(residual))) * residual_multiplier``, every part
optional: pre-norm only (Llama), sandwich norms (Gemma 2/3), post-norm only (OLMo 2). The
residual stream is one tensor updated in place, and where a sublayer has a pre-norm the
previous sublayer's add is fused into it (``add_rms_norm``). The forward returns final
hidden states only for the rows the caller asks for, so a long prefill never materialises
a ``[tokens, vocab]`` logits matrix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.kernels.base import Kernels, TorchKernels
from engine.model.kernels.metadata import AttentionMetadata
from engine.model.kernels.params import AttentionParams
from engine.model.layers.attention import QK_NORM_PER_HEAD, AttentionLayer, AttentionWeights
from engine.model.layers.linear import DenseLinear, Linear, parameter_bytes
from engine.model.layers.lora import LoRABatch, unwrap
from engine.model.layers.mlp import MLP, SILU, GatedMLP
from engine.model.layers.moe import MoEMLP
from engine.model.layers.rotary import RotaryEmbedding
from engine.model.runtime.cpu_decode import DecodeLayers, PlainLayer
from engine.model.runtime.kv_cache import PagedKVCache
from engine.model.spec import ModelSpec


@dataclass(frozen=True)
class DecoderOptions:
    """How a family's layers combine, beyond the weights it loads. Defaults are Llama's."""

    qk_norm: str | None = None  # layers/attention.py: QK_NORM_PER_HEAD or QK_NORM_ALL_HEADS
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2's attention logit soft-cap
    final_softcap: float | None = None  # Gemma 2/3's final logit soft-cap
    embedding_scale: float | None = None  # Gemma: sqrt(hidden) in the model dtype; Granite
    residual_multiplier: float | None = None  # Granite: scales each sublayer's output
    logits_divisor: float | None = None  # Granite: logits / logits_scaling


@dataclass
class LayerWeights:
    """One layer's weights. A norm left None is not applied."""

    attention: AttentionWeights
    mlp: MLP
    input_norm: torch.Tensor | None = None  # before attention (Llama's input_layernorm)
    pre_mlp_norm: torch.Tensor | None = None  # before the MLP (Llama's post_attention_layernorm)
    post_attention_norm: torch.Tensor | None = None  # after attention (Gemma, OLMo 2)
    post_mlp_norm: torch.Tensor | None = None  # after the MLP (Gemma, OLMo 2)

    @property
    def nbytes(self) -> int:
        return parameter_bytes(self)

    @property
    def decode_nbytes(self) -> int:
        return parameter_bytes(self, decode=True)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Linear  # a DenseLinear over the embedding tensor itself when tied
    # A *ForSequenceClassification checkpoint's head ``[num_labels, hidden]``, read by
    # classification pooling (engine/pooling.py); None for a causal LM.
    classifier: torch.Tensor | None = None

    @property
    def lm_head_tied(self) -> bool:
        return isinstance(self.lm_head, DenseLinear) and self.lm_head.weight is self.embed

    @property
    def nbytes(self) -> int:
        """Bytes of every stored parameter; a tied LM head is the embedding, counted once."""
        total = parameter_bytes([self.embed, self.final_norm, self.layers, self.classifier])
        return total if self.lm_head_tied else total + self.lm_head.nbytes

    @property
    def decode_nbytes(self) -> int:
        """Bytes of weights one decode step of a single sequence streams: every layer's
        norms and few-row projection copies, the final norm and the LM head (the
        embedding itself only when the head is tied to it; a lookup reads one row). The
        memory floor of a batch-1 token is this over the read bandwidth."""
        layers = parameter_bytes(self.layers, decode=True)
        return layers + parameter_bytes(self.final_norm) + self.lm_head.decode_nbytes


class DecoderModel:
    """The decoder: ``forward`` over a flattened mixed batch, ``logits`` for chosen rows.

    ``kernels`` does the norms, rotary, activation and attention (engine/model/kernels/);
    the projections are the weights' own ``Linear`` objects. ``ropes`` maps each
    ``LayerSpec.rope`` name to its table. With the native CPU kernels, a step of a few
    decodes of a Llama-shaped model runs every layer in one native call instead
    (``fast_decode``, runtime/cpu_decode.py: the same kernels in the same order,
    bit-identical).
    """

    def __init__(
        self,
        spec: ModelSpec,
        weights: ModelWeights,
        ropes: Mapping[str, RotaryEmbedding],
        kernels: Kernels | None = None,
        options: DecoderOptions | None = None,
        lora_batch: LoRABatch | None = None,
    ):
        self.spec = spec
        self.weights = weights
        self.ropes = dict(ropes)
        self.kernels: Kernels = kernels if kernels is not None else TorchKernels()
        self.options = options if options is not None else DecoderOptions()
        self.attention = tuple(
            AttentionLayer(index, self._params(index), self.ropes[layer.rope], self.options.qk_norm)
            for index, layer in enumerate(spec.layers)
        )
        # The rows' LoRA adapters (layers/lora.py) when the projections carry slots.
        self.lora_batch = lora_batch
        native = self.kernels.name == "native"
        self.fast_decode = fast_decode_path(self) if native else None

    def _params(self, index: int) -> AttentionParams:
        spec, options = self.spec, self.options
        scale = options.attention_scale
        return AttentionParams(
            scale=spec.head_dim**-0.5 if scale is None else scale,
            window=spec.layers[index].window,
            softcap=options.attn_softcap,
            sinks=self.weights.layers[index].attention.sinks,
        )

    def replace(
        self,
        weights: ModelWeights | None = None,
        kernels: Kernels | None = None,
        lora_batch: LoRABatch | None = None,
    ) -> DecoderModel:
        """The same model with other weights (e.g. quantized or with LoRA slots) or another
        kernel backend."""
        return DecoderModel(
            self.spec,
            weights or self.weights,
            self.ropes,
            kernels or self.kernels,
            self.options,
            lora_batch or self.lora_batch,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.embed.dtype

    @property
    def syncs_on_host(self) -> bool:
        """Whether a forward reads device values on the host (an MoE layer reads how many
        tokens chose each expert), which a CUDA graph cannot capture."""
        return any(isinstance(layer.mlp, MoEMLP) for layer in self.weights.layers)

    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache
    ) -> torch.Tensor:
        """Hidden states ``[tokens, hidden]`` after the last layer (before the final norm)."""
        residual = F.embedding(token_ids, self.weights.embed)
        if self.options.embedding_scale is not None:
            residual.mul_(self.options.embedding_scale)
        fast = self.fast_decode
        lora = self.lora_batch
        if fast is not None and (lora is None or not lora.active) and fast.serves(meta, cache):
            rope = self.attention[0].rope
            scale = self.attention[0].params.scale
            return fast.run(residual, meta, cache, self.spec, (rope.cos, rope.sin), scale)
        pending: torch.Tensor | None = None  # the last sublayer's output, not yet added
        for layer, attention in zip(self.weights.layers, self.attention, strict=True):
            hidden = self._enter(pending, residual, layer.input_norm)
            out = attention(layer.attention, hidden, meta, cache, self.spec, self.kernels)
            pending = self._leave(out, layer.post_attention_norm)
            hidden = self._enter(pending, residual, layer.pre_mlp_norm)
            pending = self._leave(layer.mlp(hidden, self.kernels), layer.post_mlp_norm)
        return residual if pending is None else residual.add_(pending)

    def _enter(
        self, pending: torch.Tensor | None, residual: torch.Tensor, norm: torch.Tensor | None
    ) -> torch.Tensor:
        """Add the previous sublayer's output into the residual stream and return the next
        sublayer's input: the normalised stream, or the stream itself without a pre-norm."""
        eps = self.spec.rms_norm_eps
        if norm is None:
            if pending is not None:
                residual.add_(pending)
            return residual
        if pending is None:
            return self.kernels.rms_norm(residual, norm, eps)
        return self.kernels.add_rms_norm(pending, residual, norm, eps)

    def _leave(self, out: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """A sublayer's output as it joins the residual stream."""
        if norm is not None:
            out = self.kernels.rms_norm(out, norm, self.spec.rms_norm_eps)
        if self.options.residual_multiplier is not None:
            out = out * self.options.residual_multiplier
        return out

    @torch.inference_mode()
    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """``forward``'s rows after the final norm: what the LM head reads (and what
        embeddings pool, engine/pooling.py)."""
        return self.kernels.rms_norm(hidden, self.weights.final_norm, self.spec.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given final hidden rows."""
        logits = self.weights.lm_head(self.final_hidden(hidden))
        options = self.options
        if options.logits_divisor is not None:
            logits = logits / options.logits_divisor
        if options.final_softcap is not None:
            logits = torch.tanh(logits / options.final_softcap) * options.final_softcap
        return logits.to(torch.float32)

    @torch.inference_mode()
    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, num_labels]`` of the classifier head for the given
        final hidden rows: transformers' ``*ForSequenceClassification`` (final norm, then
        ``score``; no soft-cap or divisor, which only its causal LM applies). Summed in
        float32 whatever the model's dtype: one row per prompt costs nothing."""
        head = self.weights.classifier
        assert head is not None, "classification pooling on a model without a classifier head"
        return self.final_hidden(hidden).to(torch.float32) @ head.to(torch.float32).T


def fast_decode_path(model: DecoderModel) -> DecodeLayers | None:
    """The native decode path for a model whose every layer is Llama-shaped (pre-norm in
    the model dtype, plain attention with one scale and one full-width RoPE table, no
    QK-norm or Qwen3's per-head one, a SwiGLU MLP or a mixture of experts the native MoE op
    runs), Granite's multipliers included; None otherwise."""
    options = model.options
    per_head = options.qk_norm == QK_NORM_PER_HEAD  # the one QK-norm the native path runs
    # Applied outside the layers (embedding, logits) or handed to the call (the others).
    reshaped = dataclasses.replace(
        options,
        qk_norm=None if per_head else options.qk_norm,
        embedding_scale=None,
        attention_scale=None,
        residual_multiplier=None,
        logits_divisor=None,
    )
    if reshaped != DecoderOptions() or len(model.ropes) != 1:
        return None
    rope = next(iter(model.ropes.values()))
    if rope.cos.shape[-1] != model.spec.head_dim:
        return None
    scales = {layer.params.scale for layer in model.attention}
    plain = all(p.softcap is None and p.sinks is None for p in (a.params for a in model.attention))
    if len(scales) != 1 or not plain:
        return None
    layers = [_plain_layer(layer, model.dtype, per_head) for layer in model.weights.layers]
    if any(layer is None for layer in layers):
        return None
    windows = [w for w in model.spec.layer_windows if w is not None]
    multiplier = options.residual_multiplier
    return DecodeLayers.build(
        [layer for layer in layers if layer is not None],
        min(windows, default=None),
        1.0 if multiplier is None else multiplier,
    )


def _plain_layer(layer: LayerWeights, dtype: torch.dtype, qk_norm: bool) -> PlainLayer | None:
    """The layer as ``decode_layers`` runs it (``qk_norm``: with its per-head QK-norm),
    or None where it is shaped otherwise."""
    attention, mlp = layer.attention, layer.mlp
    q_norm, k_norm = attention.q_norm, attention.k_norm
    qk_norms = (q_norm, k_norm) if q_norm is not None and k_norm is not None else None
    norms = (layer.input_norm, layer.pre_mlp_norm, q_norm, k_norm)
    if (
        layer.post_attention_norm is not None
        or layer.post_mlp_norm is not None
        or {q_norm is not None, k_norm is not None} != {qk_norm}  # both norms, or neither
        or attention.sinks is not None
        or not _plain_feed_forward(mlp, dtype)
        or norms[0] is None
        or norms[1] is None
        or any(norm.dtype != dtype for norm in norms if norm is not None)
    ):
        return None
    input_norm, mlp_norm = norms[0], norms[1]
    assert input_norm is not None and mlp_norm is not None  # checked above; for mypy
    # With LoRA slots, the path runs the base projections: the decoder takes it only in a
    # step without adapter rows.
    qkv, o_proj = unwrap(attention.qkv), unwrap(attention.o_proj)
    if isinstance(mlp, MoEMLP):
        native = mlp.native_moe(dtype)
        assert native is not None  # checked above
        return PlainLayer(input_norm, mlp_norm, qkv, o_proj, None, None, qk_norms, native.weights)
    assert isinstance(mlp, GatedMLP)
    gate_up, down = unwrap(mlp.gate_up), unwrap(mlp.down)
    return PlainLayer(input_norm, mlp_norm, qkv, o_proj, gate_up, down, qk_norms)


def _plain_feed_forward(mlp: MLP, dtype: torch.dtype) -> bool:
    """A SwiGLU MLP, or a mixture of experts the native MoE op runs on ``dtype``."""
    if isinstance(mlp, MoEMLP):
        return mlp.native_moe(dtype) is not None
    return isinstance(mlp, GatedMLP) and mlp.activation == SILU
