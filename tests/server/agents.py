"""What the agent-API tests serve (Responses, Messages, reasoning, agent clients): the
scripted model (tests/scripted_model.py), which answers every prompt that ends like a
chat's generation prompt with ``<think>The user</think>Hello`` and EOS, served with
``--reasoning-parser qwen3`` and hermes tool calls. A tiny model, so the agent CLIs'
long prompts (Claude Code's ~20k tokens of system prompt and tools) fit its context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import EngineArgs
from server.settings import ServerSettings
from tests.scripted_model import scripted_model, token_ids, with_think_tokens

MODEL = "scripted"
REASONING = "The user"
ANSWER = "Hello"
CONTEXT = 32768


def make_scripted_dir(path: Path, smollm_tokenizer: Any) -> Path:
    """The scripted model with SmolLM2's tokenizer (``<think>`` tags added) in ``path``."""
    tokenizer = with_think_tokens(smollm_tokenizer)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    start = tokenizer.encode(prompt, add_special_tokens=False)[-1]
    script = token_ids(tokenizer, "<think>", "The", " user", "</think>", ANSWER)
    return scripted_model(tokenizer, start, script, tokenizer.eos_token_id, path)


def scripted_args(model_dir: Path, **overrides: Any) -> EngineArgs:
    fields: dict[str, Any] = {
        "model": str(model_dir),
        "device": "cpu",
        "dtype": "float32",
        "max_model_len": CONTEXT,
        "kv_cache_memory_gib": 0.25,
        "swap_space_gib": 0,
        "max_num_batched_tokens": 4096,
        "kernels": "torch",
    }
    return EngineArgs(**{**fields, **overrides})


def agent_settings(**overrides: Any) -> ServerSettings:
    fields: dict[str, Any] = {
        "served_model_names": (MODEL,),
        "enable_auto_tool_choice": True,
        "tool_call_parser": "hermes",
        "reasoning_parser": "qwen3",
    }
    return ServerSettings(**{**fields, **overrides})
