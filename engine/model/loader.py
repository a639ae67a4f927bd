"""Weights and tokenizer from a Hugging Face directory or a GGUF file.

config -> ``ModelSpec`` (spec.py) and the family module (registry.py); weights through
transformers' own loaders (sharded safetensors in a directory; GGUF tensors dequantized
and un-permuted there) into a state dict; the family repacks it into the fused layout
(``family.load_weights``) and says how its layers combine (``family.decoder_options``);
the reference model is dropped. A ``*ForSequenceClassification`` checkpoint loads the
same decoder plus its classifier head (``ModelWeights.classifier``). Nothing is fetched
from a hub: paths must be local.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from engine.model.families.hf_names import TensorReader
from engine.model.layers.decoder import DecoderModel, DecoderOptions, ModelWeights
from engine.model.layers.rotary import rotary_tables
from engine.model.registry import classifier_labels, load_family, text_config
from engine.model.spec import ModelSpec, spec_from_hf_config

logger = logging.getLogger(__name__)


class Family(Protocol):
    """What a family module (engine/model/families/<name>.py) defines."""

    def decoder_options(self, config: Any, dtype: torch.dtype) -> DecoderOptions:
        """How the shared decoder combines this family's layers (norm placement, scales,
        soft-caps), for ``config`` served in ``dtype``."""
        ...

    def load_weights(self, config: Any, spec: ModelSpec, tensors: TensorReader) -> ModelWeights:
        """The model's weights from its Hugging Face-named tensors, in the fused layout."""
        ...


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives: a HF directory, or a GGUF file inside some directory."""

    directory: Path
    gguf_file: str | None

    @classmethod
    def from_path(cls, path: str | Path) -> ModelSource:
        resolved = Path(path).expanduser()
        if resolved.is_file() and resolved.suffix == ".gguf":
            return cls(resolved.parent, resolved.name)
        if resolved.is_dir() and (resolved / "config.json").is_file():
            return cls(resolved, None)
        raise FileNotFoundError(
            f"model {str(path)!r} is neither a .gguf file nor a local Hugging Face "
            "directory with config.json (kvserve never downloads models)"
        )

    @property
    def name(self) -> str:
        """Default served name: the GGUF's stem without its quantization suffix, or the
        directory name."""
        if self.gguf_file is None:
            return self.directory.name
        stem = Path(self.gguf_file).stem
        return stem.split(".")[0] if "." in stem else stem

    def load_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"local_files_only": True}
        if self.gguf_file is not None:
            kwargs["gguf_file"] = self.gguf_file
        return kwargs


def load_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.directory, **source.load_kwargs())


def load_hf_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source.directory, **source.load_kwargs())


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    context_len: int | None = None,
) -> DecoderModel:
    """Load weights through transformers, repack them, and build the paged decoder with
    RoPE tables of ``max_positions`` positions for a server of ``context_len`` tokens
    (layers/rotary.py: LongRoPE's factors depend on it)."""
    config = load_hf_config(source)
    spec_from_hf_config(config)  # refuse an unsupported model before reading its weights
    state = _load_state_dict(source, config, dtype)
    return build_model(config, state, dtype, device, max_positions, context_len)


def _load_state_dict(source: ModelSource, config: Any, dtype: torch.dtype) -> dict[str, Any]:
    """HF-named tensors. A GGUF is dequantized straight into a state dict (one pass over
    the file, no reference model built); a HF directory goes through from_pretrained."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if source.gguf_file is not None:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        check_gguf_readable(source.directory / source.gguf_file, config)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        path = str(source.directory / source.gguf_file)
        loaded = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)
        return {name: torch.as_tensor(t) for name, t in loaded["tensors"].items()}
    # A classifier checkpoint through its own class: the causal one would drop ``score``.
    auto = AutoModelForSequenceClassification if classifier_labels(config) else AutoModelForCausalLM
    reference = auto.from_pretrained(
        source.directory, dtype=dtype, **source.load_kwargs(), **_dequantizing(config)
    )
    return dict(reference.state_dict())


def _dequantizing(config: Any) -> dict[str, Any]:
    """from_pretrained's arguments for a checkpoint stored quantized: MXFP4 (gpt-oss's
    released experts) is dequantized to the serving dtype as it loads, on any machine
    (transformers would otherwise reach for GPU kernels where it finds them)."""
    quantization = getattr(config, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method is None:
        method = getattr(quantization, "quant_method", None)
    if str(method) in ("mxfp4", "QuantizationMethod.MXFP4"):
        from transformers import Mxfp4Config  # type: ignore[attr-defined]

        return {"quantization_config": Mxfp4Config(dequantize=True)}
    if method is not None:
        raise ValueError(
            f"checkpoints quantized with {method!r} are not served; kvserve loads bf16, fp16 "
            "or fp32 weights (and MXFP4 experts) and quantizes with --quantization int8|int4"
        )
    return {}


# Experts transformers' GGUF reader cannot hand over as the model it builds holds them.
_GGUF_EXPERTS_UNREAD = {
    "gpt_oss": "transformers' GGUF reader names gpt-oss experts one by one, not as the "
    "stacked tensors its model holds",
}


def check_gguf_readable(path: Path, config: Any) -> None:
    """Refuse a GGUF whose experts transformers' reader would drop or misplace, rather than
    serve a model without them: an MoE written under a dense architecture (llama.cpp
    writes Mixtral as ``llama``, which transformers reads as a Llama without experts) and
    gpt-oss. ValueError naming the way out."""
    from gguf import GGUFReader

    model_type = str(config.model_type)
    reason = _GGUF_EXPERTS_UNREAD.get(model_type)
    if reason is None:
        reader = GGUFReader(str(path))
        architecture = reader.fields["general.architecture"].contents()
        field = reader.fields.get(f"{architecture}.expert_count")
        experts = int(field.contents()) if field is not None else 0
        if (
            experts
            and getattr(config, "num_experts", None) is None
            and not hasattr(config, "num_local_experts")
        ):
            reason = (
                f"it holds {experts} experts per layer under the '{architecture}' "
                f"architecture, which transformers reads as a dense {model_type} model"
            )
    if reason is not None:
        raise ValueError(
            f"cannot serve {path.name}: {reason}; serve the model's Hugging Face directory "
            "instead (kvserve serve --model DIR)"
        )


def build_model(
    config: Any,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    context_len: int | None = None,
) -> DecoderModel:
    """The decoder for ``config`` from its HF-named tensors ``state``."""
    spec = spec_from_hf_config(config)
    family = cast(Family, load_family(config))
    weights = family.load_weights(config, spec, TensorReader(state, dtype, device))
    served = min(context_len or max_positions, spec.max_position_embeddings)
    ropes = rotary_tables(text_config(config), spec, max_positions, dtype, device, served)
    return DecoderModel(spec, weights, ropes, options=family.decoder_options(config, dtype))


def model_from_reference(
    reference: Any, max_positions: int | None = None, context_len: int | None = None
) -> DecoderModel:
    """Wrap an in-memory transformers model (tests, benchmarks) without touching disk."""
    param = next(reference.parameters())
    positions = max_positions or spec_from_hf_config(reference.config).max_position_embeddings
    return build_model(
        reference.config, reference.state_dict(), param.dtype, param.device, positions, context_len
    )
