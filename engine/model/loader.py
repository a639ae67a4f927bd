"""Weights and tokenizer from a Hugging Face directory or a GGUF file.

Both go through transformers' own loaders (GGUF tensors are dequantized and un-permuted
there), then the state dict is repacked into kvserve's fused layout and the reference
model is dropped. Nothing is fetched from a hub: paths must be local.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.model.layers.decoder import LayerWeights, LlamaModel, LlamaWeights, RotaryEmbedding
from engine.model.layers.linear import DenseLinear
from engine.model.spec import ModelSpec, rope_inverse_frequencies, spec_from_hf_config

logger = logging.getLogger(__name__)


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
    source: ModelSource, dtype: torch.dtype, device: torch.device, max_positions: int
) -> LlamaModel:
    """Load weights through transformers, repack them, and build the paged decoder."""
    config = load_hf_config(source)
    spec = spec_from_hf_config(config)
    state = _load_state_dict(source, config, dtype)
    weights = weights_from_state_dict(spec, state, dtype, device)
    del state
    return build_model(config, spec, weights, max_positions)


def _load_state_dict(source: ModelSource, config: Any, dtype: torch.dtype) -> dict[str, Any]:
    """HF-named tensors. A GGUF is dequantized straight into a state dict (one pass over
    the file, no reference model built); a HF directory goes through from_pretrained."""
    from transformers import AutoModelForCausalLM

    if source.gguf_file is not None:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        path = str(source.directory / source.gguf_file)
        loaded = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)
        return {name: torch.as_tensor(t) for name, t in loaded["tensors"].items()}
    reference = AutoModelForCausalLM.from_pretrained(
        source.directory, dtype=dtype, **source.load_kwargs()
    )
    return dict(reference.state_dict())


def build_model(
    config: Any, spec: ModelSpec, weights: LlamaWeights, max_positions: int
) -> LlamaModel:
    inv_freq, scaling = rope_inverse_frequencies(config, spec)
    rope = RotaryEmbedding(
        inv_freq, scaling, max_positions, weights.embed.dtype, weights.embed.device
    )
    return LlamaModel(spec, weights, rope)


def model_from_reference(reference: Any, max_positions: int | None = None) -> LlamaModel:
    """Wrap an in-memory transformers Llama (tests, benchmarks) without touching disk."""
    spec = spec_from_hf_config(reference.config)
    param = next(reference.parameters())
    weights = weights_from_state_dict(spec, reference.state_dict(), param.dtype, param.device)
    positions = max_positions or spec.max_position_embeddings
    return build_model(reference.config, spec, weights, positions)


def weights_from_state_dict(
    spec: ModelSpec, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> LlamaWeights:
    """Repack HF Llama-style tensors into the fused layout, in ``dtype`` on ``device``."""

    def take(name: str) -> torch.Tensor:
        return state[name].to(device=device, dtype=dtype).contiguous()

    def fuse(*names: str) -> torch.Tensor:
        return torch.cat([state[n].to(dtype) for n in names], dim=0).to(device).contiguous()

    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        bias_names = [attn + f"{x}_proj.bias" for x in ("q", "k", "v")]
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=DenseLinear(
                    fuse(*(attn + f"{x}_proj.weight" for x in ("q", "k", "v"))),
                    fuse(*bias_names) if bias_names[0] in state else None,
                ),
                o_proj=DenseLinear(take(attn + "o_proj.weight")),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=DenseLinear(fuse(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
                down=DenseLinear(take(p + "mlp.down_proj.weight")),
            )
        )
    embed = take("model.embed_tokens.weight")
    tied = spec.tie_word_embeddings or "lm_head.weight" not in state
    return LlamaWeights(
        embed=embed,
        layers=layers,
        final_norm=take("model.norm.weight"),
        lm_head=DenseLinear(embed if tied else take("lm_head.weight")),
    )
