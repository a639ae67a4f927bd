"""Tiny randomly initialised models of every family kvserve runs, and a greedy serving
loop over the paged decoder, for the family tests (test_model_families.py and others)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.model.layers.decoder import DecoderModel
from tests.model.paged import BlockTables, make_cache, run_step

WINDOW = 16
PROMPTS = (
    [(7 * i + 3) % 251 for i in range(45)],
    [(11 * i + 5) % 253 for i in range(58)],
)
DECODE_STEPS = 33
CHUNK = 20


def base(**extra: Any) -> dict[str, Any]:
    sizes = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "attn_implementation": "eager",
    }
    return {**sizes, **extra}


def llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**base()))


def mistral() -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**base(sliding_window=WINDOW)))


def ministral() -> Any:
    """Ministral's own model type: Mistral's layers, sliding and full ones mixed through
    ``layer_types`` (Ministral 8B interleaves them)."""
    from transformers import MinistralConfig, MinistralForCausalLM

    layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    config = MinistralConfig(
        **base(num_hidden_layers=3, head_dim=16, sliding_window=WINDOW), layer_types=layer_types
    )
    return MinistralForCausalLM(config)


def qwen2() -> Any:
    """Sliding-window layers from layer 1 on (``max_window_layers``), QKV biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **base(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW),
        max_window_layers=1,
    )
    return Qwen2ForCausalLM(config)


def qwen3() -> Any:
    """QK-norm per head; head_dim 32 with 4 heads over a 64-wide hidden state."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**base(head_dim=32)))


def phi3() -> Any:
    """Fused QKV and gate-up in the checkpoint, LongRoPE (short and long factors around a
    64-token original context) over a 0.75 partial rotary, as Phi-4 mini has."""
    from transformers import Phi3Config, Phi3ForCausalLM

    rotary_half = int(16 * 0.75) // 2  # head_dim 16, 3/4 of it rotates
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.1 * i for i in range(rotary_half)],
        "long_factor": [1.5 + 0.5 * i for i in range(rotary_half)],
        "original_max_position_embeddings": 64,
    }
    config = Phi3Config(
        **base(num_attention_heads=4, num_key_value_heads=2),
        rope_parameters=rope,
        original_max_position_embeddings=64,
        pad_token_id=0,
    )
    return Phi3ForCausalLM(config)


def olmo2() -> Any:
    """Norms after each sublayer, QK-norm over all heads."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return Olmo2ForCausalLM(Olmo2Config(**base(), pad_token_id=0))


def granite() -> Any:
    """Embedding, residual and attention multipliers, logits divided by a scale."""
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(
        **base(),
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
        logits_scaling=8.0,
    )
    return GraniteForCausalLM(config)


def mixtral() -> Any:
    """Four experts, two per token, renormalised."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**base(intermediate_size=64), num_local_experts=4, num_experts_per_tok=2)
    return MixtralForCausalLM(config)


def qwen3_moe() -> Any:
    """Eight experts, two per token, not renormalised; QK-norm; layer 0 dense
    (``mlp_only_layers``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **base(num_hidden_layers=3, head_dim=32),
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        mlp_only_layers=[0],
    )
    return Qwen3MoeForCausalLM(config)


def gpt_oss() -> Any:
    """Alternating sliding and full layers with sinks and biases, YaRN RoPE, four experts
    (two per token) with the clamped SwiGLU and biases."""
    from transformers import GptOssConfig, GptOssForCausalLM

    rope = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 64,
        "truncate": False,
    }
    config = GptOssConfig(
        **base(num_hidden_layers=4, head_dim=16, intermediate_size=32, sliding_window=WINDOW),
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters=rope,
    )
    return GptOssForCausalLM(config)


def gemma2() -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        **base(num_hidden_layers=4, head_dim=16, sliding_window=WINDOW),
        query_pre_attn_scalar=24,
        attn_logit_softcapping=20.0,
        final_logit_softcapping=15.0,
    )
    return Gemma2ForCausalLM(config)


def gemma3_text() -> Any:
    """Five local layers to one global, each kind with its own RoPE table (the global one
    linearly scaled), QK-norm."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
    }
    config = Gemma3TextConfig(
        **base(num_hidden_layers=6, head_dim=16, sliding_window=WINDOW),
        query_pre_attn_scalar=24,
        final_logit_softcapping=15.0,
        rope_parameters=rope,
    )
    return Gemma3ForCausalLM(config)


def gemma3_multimodal() -> Any:
    """A multimodal Gemma 3 checkpoint: its text model is served."""
    from transformers import AutoModelForCausalLM, Gemma3Config, SiglipVisionConfig

    text = gemma3_text().config
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        attn_implementation="eager",
    )
    return AutoModelForCausalLM.from_config(config)


# family -> (reference model, KV block size)
FAMILIES: dict[str, tuple[Callable[[], Any], int]] = {
    "llama": (llama, 4),
    "mistral": (mistral, 4),
    "ministral": (ministral, 8),
    "qwen2": (qwen2, 8),
    "qwen3": (qwen3, 16),
    "phi3": (phi3, 8),
    "olmo2": (olmo2, 4),
    "granite": (granite, 16),
    "mixtral": (mixtral, 4),
    "qwen3_moe": (qwen3_moe, 8),
    "gpt_oss": (gpt_oss, 4),
    "gemma2": (gemma2, 8),
    "gemma3_text": (gemma3_text, 4),
    "gemma3": (gemma3_multimodal, 16),
}


def random_reference(build: Callable[[], Any], seed: int = 0) -> Any:
    """The reference with weights that make logits spread (matrices x4) and norms and
    biases off their initial values (Gemma's norms start at 0, Llama's at 1)."""
    torch.manual_seed(seed)
    reference = build().eval()
    with torch.no_grad():
        for param in reference.parameters():
            if param.dim() > 1:
                param.mul_(4.0)
            else:
                param.add_(torch.randn_like(param) * 0.2)
    return reference


def serve_greedy(
    model: DecoderModel, block_size: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy continuations of PROMPTS: each prompt prefilled in CHUNK-token chunks, the
    second starting once the first decodes (so steps mix decodes and a prefill), then
    DECODE_STEPS decode steps each. Returns every sequence's tokens and the logits of
    every position it fed."""
    cache = make_cache(model, num_blocks=128, block_size=block_size)
    tables = BlockTables(128)
    blocks = [tables.allocate(len(p) + DECODE_STEPS + 1, block_size) for p in PROMPTS]
    tokens = [list(p) for p in PROMPTS]
    fed = [0] * len(PROMPTS)
    logits: list[list[torch.Tensor]] = [[] for _ in PROMPTS]
    while any(f < len(p) + DECODE_STEPS for f, p in zip(fed, PROMPTS, strict=True)):
        decodes = [i for i, p in enumerate(PROMPTS) if len(p) <= fed[i] < len(p) + DECODE_STEPS]
        prefill = next((i for i, p in enumerate(PROMPTS) if fed[i] < len(p)), None)
        if prefill is not None and prefill > 0 and fed[prefill - 1] < len(PROMPTS[prefill - 1]):
            prefill = None  # the next prompt waits for the one before it to decode
        order = decodes + ([] if prefill is None else [prefill])
        pieces = [tokens[i][fed[i] : fed[i] + (1 if i in decodes else CHUNK)] for i in order]
        out = run_step(model, cache, pieces, [fed[i] for i in order], [blocks[i] for i in order])
        for i, rows in zip(order, out.split([len(p) for p in pieces]), strict=True):
            logits[i].append(rows)
            fed[i] += rows.shape[0]
            if fed[i] >= len(PROMPTS[i]):
                tokens[i].append(int(rows[-1].argmax()))
    return tokens, [torch.cat(rows) for rows in logits]
