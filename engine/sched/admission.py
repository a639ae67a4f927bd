"""Admission: swapped-out and waiting requests into running, in queue-key order.

Each step after the running requests (and never in a step that preempted), the queues
are read merged (``RequestQueues.merged``) up to the free sequence slots plus
``ADMISSION_LOOKAHEAD``. Each request is swapped in or admitted when it fits; one that
does not fit is passed over by smaller ones behind it, but at most ``max_num_bypasses``
times: then it holds the line, and nothing behind it is admitted until it fits (running
requests finish, so its blocks come free). See docs/reference/reliability.md, "Fairness".

With LoRA on (``SchedulerConfig.max_loras``), a request whose adapter would make the
running and loading requests hold more than ``max_loras`` distinct adapters is passed over
like one that does not fit: the runner has that many adapter slots for a step.

A waiting request whose prefix a lower tier holds past its device hit is admitted into
LOADING instead (``start_tier_load``): its blocks are loaded back this step and
``finish_loads`` moves it to running once the copies arrived, or requeues it.
"""

from __future__ import annotations

import itertools
import time

from engine.kv.manager import PrefixHit
from engine.request import Request, RequestStatus
from engine.sched.preemption import requeue_for_recompute
from engine.sched.reserve import admission_reserve, final_blocks_of, still_needed
from engine.sched.state import SchedulerState
from engine.sched.step import Step

# How many queued requests one step looks at beyond the free sequence slots (the ones
# ahead may not fit): bounds the host work per step whatever the queue length.
ADMISSION_LOOKAHEAD = 16


def admit(state: SchedulerState, step: Step) -> None:
    """Swap in and admit in queue-key order what fits, within the bypass bound."""
    slots = max(0, state.config.max_num_seqs - len(state.running))
    candidates = list(itertools.islice(state.queues.merged(), slots + ADMISSION_LOOKAHEAD))
    passed_over: list[Request] = []
    limit = state.config.max_num_bypasses
    adapters = AdapterSet.of(state)
    for request in candidates:
        if step.budget <= 0:
            return
        if passed_over and passed_over[-1].num_bypasses >= limit:
            return  # a request passed over too often holds the line
        if not adapters.admits(request):
            admitted: bool | None = False
        elif request.status is RequestStatus.SWAPPED:
            admitted = try_swap_in(state, step, request)
        else:
            admitted = try_admit(state, step, request)
        if admitted is None:
            return  # no sequence slot or token budget left: nothing behind fits either
        if not admitted:
            # Kept sorted by bypass count, so the last one says whether to stop.
            passed_over.append(request)
            passed_over.sort(key=lambda r: r.num_bypasses)
            continue
        adapters.add(request)
        for waiting in passed_over:
            waiting.num_bypasses += 1


class AdapterSet:
    """The distinct LoRA adapters of the running and loading requests, against the bound
    ``SchedulerConfig.max_loras`` (0: no bound, LoRA off)."""

    def __init__(self, limit: int, ids: set[int]) -> None:
        self.limit = limit
        self.ids = ids

    @classmethod
    def of(cls, state: SchedulerState) -> AdapterSet:
        live = itertools.chain(state.running, state.loading)
        return cls(state.config.max_loras, {r.lora.id for r in live if r.lora is not None})

    def admits(self, request: Request) -> bool:
        lora = request.lora
        return not self.limit or lora is None or lora.id in self.ids or len(self.ids) < self.limit

    def add(self, request: Request) -> None:
        if request.lora is not None:
            self.ids.add(request.lora.id)


def try_swap_in(state: SchedulerState, step: Step, request: Request) -> bool | None:
    """Swap ``request`` in and schedule it if it fits; None when no request can be
    scheduled any more this step."""
    if len(state.running) >= state.config.max_num_seqs:
        return None
    num_new = step.chunk(request.num_tokens - request.num_computed_tokens)
    if num_new == 0:
        return False
    kv = state.kv
    need = kv.swap_in_blocks(request, num_new)
    if need > kv.num_free_blocks - state.cache_config.watermark_blocks:
        return False
    state.swapped.remove(request)
    pairs = kv.swap_in(request)
    step.out.swap_in.extend(pairs)
    state.counters.blocks_swapped_in += len(pairs)
    new_blocks = kv.allocate_slots(request, num_new)
    assert new_blocks is not None, "room for the swapped-in request was checked"
    request.status = RequestStatus.RUNNING
    request.num_bypasses = 0
    state.running.append(request)
    step.add(request, num_new, kv)
    if step.outstanding is not None:  # its final blocks were counted as swapped
        step.outstanding += still_needed(state, request) - final_blocks_of(state, request)
    return True


def try_admit(state: SchedulerState, step: Step, request: Request) -> bool | None:
    """Admit ``request`` (its first prefill chunk) if it fits; None when no request
    can be scheduled any more this step."""
    kv = state.kv
    group_size = 1 + state.groups.num_unforked(request.group_id)
    if state.running and len(state.running) + group_size > state.config.max_num_seqs:
        return None
    # A request scoring its prompt (or pooling more than its last row) must compute
    # every position it reads.
    params = request.sampling_params
    pooling = params.pooling
    if params.prompt_logprobs is not None or (pooling is not None and pooling.needs_every_position):
        hit = PrefixHit.none(kv.num_groups)
    else:
        hit = kv.find_cached_prefix(request)
        if start_tier_load(state, step, request, hit, group_size):
            return True
    num_hit = hit.num_blocks * state.block_size
    num_new = step.chunk(request.num_tokens - num_hit)
    if num_new == 0:
        return False
    reserve = admission_reserve(state, step, request, num_hit + num_new, group_size)
    if kv.allocate_slots(request, num_new, hit, reserve) is None:
        return False
    state.queues.remove_waiting(request)
    _on_admitted(state, request, num_hit)
    kv.count_tier_lookup(request, hit.num_blocks)
    request.num_bypasses = 0
    state.running.append(request)
    step.add(request, num_new, kv)
    if step.outstanding is not None:
        step.outstanding += still_needed(state, request)
    return True


def start_tier_load(
    state: SchedulerState, step: Step, request: Request, device_hit: PrefixHit, group_size: int
) -> bool:
    """Admit the head of the queue into LOADING when a lower tier holds the blocks
    after its device hit: they are loaded back this step instead of recomputed, and
    the request computes the rest from the next step on. False: admit it as usual."""
    kv = state.kv
    hit = kv.find_tier_prefix(request, device_hit)
    if hit is None:
        return False
    covered = hit.num_blocks * state.block_size
    reserve = admission_reserve(state, step, request, covered, group_size)
    if not kv.start_load(request, hit, reserve):
        return False
    kv.count_tier_lookup(request, device_hit.num_blocks)
    state.queues.remove_waiting(request)
    request.num_bypasses = 0
    _on_admitted(state, request, covered)
    request.num_computed_tokens = 0  # computed once the loads arrived (finish_loads)
    request.status = RequestStatus.LOADING
    state.loading.append(request)
    state.loads[request.request_id] = hit
    if step.outstanding is not None:
        step.outstanding += still_needed(state, request)
    return True


def finish_loads(state: SchedulerState, loaded: dict[str, int]) -> None:
    """The runner applied this step's tier ops: ``loaded`` maps a loading request to how
    many of its planned blocks (leading) arrived intact. The prefix its blocks then serve
    counts as computed and enters the device prefix cache; the rest is recomputed."""
    kv = state.kv
    for request in state.loading:
        hit = state.loads.pop(request.request_id)
        intact = loaded.get(request.request_id, 0)
        served = kv.finish_load(request, intact, hit)
        request.num_computed_tokens = served * state.block_size
        missed = (hit.num_blocks - served) * state.block_size
        if missed:
            request.num_cached_tokens = min(request.num_cached_tokens, request.num_computed_tokens)
            if kv.enable_caching:
                state.counters.prefix_hits -= missed
        if not kv.has_tables(request.request_id):  # it had to give its blocks back
            requeue_for_recompute(state, request)
            continue
        kv.cache_computed_blocks(request)
        request.status = RequestStatus.RUNNING
        state.running.append(request)
    state.loading = []


def _on_admitted(state: SchedulerState, request: Request, num_hit: int) -> None:
    """Counters of an admission. Every admission is a prefix-cache lookup (a recomputed
    request looks up its generated tokens too); prompt tokens, queue time and
    ``num_cached_tokens`` belong to the first admission only."""
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = num_hit
    counters = state.counters
    if state.kv.enable_caching:
        counters.prefix_queries += request.num_tokens
        counters.prefix_hits += num_hit
    if request.first_scheduled_time is None:
        request.first_scheduled_time = time.monotonic()
        request.num_cached_tokens = num_hit
        counters.prompt_tokens += request.num_prompt_tokens
