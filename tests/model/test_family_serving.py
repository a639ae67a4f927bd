"""The families through build_engine, as `kvserve serve --model DIR` runs them: a tiny
random model of each saved as a Hugging Face directory with a tokenizer and its chat
template (SmolLM2's: no tiny tokenizer of each family is at hand offline), a chat prompt
several sliding windows long, greedy output equal to transformers' past the window."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.builder import build_engine
from engine.config import EngineArgs
from engine.request import Request, SamplingParams
from tests.model.engine_helpers import reference_greedy
from tests.model.family_models import FAMILIES, random_reference

SERVED = (
    *("mistral", "ministral", "qwen3", "olmo2", "granite"),
    *("mixtral", "qwen3_moe", "gpt_oss", "gemma2", "gemma3_text"),
)
QUESTION = "Name three rivers of Europe, say which seas they flow into, and give one city on each."


def saved_model(build: Callable[[], Any], tokenizer: Any, path: Path) -> Any:
    """``build()``'s model re-made with the tokenizer's vocabulary and special tokens,
    randomised as the family tests do, saved with the tokenizer into ``path``."""
    config = build().config
    config.vocab_size = len(tokenizer)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    reference = random_reference(lambda: type(build())(config))
    reference.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return reference


@pytest.mark.parametrize("family", SERVED)
def test_build_engine_serves_the_family_past_its_window(
    family: str, smollm_tokenizer: Any, tmp_path: Path
) -> None:
    reference = saved_model(FAMILIES[family][0], smollm_tokenizer, tmp_path)
    built = build_engine(
        EngineArgs(
            model=str(tmp_path),
            device="cpu",
            dtype="float32",
            kv_cache_memory_gib=4 / 1024,
            max_model_len=256,
            max_num_batched_tokens=24,  # the prompt arrives in chunks
            swap_space_gib=0,
        )
    )
    assert built.max_model_len == 256  # the window does not cap the context
    text = built.tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    prompt = built.tokenizer.encode(text, add_special_tokens=False)
    assert len(prompt) > 2 * 16  # several windows
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    built.core.add_request([Request("r", prompt, params, eos_token_ids=built.eos_token_ids)])
    tokens: list[int] = []
    while built.core.has_unfinished():
        for delta in built.core.step():
            tokens += delta.new_token_ids
    assert tokens == reference_greedy(reference, prompt, 20)
