"""On the real SmolLM2-135M-Instruct: one greedy chat answer identical to transformers'."""

from __future__ import annotations

import pytest
import torch

from engine.builder import build_engine
from engine.config import EngineArgs
from engine.request import Request, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 24


def test_greedy_chat_answer_matches_transformers(smollm_gguf, smollm_tokenizer):
    from transformers import AutoModelForCausalLM

    text = smollm_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = smollm_tokenizer.encode(text, add_special_tokens=False)

    built = build_engine(
        EngineArgs(
            model=str(smollm_gguf),
            dtype="float32",
            kv_cache_memory_gib=0.05,
            max_model_len=512,
            max_num_batched_tokens=512,
            swap_space_gib=0,
        )
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    built.core.add_request([Request("chat", prompt, params, eos_token_ids=built.eos_token_ids)])
    ours: list[int] = []
    while built.core.has_unfinished():
        for delta in built.core.step():
            ours += delta.new_token_ids
    del built

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
