"""The shape of a decoder and of each of its layers, read once from a Hugging Face config.

Torch-free on purpose: the KV side (accounting, plan, the scheduler's groups) reads
``ModelSpec.layers`` to learn which layers keep a full history and which a sliding window
without importing a model. Every family's config goes through ``spec_from_hf_config``;
what differs between families beyond these numbers (norm placement, activations, scales)
lives in the family modules (engine/model/families/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.kv.accounting import KVShape
from engine.kv.groups import plan_kv_groups
from engine.model.registry import classifier_labels, family_name, text_config

# Attention kinds a layer can have. "chunked" (Llama 4's local chunks) and "recurrent"
# (linear-attention / state-space layers) have names reserved here; no family uses them yet.
FULL = "full"
SLIDING = "sliding"
ATTENTION_KINDS = (FULL, SLIDING)
# transformers 5's ``config.layer_types`` names for the kinds kvserve runs.
_LAYER_TYPE_KINDS = {"full_attention": FULL, "sliding_attention": SLIDING}
# The RoPE table of a model with one table for every layer.
DEFAULT_ROPE = "default"


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer's attention sees.

    ``window`` (sliding layers only) counts the tokens a query attends including itself,
    as transformers' sliding masks do: key ``k`` is visible to query ``q`` iff
    ``q - window < k <= q``. ``rope`` names the RoPE table the layer rotates with (Gemma 3:
    its local and global layers use different bases); ``DEFAULT_ROPE`` where there is one.
    """

    attention: str = FULL
    window: int | None = None
    rope: str = DEFAULT_ROPE

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention kind {self.attention!r}")
        if (self.attention == SLIDING) != (self.window is not None):
            raise ValueError("a sliding layer needs a window and only a sliding layer has one")
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must be at least 1 token, not {self.window}")


@dataclass(frozen=True)
class ModelSpec:
    """Everything the forward pass and the KV cache need to know about the model's shape.

    ``layers`` holds one ``LayerSpec`` per layer; left empty it means every layer has full
    attention (and is filled in so). ``num_labels``: the logits of the classifier head a
    ``*ForSequenceClassification`` checkpoint has instead of an LM head (0: a causal LM).
    """

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layers: tuple[LayerSpec, ...] = ()
    num_labels: int = 0

    def __post_init__(self) -> None:
        if not self.layers:
            object.__setattr__(self, "layers", (LayerSpec(),) * self.num_layers)
        if len(self.layers) != self.num_layers:
            raise ValueError(f"{len(self.layers)} layer specs for {self.num_layers} layers")

    @property
    def context_limit(self) -> int:
        """Longest sequence the model serves (sliding layers attend exactly past their
        window, so the window does not bound it)."""
        return self.max_position_embeddings

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window in tokens, None for a full-attention layer."""
        return tuple(layer.window for layer in self.layers)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 = multi-head attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_shape(self, kv_dtype: str, hybrid: bool = True) -> KVShape:
        """The KV cost of a token, with the KV groups the layers' windows form
        (engine/kv/groups.py); ``hybrid`` False keeps every layer's blocks (one full group,
        ``--disable-hybrid-kv-cache-manager``)."""
        return KVShape(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            kv_dtype=kv_dtype,
            groups=plan_kv_groups(self.layer_windows, hybrid),
        )


def spec_from_hf_config(config: Any) -> ModelSpec:
    """Read a ModelSpec from a transformers config. Raises ValueError for a family kvserve
    has no module for and for a layer type it cannot run (naming it)."""
    family_name(config)  # refuses a model type kvserve has no family module for
    num_labels = classifier_labels(config)  # the architecture is the outer config's
    config = text_config(config)
    model_type = str(config.model_type)
    num_heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    num_layers = int(config.num_hidden_layers)
    return ModelSpec(
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=int(config.hidden_size),
        num_heads=num_heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
        head_dim=int(head_dim),
        intermediate_size=int(config.intermediate_size),
        vocab_size=int(config.vocab_size),
        rms_norm_eps=float(config.rms_norm_eps),
        max_position_embeddings=int(config.max_position_embeddings),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        layers=layer_specs(config, num_layers),
        num_labels=num_labels,
    )


def layer_specs(config: Any, num_layers: int) -> tuple[LayerSpec, ...]:
    """Each layer's attention, from ``config.layer_types`` (transformers 5; Qwen2/Qwen3
    derive it from ``use_sliding_window`` and ``max_window_layers``), or, without it, a
    ``sliding_window`` on every layer (Mistral) or none."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        kind = "sliding_attention" if _sliding_window(config) else "full_attention"
        layer_types = [kind] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"config.layer_types lists {len(layer_types)} of {num_layers} layers")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not served")
    keyed_rope = _rope_keyed_by_layer_type(config, layer_types)
    return tuple(_layer_spec(config, kind, keyed_rope) for kind in layer_types)


def _layer_spec(config: Any, layer_type: str, keyed_rope: bool) -> LayerSpec:
    kind = _LAYER_TYPE_KINDS.get(layer_type)
    if kind is None:
        raise ValueError(
            f"unsupported layer type {layer_type!r} in config.layer_types; kvserve runs "
            f"{sorted(_LAYER_TYPE_KINDS)}"
        )
    rope = layer_type if keyed_rope else DEFAULT_ROPE
    if kind == FULL:
        return LayerSpec(FULL, None, rope)
    window = _sliding_window(config)
    if window is None:
        raise ValueError(f"layer type {layer_type!r} needs config.sliding_window")
    return LayerSpec(SLIDING, window, rope)


def _sliding_window(config: Any) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return None
    return int(window)


def _rope_keyed_by_layer_type(config: Any, layer_types: list[str]) -> bool:
    """Whether ``config.rope_parameters`` holds one parameter set per layer type
    (transformers 5 for Gemma 3: local and global layers rotate with different bases)."""
    params = getattr(config, "rope_parameters", None)
    return (
        isinstance(params, dict)
        and bool(params)
        and all(isinstance(value, dict) for value in params.values())
        and set(layer_types) <= set(params)
    )
