"""Every family from disk and quantized: a sharded Hugging Face directory and (where
transformers reads the architecture) a GGUF through engine/model/loader.py give the same
model as the in-memory reference; int8 and int4 reach every projection of every family.

The GGUFs are written here with the gguf package, in float32, as llama.cpp's converter
lays them out (Llama's Q/K rows permuted for its rotary, Gemma's norms stored as 1 + w).
transformers' GGUF reader takes the config from the file's metadata and class defaults, so
the references use the defaults for what the metadata does not carry (Gemma's soft-caps,
query_pre_attn_scalar, Gemma 3's local RoPE base, Qwen3's head_dim). Mistral is not
covered: llama.cpp writes it as a ``llama`` GGUF (transformers tells them apart by the
model's name), the same tensors as the Llama case.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.model.kernels.native import NativeKernels, load_native_ops
from engine.model.layers.decoder import DecoderModel, ModelWeights
from engine.model.layers.linear import (
    DenseLinear,
    Int4Linear,
    Int8Linear,
    Linear,
    linear_layers,
    map_linears,
)
from engine.model.layers.quantize import quantize_weights
from engine.model.loader import ModelSource, load_model, model_from_reference
from tests.model.family_models import FAMILIES, base, random_reference
from tests.model.paged import BlockTables, make_cache, run_step

PROMPT = [(13 * i + 7) % 250 for i in range(40)]


def prompt_logits(model: DecoderModel, block_size: int = 8) -> torch.Tensor:
    """Logits of PROMPT prefilled in two chunks."""
    cache = make_cache(model, num_blocks=16, block_size=block_size)
    blocks = [BlockTables(16).allocate(len(PROMPT), block_size)]
    first = run_step(model, cache, [PROMPT[:23]], [0], blocks)
    return torch.cat([first, run_step(model, cache, [PROMPT[23:]], [23], blocks)])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_sharded_hf_directory_loads_as_the_reference(family: str, tmp_path: Path) -> None:
    reference = random_reference(FAMILIES[family][0])
    reference.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(ModelSource.from_path(tmp_path), torch.float32, torch.device("cpu"), 256)
    expected = prompt_logits(model_from_reference(reference))
    torch.testing.assert_close(prompt_logits(loaded), expected, atol=0, rtol=0)


def test_a_bf16_checkpoint_loads_in_bf16(tmp_path: Path) -> None:
    reference = random_reference(FAMILIES["qwen3"][0]).to(torch.bfloat16)
    reference.save_pretrained(tmp_path, max_shard_size="100KB")
    loaded = load_model(ModelSource.from_path(tmp_path), torch.bfloat16, torch.device("cpu"), 256)
    assert loaded.dtype == torch.bfloat16
    expected = prompt_logits(model_from_reference(reference))
    torch.testing.assert_close(prompt_logits(loaded), expected, atol=0, rtol=0)


def llama_gguf() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**base()))


def qwen2_gguf() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**base()))


def qwen3_gguf() -> Any:
    """head_dim 128: transformers reads no head_dim from a Qwen3 GGUF and takes the
    class default (every released Qwen3 has 128)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**base(head_dim=128)))


def phi3_gguf() -> Any:
    """Plain RoPE: transformers reads no LongRoPE factors or partial rotary from a GGUF."""
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(**base(), pad_token_id=0))


def gemma2_gguf() -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(
        Gemma2Config(**base(num_hidden_layers=4, head_dim=16, sliding_window=16))
    )


def gemma3_gguf() -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**base(num_hidden_layers=6, head_dim=16, sliding_window=16))
    return Gemma3ForCausalLM(config)


# GGUF architecture -> the reference it stores
GGUF_FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": llama_gguf,
    "qwen2": qwen2_gguf,
    "qwen3": qwen3_gguf,
    "phi3": phi3_gguf,
    "gemma2": gemma2_gguf,
    "gemma3": gemma3_gguf,
}


def write_gguf(reference: Any, architecture: str, path: Path) -> None:
    """``reference`` as llama.cpp's converter writes it, float32, no tokenizer."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    config = reference.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny-{architecture}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_freq_base(_rope_theta(config))
    if config.pad_token_id is not None:  # else the class default, maybe past a tiny vocabulary
        writer.add_pad_token_id(config.pad_token_id)
    if architecture.startswith("gemma"):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_sliding_window(config.sliding_window)
    state = reference.state_dict()
    names = get_gguf_hf_weights_map(reference, TensorProcessor())
    for gguf_name, hf_name in names.items():
        if hf_name not in state or (hf_name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        tensor = _as_llama_cpp_stores(state[hf_name], hf_name, architecture, config)
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _rope_theta(config: Any) -> float:
    params = config.rope_parameters
    if "full_attention" in params:
        params = params["full_attention"]
    return float(params["rope_theta"])


def _as_llama_cpp_stores(
    tensor: torch.Tensor, name: str, architecture: str, config: Any
) -> torch.Tensor:
    if architecture.startswith("gemma") and name.endswith("norm.weight"):
        return tensor + 1  # llama.cpp's Gemma norms hold 1 + w
    if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
        # llama.cpp interleaves each head's rotary halves; transformers undoes it on load.
        return (
            tensor.reshape(heads, 2, tensor.shape[0] // heads // 2, -1)
            .swapaxes(1, 2)
            .reshape(tensor.shape)
        )
    return tensor


@pytest.mark.parametrize("architecture", list(GGUF_FAMILIES))
def test_a_gguf_loads_as_the_reference(architecture: str, tmp_path: Path) -> None:
    reference = random_reference(GGUF_FAMILIES[architecture])
    path = tmp_path / f"tiny-{architecture}.gguf"
    write_gguf(reference, architecture, path)
    loaded = load_model(ModelSource.from_path(path), torch.float32, torch.device("cpu"), 256)
    assert loaded.spec.layer_windows == model_from_reference(reference).spec.layer_windows
    expected = prompt_logits(model_from_reference(reference))
    torch.testing.assert_close(prompt_logits(loaded), expected, atol=1e-5, rtol=0)


QUANTIZED = {"int8": Int8Linear, "int4": Int4Linear}


@pytest.mark.skipif(not load_native_ops(), reason="int4 and the few-row int8 kernels are native")
@pytest.mark.parametrize("method", list(QUANTIZED))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_projection_of_every_family_quantizes(family: str, method: str) -> None:
    """Every linear layer the family holds becomes ``method`` (the LM head int8), and the
    model stays close: int8 (per-channel weights, activations rounded per call) within 0.1
    relative logit error of float32, top-1 agreement 0.75; int4 within 0.05 of a dense
    model of its own dequantized weights, agreement 0.9 (all it adds to the weights' own
    ~0.2 rounding on these random weights is the int8 rounding of activations;
    test_int4_weights.py measures the same on Llama)."""
    dense = model_from_reference(random_reference(FAMILIES[family][0]))
    weights = quantize_weights(dense.weights, method, rowwise=True)
    layers = linear_layers(weights.layers)
    assert len(layers) == len(linear_layers(dense.weights.layers)) > 0
    assert all(isinstance(linear, QUANTIZED[method]) for linear in layers)
    assert isinstance(weights.lm_head, Int8Linear)
    assert weights.nbytes < dense.weights.nbytes
    quantized = dense.replace(weights=weights, kernels=NativeKernels())
    actual = prompt_logits(quantized)
    if method == "int8":
        close_to(actual, prompt_logits(dense), relative_bound=0.1, agreement=0.75)
    else:
        twin = quantized.replace(weights=dequantized_int4(weights))
        close_to(actual, prompt_logits(twin), relative_bound=0.05, agreement=0.9)


def dequantized_int4(weights: ModelWeights) -> ModelWeights:
    """The same weights with every int4 projection dense (the int8 LM head as it is)."""

    def dense(linear: Linear) -> Linear:
        assert isinstance(linear, Int4Linear)
        return DenseLinear(linear.dequantize(), linear.bias)

    return dataclasses.replace(weights, layers=map_linears(weights.layers, dense))


def close_to(
    actual: torch.Tensor, expected: torch.Tensor, relative_bound: float, agreement: float
) -> None:
    relative = ((actual - expected).norm() / expected.norm()).item()
    assert relative < relative_bound, relative
    agree = (actual.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree >= agreement, agree
