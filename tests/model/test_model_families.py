"""Other Llama-family checkpoints: Qwen2 (QKV bias), Mistral (sliding window), RoPE scaling."""

from __future__ import annotations

import torch

from engine.model.loader import model_from_reference
from engine.model.spec import spec_from_hf_config
from tests.model.paged import BlockTables, make_cache, run_step

PROMPT = [3, 17, 99, 4, 5, 200, 7, 8, 9, 10, 11]


def small(config_cls, **extra):
    return config_cls(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **extra,
    )


def assert_parity(reference) -> None:
    reference = reference.eval()
    with torch.no_grad():
        for param in reference.parameters():
            if param.dim() > 1:  # matrices only; norms stay at 1
                param.mul_(4.0)
        expected = reference(torch.tensor([PROMPT])).logits[0]
    model = model_from_reference(reference)
    cache = make_cache(model, num_blocks=32, block_size=4)
    blocks = [BlockTables(32).allocate(len(PROMPT), 4)]
    logits = run_step(model, cache, [PROMPT[:5]], [0], blocks)
    logits = torch.cat([logits, run_step(model, cache, [PROMPT[5:]], [5], blocks)])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_qwen2_with_qkv_bias_matches_transformers():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    reference = Qwen2ForCausalLM(small(Qwen2Config))
    assert reference.model.layers[0].self_attn.q_proj.bias is not None
    with torch.no_grad():
        for layer in reference.model.layers:
            layer.self_attn.q_proj.bias.normal_()
            layer.self_attn.k_proj.bias.normal_()
    assert_parity(reference)


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = small(LlamaConfig, rope_scaling=scaling, rope_theta=500000.0)
    torch.manual_seed(0)
    assert_parity(LlamaForCausalLM(config))


def test_mistral_slides_every_layer_and_serves_its_whole_context():
    from transformers import MistralConfig

    spec = spec_from_hf_config(small(MistralConfig, sliding_window=128))
    assert spec.layer_windows == (128, 128) and spec.context_limit == 512
    assert spec_from_hf_config(small(MistralConfig, sliding_window=None)).layer_windows == (
        None,
        None,
    )
