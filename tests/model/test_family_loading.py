"""Every family from disk and quantized: a sharded Hugging Face directory and (where
transformers reads the architecture) a GGUF through engine/model/loader.py give the same
model as the in-memory reference; int8 and int4 reach every projection of every family.

The GGUFs are written here with the gguf package, in float32, as llama.cpp's converter
lays them out (Llama's Q/K rows permuted for its rotary, Gemma's norms stored as 1 + w).
transformers' GGUF reader takes the config from the file's metadata and class defaults, so
the references use the defaults for what the metadata does not carry (Gemma's soft-caps,
query_pre_attn_scalar, Gemma 3's local RoPE base, Qwen3's head_dim, Qwen3-MoE's expert
width). Mistral is not covered: llama.cpp writes it as a ``llama`` GGUF (transformers
tells them apart by the model's name), the same tensors as the Llama case. Nor are
Mixtral (a ``llama`` GGUF with experts, which transformers reads without them) and gpt-oss
(its reader does not build the stacked experts): kvserve refuses those at start.
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


def qwen3_moe_gguf() -> Any:
    """The experts' width is Qwen3-MoE's class default (768): transformers reads no
    ``moe_intermediate_size`` from a GGUF; and renormalised routing, which it sets for
    every Qwen3-MoE GGUF, as llama.cpp computes them."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **base(head_dim=32), num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
    )
    return Qwen3MoeForCausalLM(config)


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
    "qwen3moe": qwen3_moe_gguf,
    "gemma2": gemma2_gguf,
    "gemma3": gemma3_gguf,
}


def write_gguf(reference: Any, architecture: str, path: Path, expert_count: int = 0) -> None:
    """``reference`` as llama.cpp's converter writes it, float32, no tokenizer
    (``expert_count`` written into the metadata when given)."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

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
    if architecture.startswith("gemma") or architecture == "qwen3moe":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if architecture.startswith("gemma"):
        writer.add_sliding_window(config.sliding_window)
    if expert_count:
        writer.add_expert_count(expert_count)
    if architecture == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    state = reference.state_dict()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)()
    names = get_gguf_hf_weights_map(reference, processor)
    for gguf_name, hf_name in names.items():
        if hf_name not in state or (hf_name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        tensor = _as_llama_cpp_stores(state[hf_name], hf_name, architecture, config)
        writer.add_tensor(gguf_name, _expert_half(tensor, gguf_name).float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _expert_half(tensor: torch.Tensor, gguf_name: str) -> torch.Tensor:
    """llama.cpp keeps the experts' gate and up projections apart (``ffn_gate_exps``,
    ``ffn_up_exps``); transformers stacks them in one ``gate_up_proj``, gate rows first."""
    if ".ffn_gate_exps." in gguf_name:
        return tensor[:, : tensor.shape[1] // 2]
    if ".ffn_up_exps." in gguf_name:
        return tensor[:, tensor.shape[1] // 2 :]
    return tensor


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


def test_a_gguf_whose_experts_transformers_would_drop_is_refused(tmp_path: Path) -> None:
    """llama.cpp writes Mixtral as a ``llama`` GGUF with experts; transformers reads it as
    a dense Llama and drops them. kvserve refuses it, naming the way out, instead of
    serving a model without its feed-forward."""
    path = tmp_path / "tiny-mixtral.gguf"
    write_gguf(random_reference(llama_gguf), "llama", path, expert_count=4)
    with pytest.raises(ValueError, match=r"4 experts per layer.*Hugging Face directory"):
        load_model(ModelSource.from_path(path), torch.float32, torch.device("cpu"), 256)


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


FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., in]`` weights as MXFP4 ``(blocks uint8 [..., in/32, 16], scales uint8
    [..., in/32])``: groups of 32 e2m1 codes (two a byte, even element in the low nibble)
    under a power-of-two scale stored as its exponent + 127."""
    groups = weight.float().reshape(*weight.shape[:-1], -1, 32)
    peak = groups.abs().amax(-1).clamp_min(1e-30)
    exponent = torch.ceil(torch.log2(peak / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled.abs()[..., None] - FP4_GRID).abs().argmin(-1)
    codes = codes | ((scaled < 0) & (codes > 0)).to(torch.int64) << 3
    packed = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8)


def write_mxfp4_checkpoint(reference: Any, path: Path) -> None:
    """``reference`` (a gpt-oss) saved as the released checkpoints store it: the experts'
    projections MXFP4 (``*_blocks`` / ``*_scales``, rows = outputs), the rest as is."""
    import json

    from safetensors.torch import load_file, save_file

    reference.save_pretrained(path)
    (shard,) = path.glob("*.safetensors")
    state = load_file(shard)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = to_mxfp4(state.pop(name).transpose(1, 2))  # [E, out, in]
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
    save_file(state, shard, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))


def test_an_mxfp4_gpt_oss_checkpoint_is_dequantized_as_it_loads(tmp_path: Path) -> None:
    """gpt-oss's released MXFP4 experts: the model kvserve loads is transformers' own
    dequantization of the same checkpoint."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    write_mxfp4_checkpoint(random_reference(FAMILIES["gpt_oss"][0]), tmp_path)
    loaded = load_model(ModelSource.from_path(tmp_path), torch.float32, torch.device("cpu"), 256)
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    )
    expected = prompt_logits(model_from_reference(reference))
    torch.testing.assert_close(prompt_logits(loaded), expected, atol=0, rtol=0)
    with torch.no_grad():
        full = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(prompt_logits(loaded), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_runs_on_a_quantized_kv_cache(family: str, kv_dtype: str) -> None:
    """A KV cache of 8-bit values (a float32 scale per token and head) serves every family
    (windows, soft-caps, sinks, experts): its prompt's logits stay within 0.05 relative
    error of a float32 cache's, the top token agreeing at 90% of positions."""
    model = model_from_reference(random_reference(FAMILIES[family][0]))

    def logits(dtype: str) -> torch.Tensor:
        cache = make_cache(model, num_blocks=16, block_size=8, kv_dtype=dtype)
        blocks = [BlockTables(16).allocate(len(PROMPT), 8)]
        first = run_step(model, cache, [PROMPT[:23]], [0], blocks)
        return torch.cat([first, run_step(model, cache, [PROMPT[23:]], [23], blocks)])

    close_to(logits(kv_dtype), logits("float32"), relative_bound=0.05, agreement=0.9)
