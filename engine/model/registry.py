"""Which family module runs a config: its ``model_type`` (else its architecture) names a
module under engine/model/families/, imported only when a model is built.

Torch-free, so spec.py (and through it the KV side) can refuse an unsupported model
without importing a model. A family module provides the two functions of
``loader.Family``.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType, ModuleType
from typing import Any

_PACKAGE = "engine.model.families"
# model_type -> family module. One module may run several model types.
FAMILIES = MappingProxyType(
    {
        "llama": "llama",
        "mistral": "llama",
        "ministral": "llama",  # Mistral's layers, with per-layer sliding/full in layer_types
        "qwen2": "llama",
        "qwen3": "qwen3",
        "phi3": "phi3",
        "olmo2": "olmo2",
        "granite": "granite",
        "mixtral": "mixtral",
        "qwen3_moe": "mixtral",
        "gpt_oss": "gpt_oss",
        "gemma2": "gemma2",
        "gemma3_text": "gemma3",
        "gemma3": "gemma3",  # the multimodal checkpoint: its text model is served
    }
)
# A config's architecture -> model_type, for configs whose model_type is not listed above.
ARCHITECTURES = MappingProxyType(
    {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "MinistralForCausalLM": "ministral",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "Phi3ForCausalLM": "phi3",
        "Olmo2ForCausalLM": "olmo2",
        "GraniteForCausalLM": "granite",
        "MixtralForCausalLM": "mixtral",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "GptOssForCausalLM": "gpt_oss",
        "Gemma2ForCausalLM": "gemma2",
        "Gemma3ForCausalLM": "gemma3_text",
        "Gemma3ForConditionalGeneration": "gemma3",
    }
)
# Multimodal model types whose text model kvserve serves (their ``text_config``).
TEXT_MODEL_OF = MappingProxyType({"gemma3": "gemma3_text"})
# A checkpoint of a family above with a classifier head instead of the LM head (e.g.
# ``Qwen3ForSequenceClassification``): the decoder under ``model.``, the head ``score``.
CLASSIFIER_SUFFIX = "ForSequenceClassification"


def family_name(config: Any) -> str:
    """The family module that runs ``config``; ValueError naming the model type if none."""
    model_type = str(getattr(config, "model_type", ""))
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    for architecture in getattr(config, "architectures", None) or ():
        if architecture in ARCHITECTURES:
            return FAMILIES[ARCHITECTURES[architecture]]
    raise ValueError(f"unsupported model type {model_type!r}; kvserve runs {sorted(FAMILIES)}")


def classifier_labels(config: Any) -> int:
    """How many logits the classifier head of a ``*ForSequenceClassification`` checkpoint
    gives (its ``score`` layer's rows, ``config.num_labels``); 0 for a causal LM."""
    architectures = getattr(config, "architectures", None) or ()
    if any(str(name).endswith(CLASSIFIER_SUFFIX) for name in architectures):
        return int(config.num_labels)
    return 0


def text_config(config: Any) -> Any:
    """The config of the decoder kvserve serves: a multimodal model's text config, else
    ``config`` itself."""
    if getattr(config, "model_type", "") in TEXT_MODEL_OF:
        return config.get_text_config()
    return config


def load_family(config: Any) -> ModuleType:
    """The family module for ``config``, imported now."""
    return importlib.import_module(f"{_PACKAGE}.{family_name(config)}")
