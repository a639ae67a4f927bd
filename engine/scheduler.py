"""Continuous batching over paged KV blocks: admit, preempt, offload, and account.

Each ``schedule()`` call fills one step under two budgets, ``max_num_batched_tokens`` and
``max_num_seqs``, in this order:

1. running requests, in admission order: one decode token each, or their next prefill
   chunk. A request that cannot get a block preempts the lowest-priority, latest-arriving
   running request (possibly itself), by recompute or by swap to the host pool;
2. swapped-out and waiting requests together, in one order: the queue key
   (priority, arrival), swapped before waiting on a tie. Each is swapped in or admitted
   when it fits; one that does not fit is passed over by smaller ones behind it, but at
   most ``max_num_bypasses`` times: then it holds the line, and nothing behind it is
   admitted until it fits (running requests finish, so its blocks come free). The head of
   the order is never left waiting while the blocks it needs are free (see
   docs/RELIABILITY.md, "Fairness").

Prefill tokens (chunks of running prompts, admissions) are bounded by the step's prefill
budget as well as the token budget: from ``max_step_time_s``, ``max_step_time_ratio`` (a
multiple of what the step's decodes alone take) and the step cost the core measures
(``set_step_cost``), so a step that re-admits long histories cannot stall every decode for
seconds. Decode tokens are never cut by it, and a step without decodes is not bounded in
time (no stream waits on it).

Nothing is admitted or swapped in during a step that preempted, which keeps a freshly freed
block from being refilled in the same step and rules out admit/preempt ping-pong.
``update()`` then advances the token counters with what the runner computed, applies the
stop rules and returns per-sequence deltas. Pure Python: no torch, no model config.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.config import CacheConfig, SchedulerConfig
from engine.errors import RequestRejected
from engine.kv.accounting import KVShape, blocks_for_tokens
from engine.kv.budget import check_can_ever_run, child_blocks, final_blocks
from engine.kv.manager import KVCacheManager, PrefixHit
from engine.kv.stats import QueueSizes, StatsCounters, snapshot
from engine.outputs import (
    EngineStats,
    PromptLogprobChunk,
    RequestDelta,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from engine.request import Request, RequestStatus
from engine.speculative.drafts import Speculator
from engine.step_cost import StepCost, prefill_token_budget

WRITE_AHEAD_STEPS = 4

# How many queued requests one step looks at beyond the free sequence slots (the ones
# ahead may not fit): bounds the host work per step whatever the queue length.
ADMISSION_LOOKAHEAD = 16


@dataclass
class _Step:
    """The step being built: remaining token budgets and what is scheduled so far.
    ``prefill_budget`` bounds the tokens of requests that are not decoding."""

    out: SchedulerOutput
    budget: int
    prefill_budget: int
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    preempted: bool = False
    # Reserve policy: blocks live requests may still allocate, summed once per step.
    outstanding: int | None = None

    def chunk(self, remaining: int) -> int:
        """Tokens a request with ``remaining`` uncomputed tokens may compute this step:
        a decode (one token) only needs the token budget."""
        if remaining <= 1:
            return min(remaining, self.budget)
        return min(remaining, self.budget, self.prefill_budget)

    def charge(self, num_new: int, num_drafts: int = 0) -> None:
        """A decode verifying drafts spends token budget only: it is still one decode."""
        self.budget -= num_new
        if num_new - num_drafts > 1:
            self.prefill_budget -= num_new


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes."""

    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_shape: KVShape
    ) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.kv_shape = kv_shape
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(cache_config, kv_shape.groups)
        # Cached blocks this close to the head of the free queue are copied to the host
        # tier ahead of their eviction: what WRITE_AHEAD_STEPS steps allocate at most,
        # short of tier loads (a token budget plus a new block per running sequence each).
        # Loads come in bursts (a whole history at once), hence more than one step.
        self._write_ahead_window = WRITE_AHEAD_STEPS * (
            blocks_for_tokens(scheduler_config.max_num_batched_tokens, self.block_size)
            + scheduler_config.max_num_seqs
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        # Admitted with a prefix to load back from a tier (engine/kv/tiers.py): not
        # computing this step; finish_loads() moves them to running. Request id -> its hit.
        self.loading: list[Request] = []
        self._loads: dict[str, PrefixHit] = {}
        self._requests: dict[str, Request] = {}  # every live request, by id
        self._groups: dict[str, list[Request]] = {}  # group id -> live members
        self._unforked: dict[str, list[Request]] = {}  # group id -> children not yet forked
        self._finished_ids: list[str] = []
        self._counters = StatsCounters()
        self._queued_tokens = 0  # tokens of the waiting queue, kept with every move
        # Never-scheduled requests in add order, for queue timeouts; entries that were
        # scheduled or ended since are dropped lazily when they reach the front.
        self._unscheduled: deque[Request] = deque()
        self._arrivals = itertools.count()  # tie-break of equal queue keys: add order
        self._step_cost = StepCost()
        spec = scheduler_config.speculative
        self.speculator = Speculator(spec) if spec is not None else None

    # -- requests in and out -----------------------------------------------------------------

    def add_request(self, requests: list[Request]) -> None:
        """Queue one client request: its ``n`` sequences (same group, indices 0..n-1).

        Only index 0 is scheduled at first; the others fork from it once its prompt is
        computed. Raises ``RequestRejected`` when the group can never run or the queue is
        full; nothing is queued then.
        """
        group = sorted(requests, key=lambda r: r.index)
        self._validate_group(group)
        parent = group[0]
        check_can_ever_run(parent, len(group), self.config, self.cache_config, self.kv.groups)
        self._check_queue_room(parent)
        for request in group:
            request.status = RequestStatus.WAITING
            request.arrival_seq = next(self._arrivals)
            self._requests[request.request_id] = request
        self._groups[parent.group_id] = group
        if len(group) > 1:
            self._unforked[parent.group_id] = group[1:]
        self._enqueue_waiting(parent, front=False)
        self._unscheduled.append(parent)

    def abort(self, group_id: str) -> None:
        """Drop every sequence of the group and free its blocks; unknown ids are ignored."""
        members = self._groups.pop(group_id, None)
        if members is None:
            return
        unforked = self._unforked.pop(group_id, [])
        for request in members:
            if request.is_finished:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status is RequestStatus.SWAPPED:
                self.swapped.remove(request)
            elif request.status is RequestStatus.LOADING:
                self.loading.remove(request)
                self._loads.pop(request.request_id, None)
            elif not any(request is child for child in unforked):
                self._remove_waiting(request)
            self._retire(request, RequestStatus.FINISHED_ABORTED)

    def abort_sequence(self, request_id: str) -> None:
        """Drop one sequence of a group (a choice of ``n`` that ended on a stop string)
        and free its blocks; its siblings go on. Unknown or finished ids are ignored. A
        parent whose children are not forked yet takes its whole group along (nothing
        of the group has produced a token yet)."""
        request = self._requests.get(request_id)
        if request is None:
            return
        group_id = request.group_id
        unforked = self._unforked.get(group_id, [])
        if request.index == 0 and unforked:
            self.abort(group_id)
            return
        if request in unforked:
            unforked.remove(request)
            if not unforked:
                del self._unforked[group_id]
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        else:
            self.waiting.remove(request)
        self._retire(request, RequestStatus.FINISHED_ABORTED)
        self._forget_if_group_done(group_id)

    def preempt_unexecuted(self, request_id: str) -> bool:
        """Send a request scheduled in the last step back to the waiting queue, to be
        recomputed later: the runner could not execute its share (out of memory even
        alone). Call before ``update()``, which then skips it. False when it is not
        running (finished or aborted meanwhile)."""
        request = self._requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            return False
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self._enqueue_waiting(request, front=True)
        request.num_preemptions += 1
        self._counters.preemptions["recompute"] += 1
        return True

    def recompute_failed_swap_out(self, pairs: list[tuple[int, int]]) -> list[str]:
        """The runner could not copy these swap-out (device, host) pairs: their host
        blocks hold nothing usable, so the swapped requests owning them go back to the
        waiting queue to be recomputed (their device blocks were freed by the swap-out).
        Call before ``update()``. Returns their request ids."""
        lost = {host for _, host in pairs}
        victims = [
            r
            for r in self.swapped
            if any(lost.intersection(table) for table in self.kv.host_tables[r.request_id])
        ]
        for request in victims:
            self.swapped.remove(request)
            self.kv.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self._enqueue_waiting(request, front=True)
        return [r.request_id for r in victims]

    def _validate_group(self, group: list[Request]) -> None:
        """Programming errors of the caller, not user input: fail loudly."""
        if not group:
            raise ValueError("add_request needs at least one request")
        parent = group[0]
        for index, request in enumerate(group):
            if request.index != index or request.group_id != parent.group_id:
                raise ValueError(f"group {parent.group_id!r}: indices must be 0..n-1, one group")
            if request.prompt_token_ids != parent.prompt_token_ids:
                raise ValueError(f"group {parent.group_id!r}: sequences must share the prompt")
            if request.request_id in self._requests:
                raise ValueError(f"request id {request.request_id!r} is already live")
        if parent.group_id in self._groups:
            raise ValueError(f"group id {parent.group_id!r} is already live")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.loading)

    def _check_queue_room(self, parent: Request) -> None:
        max_requests = self.config.max_queued_requests
        if max_requests and len(self.waiting) >= max_requests:
            raise RequestRejected(
                "queue_full", f"{len(self.waiting)} requests are already queued; retry later"
            )
        max_tokens = self.config.max_queued_tokens
        if max_tokens:
            queued = self._queued_tokens
            if queued + parent.num_prompt_tokens > max_tokens:
                raise RequestRejected(
                    "queue_full",
                    f"{queued} prompt tokens are already queued (limit {max_tokens}); retry later",
                )

    def _queue_key(self, request: Request) -> tuple[int, float]:
        """The order of swap-ins and admissions: (priority, arrival); under ``fcfs``
        priorities are ignored."""
        priority = request.priority if self.config.scheduling_policy == "priority" else 0
        return (priority, request.arrival_time)

    def _enqueue_waiting(self, request: Request, front: bool) -> None:
        """Insert by queue key: a new request after its equals, a preempted one before
        them. New requests arrive last, so the scan from the back is short."""
        waiting = self.waiting
        key = self._queue_key(request)
        index = len(waiting)
        if front:
            index = 0
            while index < len(waiting) and self._queue_key(waiting[index]) < key:
                index += 1
        else:
            while index > 0 and self._queue_key(waiting[index - 1]) > key:
                index -= 1
        waiting.insert(index, request)
        self._queued_tokens += request.num_tokens

    def _remove_waiting(self, request: Request) -> None:
        self.waiting.remove(request)
        self._queued_tokens -= request.num_tokens

    def _enqueue_swapped(self, request: Request) -> None:
        swapped = self.swapped
        key = self._queue_key(request)
        index = len(swapped)
        while index > 0 and self._queue_key(swapped[index - 1]) > key:
            index -= 1
        swapped.insert(index, request)

    def set_step_cost(self, cost: StepCost) -> None:
        """The measured cost of a token (seconds, prefill and decode), for the prefill
        budget of the next steps; fed by the core, plain numbers."""
        self._step_cost = cost

    def unscheduled_older_than(self, cutoff: float) -> list[Request]:
        """Waiting requests never scheduled that arrived before ``cutoff`` (monotonic
        seconds), oldest first. Cost: the expired ones plus the stale entries dropped, not
        the queue length (arrivals are in add order)."""
        pending = self._unscheduled
        while pending and (pending[0].first_scheduled_time is not None or pending[0].is_finished):
            pending.popleft()
        expired = []
        for request in pending:
            if request.arrival_time >= cutoff:
                break
            if request.first_scheduled_time is None and not request.is_finished:
                expired.append(request)
        return expired

    # -- scheduling ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Build the next step. See the module docstring for the order of decisions."""
        step = _Step(
            out=SchedulerOutput(),
            budget=self.config.max_num_batched_tokens,
            prefill_budget=self._prefill_budget(),
        )
        self._schedule_running(step)
        if not step.preempted:
            self._admit(step)
        out = step.out
        out.scheduled = list(step.scheduled.values())
        out.copies = self.kv.take_copies()
        if self.kv.tiers is not None:
            out.tier_ops = self.kv.tiers.take_ops()
            out.tier_writes_ahead = self.kv.write_ahead(self._write_ahead_window)
        out.finished_request_ids = self._finished_ids
        self._finished_ids = []
        return out

    def _schedule_running(self, step: _Step) -> None:
        max_seqs = self.config.max_num_seqs
        for request in list(self.running):
            if step.budget <= 0 or len(step.scheduled) >= max_seqs:
                return
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = step.chunk(request.num_tokens - request.num_computed_tokens)
            if num_new == 0:
                continue  # a prefill past this step's prefill budget waits a step
            if self._schedule_drafts(step, request, num_new):
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._pick_victim()
                self._preempt(victim, step)
                if victim is request:
                    break
            else:
                self._add_to_step(step, request, num_new)

    def _schedule_drafts(self, step: _Step, request: Request, num_new: int) -> bool:
        """Schedule ``request``'s decode with draft tokens when it speculates and their
        slots fit without preempting anyone; False: schedule it plainly (under memory
        pressure speculation simply turns off)."""
        if self.speculator is None or num_new != 1 or not request.output_token_ids:
            return False
        if request.group_id in self._unforked:
            return False
        drafts = self.speculator.drafts(
            request, len(self.running), step.budget, self.config.max_model_len
        )
        if not drafts or self.kv.allocate_slots(request, 1 + len(drafts)) is None:
            return False
        self._add_to_step(step, request, 1, drafts)
        return True

    def _pick_victim(self) -> Request:
        """The last by queue key: lowest priority (highest value, under ``priority``),
        then latest arrival; ties go to the latest admitted, hence the reversed scan."""
        return max(reversed(self.running), key=self._queue_key)

    def _preempt(self, victim: Request, step: _Step) -> None:
        self.running.remove(victim)
        undone = step.scheduled.pop(victim.request_id, None)
        if undone is not None:
            step.budget += undone.num_new_tokens
        mode = self._preemption_mode(victim)
        if mode == "swap":
            pairs = self.kv.swap_out(victim)
            step.out.swap_out.extend(pairs)
            self._counters.blocks_swapped_out += len(pairs)
            victim.status = RequestStatus.SWAPPED
            self._enqueue_swapped(victim)
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.WAITING
            self._enqueue_waiting(victim, front=True)
        victim.num_preemptions += 1
        self._counters.preemptions[mode] += 1
        step.out.num_preempted += 1
        step.preempted = True

    def _preemption_mode(self, victim: Request) -> str:
        mode = self.config.preemption_mode
        if mode == "recompute" or not self.kv.can_swap_out(victim):
            return "recompute"
        if mode == "auto" and victim.num_computed_tokens < self.config.swap_min_tokens:
            return "recompute"
        return "swap"

    def _prefill_budget(self) -> int:
        """Prefill tokens this step may compute: the token budget less one token per
        decode, further bounded by ``max_step_time_s`` and ``max_step_time_ratio`` at the
        measured step cost (``max_step_time_s`` 0 turns both off). A step without decodes
        is not time-bounded: no stream waits on it for a token, and queued prompts wait
        for the running prefills to finish whatever their chunk, so the bound would only
        cut a lone long prompt into more, slower steps."""
        decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens <= 1)
        room = max(0, self.config.max_num_batched_tokens - decodes)
        if self.config.max_step_time_s <= 0 or decodes == 0:
            return room
        timed = prefill_token_budget(
            self._step_cost,
            self.config.max_step_time_s,
            decodes,
            self.config.min_prefill_tokens,
            self.config.max_step_time_ratio,
        )
        return min(room, timed)

    def _queued(self) -> Iterator[Request]:
        """Swapped and waiting requests merged by queue key (swapped first on a tie),
        lazily: a step reads only as far as it admits."""
        swapped = ((self._queue_key(r), 0, r.arrival_seq, r) for r in self.swapped)
        waiting = ((self._queue_key(r), 1, r.arrival_seq, r) for r in self.waiting)
        return (entry[3] for entry in heapq.merge(swapped, waiting))

    def _admit(self, step: _Step) -> None:
        """Swap in and admit in queue-key order what fits; see the module docstring for
        the bound on passing over a request that does not fit."""
        slots = max(0, self.config.max_num_seqs - len(self.running))
        candidates = list(itertools.islice(self._queued(), slots + ADMISSION_LOOKAHEAD))
        passed_over: list[Request] = []
        limit = self.config.max_num_bypasses
        for request in candidates:
            if step.budget <= 0:
                return
            if passed_over and passed_over[-1].num_bypasses >= limit:
                return  # a request passed over too often holds the line
            if request.status is RequestStatus.SWAPPED:
                admitted = self._try_swap_in(step, request)
            else:
                admitted = self._try_admit(step, request)
            if admitted is None:
                return  # no sequence slot or token budget left: nothing behind fits either
            if not admitted:
                # Kept sorted by bypass count, so the last one says whether to stop.
                passed_over.append(request)
                passed_over.sort(key=lambda r: r.num_bypasses)
                continue
            for waiting in passed_over:
                waiting.num_bypasses += 1

    def _try_swap_in(self, step: _Step, request: Request) -> bool | None:
        """Swap ``request`` in and schedule it if it fits; None when no request can be
        scheduled any more this step."""
        if len(self.running) >= self.config.max_num_seqs:
            return None
        num_new = step.chunk(request.num_tokens - request.num_computed_tokens)
        if num_new == 0:
            return False
        need = self.kv.swap_in_blocks(request, num_new)
        if need > self.kv.device.num_free - self.cache_config.watermark_blocks:
            return False
        self.swapped.remove(request)
        pairs = self.kv.swap_in(request)
        step.out.swap_in.extend(pairs)
        self._counters.blocks_swapped_in += len(pairs)
        new_blocks = self.kv.allocate_slots(request, num_new)
        assert new_blocks is not None, "room for the swapped-in request was checked"
        request.status = RequestStatus.RUNNING
        request.num_bypasses = 0
        self.running.append(request)
        self._add_to_step(step, request, num_new)
        if step.outstanding is not None:  # its final blocks were counted as swapped
            step.outstanding += self._still_needed(request) - self._final_blocks(request)
        return True

    def _try_admit(self, step: _Step, request: Request) -> bool | None:
        """Admit ``request`` (its first prefill chunk) if it fits; None when no request
        can be scheduled any more this step."""
        group_size = 1 + len(self._unforked.get(request.group_id, ()))
        if self.running and len(self.running) + group_size > self.config.max_num_seqs:
            return None
        # A request scoring its prompt must compute every position it scores.
        if request.sampling_params.prompt_logprobs is not None:
            hit = PrefixHit.none(self.kv.num_groups)
        else:
            hit = self.kv.find_cached_prefix(request)
            if self._start_tier_load(step, request, hit, group_size):
                return True
        num_hit = hit.num_blocks * self.block_size
        num_new = step.chunk(request.num_tokens - num_hit)
        if num_new == 0:
            return False
        reserve = self._admission_reserve(step, request, num_hit + num_new, group_size)
        if self.kv.allocate_slots(request, num_new, hit, reserve) is None:
            return False
        self._remove_waiting(request)
        self._on_admitted(request, num_hit)
        self.kv.count_tier_lookup(request, hit.num_blocks)
        request.num_bypasses = 0
        self.running.append(request)
        self._add_to_step(step, request, num_new)
        if step.outstanding is not None:
            step.outstanding += self._still_needed(request)
        return True

    def _start_tier_load(
        self, step: _Step, request: Request, device_hit: PrefixHit, group_size: int
    ) -> bool:
        """Admit the head of the queue into LOADING when a lower tier holds the blocks
        after its device hit: they are loaded back this step instead of recomputed, and
        the request computes the rest from the next step on. False: admit it as usual."""
        hit = self.kv.find_tier_prefix(request, device_hit)
        if hit is None:
            return False
        covered = hit.num_blocks * self.block_size
        reserve = self._admission_reserve(step, request, covered, group_size)
        if not self.kv.start_load(request, hit, reserve):
            return False
        self.kv.count_tier_lookup(request, device_hit.num_blocks)
        self._remove_waiting(request)
        request.num_bypasses = 0
        self._on_admitted(request, covered)
        request.num_computed_tokens = 0  # computed once the loads arrived (finish_loads)
        request.status = RequestStatus.LOADING
        self.loading.append(request)
        self._loads[request.request_id] = hit
        if step.outstanding is not None:
            step.outstanding += self._still_needed(request)
        return True

    def finish_loads(self, loaded: dict[str, int]) -> None:
        """The runner applied this step's tier ops: ``loaded`` maps a loading request to
        how many of its planned blocks (leading) arrived intact. The prefix its blocks then
        serve counts as computed and enters the device prefix cache; the rest is
        recomputed. Call after every step that had tier ops (an empty dict when nothing
        could be loaded)."""
        for request in self.loading:
            hit = self._loads.pop(request.request_id)
            intact = loaded.get(request.request_id, 0)
            served = self.kv.finish_load(request, intact, hit)
            request.num_computed_tokens = served * self.block_size
            missed = (hit.num_blocks - served) * self.block_size
            if missed:
                request.num_cached_tokens = min(
                    request.num_cached_tokens, request.num_computed_tokens
                )
                if self.kv.enable_caching:
                    self._counters.prefix_hits -= missed
            if request.request_id not in self.kv.tables:  # it had to give its blocks back
                request.status = RequestStatus.WAITING
                self._enqueue_waiting(request, front=True)
                continue
            self.kv.cache_computed_blocks(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        self.loading = []

    def _admission_reserve(
        self, step: _Step, request: Request, covered: int, group_size: int
    ) -> int:
        """Blocks that must stay free after allocating the first chunk of ``request``.

        ``optimistic``: the watermark plus the rest of its prompt. ``reserve``: the
        watermark plus everything this group and all running and swapped requests may
        still need, so nothing ever has to be preempted.
        """
        reserve = self.cache_config.watermark_blocks
        blocks_for = self.kv.blocks_for_tokens
        already = blocks_for(covered)
        if self.config.admission_policy != "reserve":
            return reserve + blocks_for(request.num_tokens) - already
        own = self._final_blocks(request) - already
        children = (group_size - 1) * self._child_blocks(request)
        if step.outstanding is None:
            step.outstanding = self._outstanding_blocks()
        return reserve + own + children + step.outstanding

    def _outstanding_blocks(self) -> int:
        """Blocks live requests may still allocate before they finish (reserve policy).
        Summed once per step (O(running + swapped), never the waiting queue); each
        admission of the step then adds its own share."""
        total = sum(self._still_needed(request) for request in self.running)
        for request in self.swapped:
            total += self._final_blocks(request)
        return total

    def _still_needed(self, request: Request) -> int:
        """Blocks a running request (with its unforked children) may still allocate."""
        held = self.kv.num_blocks(request.request_id)
        total = max(0, self._final_blocks(request) - held)
        total += len(self._unforked.get(request.group_id, ())) * self._child_blocks(request)
        if request.index > 0 and request.num_computed_tokens < request.num_prompt_tokens:
            total += self.kv.num_groups  # a fresh fork still copies its shared last blocks
        return total

    def _final_blocks(self, request: Request) -> int:
        config = self.config
        return final_blocks(
            request,
            self.block_size,
            config.max_model_len,
            self.kv.groups,
            min(request.num_prompt_tokens, config.max_num_batched_tokens),
        )

    def _child_blocks(self, parent: Request) -> int:
        return child_blocks(parent, self.block_size, self.config.max_model_len, self.kv.groups)

    def _on_admitted(self, request: Request, num_hit: int) -> None:
        """Counters of an admission. Every admission is a prefix-cache lookup (a recomputed
        request looks up its generated tokens too); prompt tokens, queue time and
        ``num_cached_tokens`` belong to the first admission only."""
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        if self.kv.enable_caching:
            self._counters.prefix_queries += request.num_tokens
            self._counters.prefix_hits += num_hit
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = num_hit
            self._counters.prompt_tokens += request.num_prompt_tokens

    def _add_to_step(
        self, step: _Step, request: Request, num_new: int, drafts: list[int] | None = None
    ) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        token_ids = request.all_token_ids[start:end]
        if drafts:
            token_ids += drafts
        step.scheduled[request.request_id] = ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            num_computed_tokens=start,
            block_tables=self.kv.tables[request.request_id],
            sample=end == len(request.all_token_ids) and not request.sampling_params.prefill_only,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            seed=request.seed,
            num_draft_tokens=len(drafts) if drafts else 0,
        )
        step.charge(len(token_ids), len(drafts) if drafts else 0)

    # -- results -------------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[RequestDelta]:
        """Advance counters by what the runner computed, append sampled tokens, stop
        finished sequences and free their blocks. One delta per sampled token."""
        deltas = []
        any_finished = False
        for scheduled in out.scheduled:
            request = self._requests.get(scheduled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted since the step was built
            num_new = self._computed_by_step(scheduled, result)
            request.num_computed_tokens += num_new
            if scheduled.num_draft_tokens:
                self.kv.trim(request)  # roll back the slots of rejected drafts
            if request.num_computed_tokens % self.block_size < num_new:  # a block filled up
                self.kv.cache_computed_blocks(request)
            chunks = result.prompt_logprobs.get(request.request_id)
            if chunks:
                _add_prompt_logprobs(request, chunks)
            if not scheduled.sample:
                if self._prefill_done(request):
                    deltas.append(self._finish_prefill_only(request))
                    any_finished = True
                continue
            if request.group_id in self._unforked:
                self._fork_children(request)
            delta = self._append_sample(request, result, scheduled.num_draft_tokens)
            any_finished |= delta.finished
            deltas.append(delta)
        if any_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        self._counters.steps += 1
        return deltas

    @staticmethod
    def _computed_by_step(scheduled: ScheduledRequest, result: RunnerOutput) -> int:
        """Tokens whose K/V the step left valid: all it scheduled, less the rejected
        drafts (a verification emits the accepted drafts and one token after them)."""
        num_new = len(scheduled.token_ids)
        if not scheduled.num_draft_tokens:
            return num_new
        emitted = len(result.spec_token_ids[scheduled.request_id])
        return num_new - scheduled.num_draft_tokens + emitted - 1

    def _append_sample(
        self, request: Request, result: RunnerOutput, num_drafts: int = 0
    ) -> RequestDelta:
        """Append what the step sampled for ``request``: one token, or a verification's
        accepted drafts and the token after them, cut at the first that stops it."""
        rid = request.request_id
        tokens = result.spec_token_ids.get(rid)
        if tokens is None:
            tokens = [result.sampled_token_ids[rid]]
            logprob = result.logprobs.get(rid)
            logprobs = None if logprob is None else [logprob]
        else:
            logprobs = result.spec_logprobs.get(rid)
            self._count_verification(num_drafts, len(tokens))
        delta = RequestDelta(
            request_id=rid,
            group_id=request.group_id,
            index=request.index,
            new_token_ids=[],
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
        )
        status = None
        for token in tokens:
            request.append_output_token(token)
            delta.new_token_ids.append(token)
            status = self._stop_status(request, token, rid in result.grammar_completed)
            if status is not None:
                break
        self._counters.generation_tokens += len(delta.new_token_ids)
        if logprobs is not None:
            delta.logprobs = logprobs[: len(delta.new_token_ids)]
        delta.num_output_tokens = request.num_output_tokens
        if request.num_output_tokens == 1 and request.sampling_params.prompt_logprobs is not None:
            delta.prompt_logprobs = list(request.prompt_logprobs)
        if status is not None:
            delta.ended_on_stop_token = status is RequestStatus.FINISHED_STOPPED and _is_stop_token(
                request, delta.new_token_ids[-1]
            )
            self._finish(request, delta, status)
        return delta

    def _count_verification(self, num_drafts: int, num_emitted: int) -> None:
        """Speculation counters of one verification (emitted before any stop cut)."""
        counters = self._counters
        counters.spec_drafts += 1
        counters.spec_draft_tokens += num_drafts
        counters.spec_accepted_tokens += num_emitted - 1
        counters.spec_emitted_tokens += num_emitted

    def _finish(self, request: Request, delta: RequestDelta, status: RequestStatus) -> None:
        delta.finish_reason = status.finish_reason
        delta.num_blocks = self.kv.num_blocks(request.request_id)
        if request.first_scheduled_time is not None:
            delta.queue_time = request.first_scheduled_time - request.arrival_time
        self._retire(request, status)
        self._forget_if_group_done(request.group_id)

    @staticmethod
    def _prefill_done(request: Request) -> bool:
        return (
            request.sampling_params.prefill_only
            and request.num_computed_tokens >= request.num_prompt_tokens
        )

    def _finish_prefill_only(self, request: Request) -> RequestDelta:
        """A max_tokens 0 request ends once its prompt is computed (and scored): one
        finishing delta with the prompt logprobs and no token."""
        delta = RequestDelta(
            request_id=request.request_id,
            group_id=request.group_id,
            index=request.index,
            new_token_ids=[],
            prompt_logprobs=list(request.prompt_logprobs),
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
        )
        self._finish(request, delta, RequestStatus.FINISHED_LENGTH)
        return delta

    def _stop_status(
        self, request: Request, token: int, grammar_completed: bool = False
    ) -> RequestStatus | None:
        """EOS (unless ignore_eos) or a stop token id ends the sequence once ``min_tokens``
        are out, and a completed grammar always does; max_tokens and max_model_len cut it
        at length."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if grammar_completed:
            return RequestStatus.FINISHED_STOPPED
        if num_output > params.min_tokens and _is_stop_token(request, token):
            return RequestStatus.FINISHED_STOPPED
        if (
            num_output >= params.max_tokens
            or len(request.all_token_ids) >= self.config.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _fork_children(self, parent: Request) -> None:
        """The parent's prompt is computed: each child shares all its blocks and recomputes
        only the last prompt token, then samples its own first token."""
        assert parent.num_computed_tokens >= parent.num_prompt_tokens
        for child in self._unforked.pop(parent.group_id):
            self.kv.fork(parent, child)
            child.num_computed_tokens = parent.num_prompt_tokens - 1
            child.num_cached_tokens = parent.num_cached_tokens
            child.first_scheduled_time = parent.first_scheduled_time
            child.status = RequestStatus.RUNNING
            self.running.append(child)

    def _retire(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        del self._requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def _forget_if_group_done(self, group_id: str) -> None:
        members = self._groups.get(group_id)
        if members is not None and all(r.is_finished for r in members):
            del self._groups[group_id]

    # -- observation -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert the block invariants and that every queue holds requests in its state."""
        self.kv.check_integrity()
        for request in self.running:
            assert request.status is RequestStatus.RUNNING, request
            assert request.request_id in self.kv.tables, request
        for request in self.swapped:
            assert request.status is RequestStatus.SWAPPED, request
            assert request.request_id in self.kv.host_tables, request
        for request in self.waiting:
            assert request.status is RequestStatus.WAITING, request
            assert request.request_id not in self.kv.tables, request
        for request in self.loading:
            assert request.status is RequestStatus.LOADING, request
            assert request.request_id in self.kv.tables, request
        assert len(self._loads) == len(self.loading), "a load is planned for no request"
        unforked = sum(len(children) for children in self._unforked.values())
        queued = len(self.running) + len(self.swapped) + len(self.waiting) + unforked
        queued += len(self.loading)
        assert queued == len(self._requests), "a live request is in no queue, or in two"

    def live_requests(self) -> list[Request]:
        """Every live sequence (running, swapped, waiting, unforked), for observers."""
        return list(self._requests.values())

    def stats(self) -> EngineStats:
        queues = QueueSizes(
            running=len(self.running),
            waiting=len(self.waiting) + sum(len(c) for c in self._unforked.values()),
            swapped=len(self.swapped),
            live_tokens=sum(r.num_computed_tokens for r in self.running),
            loading=len(self.loading),
            retained_tokens=self._retained_tokens(),
        )
        return snapshot(self.kv, self.kv_shape, self._counters, queues)

    def _retained_tokens(self) -> tuple[int, ...]:
        """Per KV group, the running requests' tokens its attention still reads (a sliding
        group counts at most its window per request)."""
        computed = [r.num_computed_tokens for r in self.running]
        by_window: dict[int | None, int] = {None: sum(computed)}
        for group in self.kv.groups:
            window = group.window
            if window is not None and window not in by_window:
                by_window[window] = sum(min(tokens, window) for tokens in computed)
        return tuple(by_window[group.window] for group in self.kv.groups)


def _add_prompt_logprobs(request: Request, chunks: list[PromptLogprobChunk]) -> None:
    """Append the scored prompt positions that are new (a recompute after preemption
    scores positions again; those are already known)."""
    for chunk in sorted(chunks, key=lambda c: c.start):
        known = 1 + len(request.prompt_logprobs)  # next prompt position without a logprob
        skip = known - chunk.start
        if 0 <= skip < len(chunk.entries):
            request.prompt_logprobs.extend(chunk.entries[skip:])


def _is_stop_token(request: Request, token: int) -> bool:
    """A stop token id, or EOS unless the request ignores it."""
    params = request.sampling_params
    return token in params.stop_token_ids or (
        not params.ignore_eos and token in request.eos_token_ids
    )
