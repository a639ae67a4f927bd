"""Every family against transformers: tiny random configs in float32, prompts several
sliding windows long, prefill in chunks (one request's decodes mixed with another's
prefill), then 33 greedy decode steps; for the torch and native kernels.

Logits of every position must be within 1e-4 of transformers' (one full forward over the
prompt and the generated tokens) and the greedy tokens identical.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.model.kernels.base import Kernels
from engine.model.loader import model_from_reference
from engine.model.spec import FULL, SLIDING, LayerSpec, spec_from_hf_config
from tests.model.family_models import (
    DECODE_STEPS,
    FAMILIES,
    PROMPTS,
    WINDOW,
    base,
    gemma2,
    gemma3_multimodal,
    gemma3_text,
    llama,
    mistral,
    phi3,
    qwen2,
    random_reference,
    serve_greedy,
)
from tests.model.paged import BlockTables, make_cache, run_step


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers_past_its_window(family: str, kernels: Kernels) -> None:
    build, block_size = FAMILIES[family]
    reference = random_reference(build)
    model = model_from_reference(reference).replace(kernels=kernels)
    tokens, logits = serve_greedy(model, block_size)
    for prompt, sequence, ours in zip(PROMPTS, tokens, logits, strict=True):
        fed = sequence[: len(prompt) + DECODE_STEPS]
        with torch.no_grad():
            expected = reference(torch.tensor([fed])).logits[0]
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
        assert sequence[len(prompt) :] == expected[len(prompt) - 1 :].argmax(-1).tolist()


def test_layer_specs_come_from_the_config() -> None:
    def layers(build: Callable[[], Any]) -> tuple[LayerSpec, ...]:
        return spec_from_hf_config(build().config).layers

    sliding, full = LayerSpec(SLIDING, WINDOW), LayerSpec(FULL)
    assert layers(llama) == (full, full)
    assert layers(mistral) == (sliding, sliding)
    assert layers(qwen2) == (full, sliding, sliding)
    assert [layer.window for layer in layers(gemma2)] == [WINDOW, None, WINDOW, None]
    gemma3 = layers(gemma3_text)
    assert [layer.attention for layer in gemma3] == [SLIDING] * 5 + [FULL]
    assert {layer.rope for layer in gemma3} == {"sliding_attention", "full_attention"}
    spec = spec_from_hf_config(gemma3_multimodal().config)
    assert spec.model_type == "gemma3_text" and spec.layers == gemma3
    assert spec_from_hf_config(mistral().config).context_limit == 512  # not the window


def test_a_layer_type_kvserve_cannot_run_is_refused_by_name() -> None:
    from transformers import Qwen3Config

    config = Qwen3Config(**base(layer_types=["full_attention", "chunked_attention"]))
    with pytest.raises(ValueError, match="'chunked_attention'"):
        spec_from_hf_config(config)


def test_an_unknown_model_type_is_refused_with_the_list() -> None:
    from transformers import GPT2Config

    with pytest.raises(ValueError, match=r"unsupported model type 'gpt2'.*qwen3"):
        spec_from_hf_config(GPT2Config())


def test_llama3_rope_scaling_matches_transformers() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = LlamaConfig(**base(rope_scaling=scaling, rope_theta=500000.0))
    reference = random_reference(lambda: LlamaForCausalLM(config))
    model = model_from_reference(reference)
    tokens, logits = serve_greedy(model, 4)
    fed = tokens[0][: len(PROMPTS[0]) + DECODE_STEPS]
    with torch.no_grad():
        expected = reference(torch.tensor([fed])).logits[0]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("context_len", [64, 512])
def test_longrope_takes_the_factors_of_the_served_context(context_len: int) -> None:
    """Phi-3's LongRoPE: a server of at most the original 64 tokens rotates with the short
    factors, a longer one with the long factors; each equals transformers on a sequence of
    that regime (which re-rotates everything with the long factors past 64 tokens)."""
    reference = random_reference(phi3)
    model = model_from_reference(reference, context_len=context_len)
    length = 60 if context_len == 64 else 120
    fed = [(5 * i + 1) % 250 for i in range(length)]
    cache = make_cache(model, num_blocks=32, block_size=8)
    blocks = [BlockTables(32).allocate(length, 8)]
    ours = torch.cat(
        [
            run_step(model, cache, [fed[:37]], [0], blocks),
            *(run_step(model, cache, [[t]], [37 + i], blocks) for i, t in enumerate(fed[37:])),
        ]
    )
    with torch.no_grad():
        expected = reference(torch.tensor([fed])).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    other = model_from_reference(reference, context_len=576 - context_len)  # the other regime
    cache = make_cache(other, num_blocks=32, block_size=8)
    theirs = run_step(other, cache, [fed], [0], blocks)
    assert (theirs - expected).abs().max() > 1e-2  # the factors matter here
