"""The blocks an admission must leave free (``admission_policy``).

``optimistic``: the watermark plus the rest of the admitted request's prompt; running
requests that later run out of blocks preempt. ``reserve``: the watermark plus everything
the admitted group and all running and swapped requests may still allocate before they
finish, so nothing ever has to be preempted. The live requests' share is summed once per
step (``Step.outstanding``) and each admission of the step adds its own.
"""

from __future__ import annotations

from engine.kv.budget import child_blocks, final_blocks
from engine.request import Request
from engine.sched.state import SchedulerState
from engine.sched.step import Step


def admission_reserve(
    state: SchedulerState, step: Step, request: Request, covered: int, group_size: int
) -> int:
    """Blocks that must stay free after allocating ``request``'s first chunk, with
    ``covered`` of its tokens already in blocks (a prefix hit and the chunk)."""
    reserve = state.cache_config.watermark_blocks
    blocks_for = state.kv.blocks_for_tokens
    already = blocks_for(covered)
    if state.config.admission_policy != "reserve":
        return reserve + blocks_for(request.num_tokens) - already
    own = final_blocks_of(state, request) - already
    children = (group_size - 1) * child_blocks_of(state, request)
    if step.outstanding is None:
        step.outstanding = outstanding_blocks(state)
    return reserve + own + children + step.outstanding


def outstanding_blocks(state: SchedulerState) -> int:
    """Blocks live requests may still allocate before they finish. O(running + swapped),
    never the waiting queue."""
    total = sum(still_needed(state, request) for request in state.running)
    for request in state.swapped:
        total += final_blocks_of(state, request)
    return total


def still_needed(state: SchedulerState, request: Request) -> int:
    """Blocks a running request (with its unforked children) may still allocate."""
    kv = state.kv
    total = max(0, final_blocks_of(state, request) - kv.num_blocks(request.request_id))
    total += state.groups.num_unforked(request.group_id) * child_blocks_of(state, request)
    if request.index > 0 and request.num_computed_tokens < request.num_prompt_tokens:
        total += kv.num_groups  # a fresh fork still copies its shared last blocks
    return total


def final_blocks_of(state: SchedulerState, request: Request) -> int:
    """Blocks ``request`` holds at its longest (engine/kv/budget.py)."""
    config = state.config
    return final_blocks(
        request,
        state.block_size,
        config.max_model_len,
        state.kv.groups,
        min(request.num_prompt_tokens, config.max_num_batched_tokens),
    )


def child_blocks_of(state: SchedulerState, parent: Request) -> int:
    """Blocks one forked child of ``parent`` may allocate of its own."""
    return child_blocks(parent, state.block_size, state.config.max_model_len, state.kv.groups)
