"""Block budgets of whole requests: what a sequence or an ``n > 1`` group may ever need.

Used by the scheduler for rejection at add time (can this ever fit?) and by the
``reserve`` admission policy (admit only with everything reserved). Pure arithmetic over
the KV groups' block bounds (engine/kv/groups.py): a full group holds ceil(t / S) blocks,
a sliding one at most ceil((W - 1) / S) + 1, summed over groups.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import CacheConfig, SchedulerConfig
from engine.errors import RequestRejected
from engine.kv.accounting import blocks_for_tokens
from engine.kv.groups import KVGroup
from engine.request import Request

FULL = (KVGroup((0,)),)  # a model of one full-attention group


def final_len(request: Request, max_model_len: int) -> int:
    """Tokens the sequence holds when it stops at the latest (max_tokens or max_model_len)."""
    return min(request.num_prompt_tokens + request.sampling_params.max_tokens, max_model_len)


def final_blocks(
    request: Request,
    block_size: int,
    max_model_len: int,
    groups: Sequence[KVGroup] = FULL,
    chunk: int = 1,
) -> int:
    """Blocks the sequence holds at most, every group, as it grows to its final length
    (prefill chunks of up to ``chunk`` tokens: a window's blocks plus the chunk's)."""
    length = final_len(request, max_model_len)
    return sum(group.max_blocks(length, block_size, chunk) for group in groups)


def child_blocks(
    parent: Request, block_size: int, max_model_len: int, groups: Sequence[KVGroup] = FULL
) -> int:
    """Fresh blocks one forked child allocates: in each group its own tail plus one
    copy-on-write copy of the shared block holding the last prompt token (a sliding group's
    own blocks are bounded by its window: it releases the shared ones as it advances, but
    the parent still holds them)."""
    length = final_len(parent, max_model_len)
    total = 0
    for group in groups:
        shared = blocks_for_tokens(parent.num_prompt_tokens, block_size)
        own = blocks_for_tokens(length, block_size) - shared + 1
        if group.window is not None:
            own = min(own, group.max_blocks(length, block_size))
        total += own
    return total


def group_blocks(
    parent: Request,
    group_size: int,
    block_size: int,
    max_model_len: int,
    groups: Sequence[KVGroup] = FULL,
    chunk: int = 1,
) -> int:
    """Blocks an ``n``-sequence group holds at most when all of it runs at once."""
    own = final_blocks(parent, block_size, max_model_len, groups, chunk)
    return own + (group_size - 1) * child_blocks(parent, block_size, max_model_len, groups)


def check_can_ever_run(
    parent: Request,
    group_size: int,
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    groups: Sequence[KVGroup] = FULL,
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
    # A prefill-only request (scoring, pooling) needs no room for a token after it.
    longest = max_len if parent.sampling_params.prefill_only else max_len - 1
    if num_prompt > longest:
        raise RequestRejected(
            "too_long",
            f"the prompt has {num_prompt} tokens but max_model_len is {max_len}: "
            f"shorten the prompt to at most {longest} tokens",
        )
    chunk = min(num_prompt, scheduler_config.max_num_batched_tokens)
    if scheduler_config.admission_policy == "reserve":
        need = group_blocks(parent, group_size, block_size, max_len, groups, chunk)
    else:
        need = final_blocks(parent, block_size, max_len, groups, chunk)
    usable = cache_config.num_device_blocks - cache_config.watermark_blocks
    if need > usable:
        raise RequestRejected(
            "no_capacity",
            f"the request needs {need} KV blocks of {block_size} tokens "
            f"(prompt {num_prompt} + max_tokens {parent.sampling_params.max_tokens}, "
            f"n={group_size}) but only {usable} are usable: lower max_tokens, n or the "
            "prompt length",
        )
