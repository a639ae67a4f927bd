"""Prompt logprobs in the response shapes clients expect.

vLLM's ``prompt_logprobs``: one entry per prompt token, ``null`` for the first (nothing
precedes it), else ``{token_id: {"logprob", "rank", "decoded_token"}}`` holding the prompt
token and the top alternatives. The legacy completions ``logprobs`` object of an echoed
prompt uses the same numbers (``tokens``, ``token_logprobs`` starting with ``null``, ...).
"""

from __future__ import annotations

from typing import Any

from engine.outputs import TokenLogprob
from server.routes.streaming import finite


def vllm_prompt_logprobs(
    tokenizer: Any, prompt_ids: list[int], scored: list[TokenLogprob], top_n: int
) -> list[dict[str, Any] | None]:
    entries: list[dict[str, Any] | None] = [None]
    for lp in scored[: len(prompt_ids) - 1]:
        entry = {str(lp.token_id): _vllm_entry(tokenizer, lp.token_id, lp.logprob, lp.rank)}
        for rank, (token, value) in enumerate(lp.top[:top_n], start=1):
            entry.setdefault(str(token), _vllm_entry(tokenizer, token, value, rank))
        entries.append(entry)
    return entries


def _vllm_entry(tokenizer: Any, token: int, logprob: float, rank: int | None) -> dict[str, Any]:
    return {"logprob": finite(logprob), "rank": rank, "decoded_token": tokenizer.decode([token])}
