"""Block budgets of whole requests: what a sequence or an ``n > 1`` group may ever need.

Used by the scheduler for rejection at add time (can this ever fit?) and by the
``reserve`` admission policy (admit only with everything reserved). Pure arithmetic over
``accounting.blocks_for_tokens``.
"""

from __future__ import annotations

from engine.config import CacheConfig, SchedulerConfig
from engine.errors import RequestRejected
from engine.kv.accounting import blocks_for_tokens
from engine.request import Request


def final_len(request: Request, max_model_len: int) -> int:
    """Tokens the sequence holds when it stops at the latest (max_tokens or max_model_len)."""
    return min(request.num_prompt_tokens + request.sampling_params.max_tokens, max_model_len)


def final_blocks(request: Request, block_size: int, max_model_len: int) -> int:
    return blocks_for_tokens(final_len(request, max_model_len), block_size)


def child_blocks(parent: Request, block_size: int, max_model_len: int) -> int:
    """Fresh blocks one forked child allocates: its own tail plus one copy-on-write copy of
    the shared block holding the last prompt token."""
    shared = blocks_for_tokens(parent.num_prompt_tokens, block_size)
    return final_blocks(parent, block_size, max_model_len) - shared + 1


def group_blocks(parent: Request, group_size: int, block_size: int, max_model_len: int) -> int:
    """Blocks an ``n``-sequence group holds at most when all of it runs at once."""
    own = final_blocks(parent, block_size, max_model_len)
    return own + (group_size - 1) * child_blocks(parent, block_size, max_model_len)


def check_can_ever_run(
    parent: Request, group_size: int, scheduler_config: SchedulerConfig, cache_config: CacheConfig
) -> None:
    """Reject a group that could never finish, even alone on an empty device.

    One sequence must fit (prompt plus max_tokens, capped at max_model_len) next to the
    watermark: under ``optimistic`` siblings of an ``n > 1`` group can take turns through
    preemption. Under ``reserve`` the whole group must fit, since it is admitted only with
    everything it may ever need.
    """
    max_len = scheduler_config.max_model_len
    block_size = cache_config.block_size
    num_prompt = parent.num_prompt_tokens
    if num_prompt == 0:
        raise RequestRejected("empty_prompt", "the prompt has no tokens")
    if num_prompt >= max_len:
        raise RequestRejected(
            "too_long",
            f"the prompt has {num_prompt} tokens but max_model_len is {max_len}: "
            f"shorten the prompt to at most {max_len - 1} tokens",
        )
    if scheduler_config.admission_policy == "reserve":
        need = group_blocks(parent, group_size, block_size, max_len)
    else:
        need = final_blocks(parent, block_size, max_len)
    usable = cache_config.num_device_blocks - cache_config.watermark_blocks
    if need > usable:
        raise RequestRejected(
            "no_capacity",
            f"the request needs {need} KV blocks of {block_size} tokens "
            f"(prompt {num_prompt} + max_tokens {parent.sampling_params.max_tokens}, "
            f"n={group_size}) but only {usable} are usable: lower max_tokens, n or the "
            "prompt length",
        )
