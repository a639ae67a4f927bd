"""Test helpers: drive a real EngineCore (scheduler + ModelRunner) to completion."""

from __future__ import annotations

from typing import Any

import torch

from engine.builder import build_engine
from engine.config import CacheConfig, EngineArgs, SchedulerConfig
from engine.core import EngineCore
from engine.kv.accounting import KVShape
from engine.kv.groups import KVGroup
from engine.model.layers.decoder import DecoderModel
from engine.model.runtime.kv_cache import KVPool, KVPoolLayout
from engine.request import Request, SamplingParams
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.structured import GrammarCompiler


def make_core(
    model: DecoderModel,
    cache: CacheConfig,
    scheduler: SchedulerConfig | None = None,
    eos_token_ids: tuple[int, ...] = (),
    kv_dtype: str = "float32",
    grammars: GrammarCompiler | None = None,
    groups: tuple[KVGroup, ...] = (),
) -> EngineCore:
    """A real engine over ``model``; ``groups`` sets its KV groups (default: one)."""
    spec = model.spec
    shape = KVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, kv_dtype, groups)
    device_pool = KVPool(
        KVPoolLayout(shape, cache.num_device_blocks, cache.block_size), model.device
    )
    host_pool = None
    if cache.num_host_blocks:
        host_layout = KVPoolLayout(shape, cache.num_host_blocks, cache.block_size)
        pinned = model.device.type == "cuda"
        host_pool = KVPool(host_layout, torch.device("cpu"), pin_memory=pinned)
    runner = ModelRunner(
        model, device_pool, host_pool, eos_token_ids=eos_token_ids, grammars=grammars
    )
    return EngineCore(Scheduler(scheduler or SchedulerConfig(), cache, shape), runner)


def greedy(max_tokens: int, **extra: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


def run_all(
    core: EngineCore, prompts: dict[str, list[int]], params: dict[str, SamplingParams]
) -> dict[str, list[int]]:
    """Add every prompt, step until all finish (checking invariants after each step) and
    return each request's output token ids."""
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        core.add_request([Request(rid, list(prompt), params[rid])])
    for _ in range(10_000):
        if not core.has_unfinished():
            break
        for delta in core.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
        core.scheduler.check_integrity()
    assert not core.has_unfinished()
    return outputs


def reference_greedy(reference: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation from transformers (full forward each step, no EOS stop)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = reference(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


SMOLLM_QUESTION = "What is the capital of France? Answer in one sentence."


def smollm_chat_prompt(tokenizer: Any) -> list[int]:
    """The token ids of SMOLLM_QUESTION in SmolLM2's chat template."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": SMOLLM_QUESTION}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def smollm_greedy_answer(
    gguf: str, prompt: list[int], max_tokens: int, quantization: str = "none"
) -> list[int]:
    """Greedy answer of the real SmolLM2 through build_engine (float32, EOS stops it)."""
    built = build_engine(
        EngineArgs(
            model=gguf,
            dtype="float32",
            quantization=quantization,
            kv_cache_memory_gib=0.05,
            max_model_len=512,
            max_num_batched_tokens=512,
            swap_space_gib=0,
        )
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    built.core.add_request([Request("chat", prompt, params, eos_token_ids=built.eos_token_ids)])
    tokens: list[int] = []
    while built.core.has_unfinished():
        for delta in built.core.step():
            tokens += delta.new_token_ids
    return tokens
