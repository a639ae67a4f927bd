"""On the real SmolLM2-135M-Instruct: one greedy chat answer identical to transformers'."""

from __future__ import annotations

import pytest
import torch

from tests.model.engine_helpers import smollm_chat_prompt, smollm_greedy_answer

pytestmark = pytest.mark.slow

MAX_TOKENS = 24


def test_greedy_chat_answer_matches_transformers(smollm_gguf, smollm_tokenizer):
    from transformers import AutoModelForCausalLM

    prompt = smollm_chat_prompt(smollm_tokenizer)
    ours = smollm_greedy_answer(str(smollm_gguf), prompt, MAX_TOKENS)

    reference = AutoModelForCausalLM.from_pretrained(
        smollm_gguf.parent, gguf_file=smollm_gguf.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        generated = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=smollm_tokenizer.eos_token_id,
            pad_token_id=smollm_tokenizer.eos_token_id,
        )[0, len(prompt) :].tolist()
    assert ours == generated, (smollm_tokenizer.decode(ours), smollm_tokenizer.decode(generated))
    assert "Paris" in smollm_tokenizer.decode(ours)
