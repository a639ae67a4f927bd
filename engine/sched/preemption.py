"""Preemption: which running request gives its blocks back, and how.

The victim is the last by queue key -- lowest priority, then latest arrival, ties to the
latest admitted -- possibly the request that asked for the block. It is swapped to the
host pool or, when swapping is off, impossible (no host room) or not worth it (``auto``
below ``swap_min_tokens``), recomputed: ``requeue_for_recompute`` is the one way a request
goes back to the front of the waiting queue with nothing computed, whether it was
preempted, could not run even alone, lost its swapped-out copy or its tier load.
"""

from __future__ import annotations

from engine.request import Request, RequestStatus
from engine.sched.state import SchedulerState
from engine.sched.step import Step


def pick_victim(state: SchedulerState) -> Request:
    """The last running request by queue key; ties go to the latest admitted, hence the
    reversed scan."""
    return max(reversed(state.running), key=state.queues.key)


def preemption_mode(state: SchedulerState, victim: Request) -> str:
    """``swap`` or ``recompute`` for this victim under the configured mode."""
    mode = state.config.preemption_mode
    if mode == "recompute" or not state.kv.can_swap_out(victim):
        return "recompute"
    if mode == "auto" and victim.num_computed_tokens < state.config.swap_min_tokens:
        return "recompute"
    return "swap"


def requeue_for_recompute(state: SchedulerState, request: Request) -> None:
    """Free whatever the request holds and put it first among its equals in the waiting
    queue, to compute everything again (its prompt and the tokens it generated). The
    caller has taken it out of its previous queue and counts the preemption if it is one."""
    state.kv.free(request)
    request.num_computed_tokens = 0
    request.status = RequestStatus.WAITING
    state.queues.enqueue_waiting(request, front=True)


def preempt(state: SchedulerState, victim: Request, step: Step) -> None:
    """Take ``victim`` out of running (and out of this step) by swap or recompute."""
    state.running.remove(victim)
    step.undo(victim.request_id)
    mode = preemption_mode(state, victim)
    if mode == "swap":
        pairs = state.kv.swap_out(victim)
        step.out.swap_out.extend(pairs)
        state.counters.blocks_swapped_out += len(pairs)
        victim.status = RequestStatus.SWAPPED
        state.queues.enqueue_swapped(victim)
    else:
        requeue_for_recompute(state, victim)
    victim.num_preemptions += 1
    state.counters.preemptions[mode] += 1
    step.out.num_preempted += 1
    step.preempted = True


def preempt_unexecuted(state: SchedulerState, request_id: str) -> bool:
    """Requeue a running request the runner could not execute (out of memory even
    alone), counted as a recompute preemption. False when it is not running."""
    request = state.live.get(request_id)
    if request is None or request.status is not RequestStatus.RUNNING:
        return False
    state.running.remove(request)
    requeue_for_recompute(state, request)
    request.num_preemptions += 1
    state.counters.preemptions["recompute"] += 1
    return True


def recompute_failed_swap_out(state: SchedulerState, pairs: list[tuple[int, int]]) -> list[str]:
    """Requeue the swapped requests owning the host blocks of failed swap-out copies:
    those hold nothing usable (their device blocks were freed by the swap-out). Returns
    their request ids."""
    lost = {host for _, host in pairs}
    victims = [r for r in state.swapped if state.kv.uses_host_blocks(r.request_id, lost)]
    for request in victims:
        state.swapped.remove(request)
        requeue_for_recompute(state, request)
    return [r.request_id for r in victims]
