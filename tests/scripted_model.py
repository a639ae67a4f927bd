"""A tiny Llama that says what the test wants: a "scripted" model for end-to-end tests of
everything downstream of the tokens (reasoning parsers, the Responses and Messages APIs,
agent clients), where a random model's output would say nothing.

Its attention and MLP write nothing (their output projections are zero), so the final
hidden state of a position is its token's embedding, and its LM head maps each token of
the script to the next: ``next = script[i + 1]`` after ``script[i]``, and EOS after the
last. A script's tokens must therefore be distinct (each has one successor). The first
scripted token follows the prompt's last token (``start``), whatever came before it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

THINK_TOKENS = ("<think>", "</think>")


def scripted_model(
    tokenizer: Any, start: int, script: Sequence[int], eos: int, path: Path, seed: int = 0
) -> Path:
    """Save the model and ``tokenizer`` into ``path``; returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    chain = [start, *script, eos]
    if len(set(chain[1:])) != len(chain) - 1 or start in chain[1:-1]:
        raise ValueError("a script's tokens must be distinct (each has one successor)")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        embed = torch.nn.functional.normalize(model.model.embed_tokens.weight, dim=-1)
        model.model.embed_tokens.weight.copy_(embed)
        head = model.lm_head.weight
        head.normal_(std=0.01)
        for current, following in itertools.pairwise(chain):
            head[following] = embed[current] * 40.0  # its logit dominates after ``current``
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def with_think_tokens(tokenizer: Any) -> Any:
    """A copy of ``tokenizer`` with ``<think>`` and ``</think>`` as single added tokens,
    as Qwen3's and DeepSeek-R1's tokenizers have them."""
    import copy

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_tokens(list(THINK_TOKENS))
    return tokenizer


def token_ids(tokenizer: Any, *pieces: str) -> list[int]:
    """Each piece as exactly one token id (ValueError if it is not one token)."""
    ids = []
    for piece in pieces:
        encoded = tokenizer.encode(piece, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"{piece!r} is {len(encoded)} tokens, not one")
        ids.append(encoded[0])
    return ids
