"""Continuous batching over paged KV blocks: admit, preempt, offload, and account.

Each ``schedule()`` call fills one step under two budgets, ``max_num_batched_tokens`` and
``max_num_seqs``, in this order:

1. running requests, in admission order: one decode token each, or their next prefill
   chunk. A request that cannot get a block preempts the lowest-priority, latest-arriving
   running request (possibly itself), by recompute or by swap to the host pool;
2. swapped-out requests, oldest first, when the device has room again;
3. waiting requests, head of line first (FCFS within a priority), when their prompt fits
   the admission policy.

Nothing is admitted or swapped in during a step that preempted, which keeps a freshly freed
block from being refilled in the same step and rules out admit/preempt ping-pong.
``update()`` then advances the token counters with what the runner computed, applies the
stop rules and returns per-sequence deltas. Pure Python: no torch, no model config.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.config import CacheConfig, SchedulerConfig
from engine.errors import RequestRejected
from engine.kv.accounting import KVShape, blocks_for_tokens
from engine.kv.budget import check_can_ever_run, child_blocks, final_blocks
from engine.kv.manager import KVCacheManager
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


@dataclass
class _Step:
    """The step being built: remaining token budget and what is scheduled so far."""

    out: SchedulerOutput
    budget: int
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    preempted: bool = False


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes."""

    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_shape: KVShape
    ) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.kv_shape = kv_shape
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(cache_config)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self._requests: dict[str, Request] = {}  # every live request, by id
        self._groups: dict[str, list[Request]] = {}  # group id -> live members
        self._unforked: dict[str, list[Request]] = {}  # group id -> children not yet forked
        self._finished_ids: list[str] = []
        self._counters = StatsCounters()

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
        check_can_ever_run(parent, len(group), self.config, self.cache_config)
        self._check_queue_room(parent)
        for request in group:
            request.status = RequestStatus.WAITING
            self._requests[request.request_id] = request
        self._groups[parent.group_id] = group
        if len(group) > 1:
            self._unforked[parent.group_id] = group[1:]
        self._enqueue_waiting(parent, front=False)

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
            elif not any(request is child for child in unforked):
                self.waiting.remove(request)
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
        return bool(self.waiting or self.running or self.swapped)

    def _check_queue_room(self, parent: Request) -> None:
        max_requests = self.config.max_queued_requests
        if max_requests and len(self.waiting) >= max_requests:
            raise RequestRejected(
                "queue_full", f"{len(self.waiting)} requests are already queued; retry later"
            )
        max_tokens = self.config.max_queued_tokens
        if max_tokens:
            queued = sum(r.num_tokens for r in self.waiting)
            if queued + parent.num_prompt_tokens > max_tokens:
                raise RequestRejected(
                    "queue_full",
                    f"{queued} prompt tokens are already queued (limit {max_tokens}); retry later",
                )

    def _enqueue_waiting(self, request: Request, front: bool) -> None:
        """Insert by priority: a new request after its equals, a preempted one before them."""
        waiting = self.waiting
        index = len(waiting)
        if front:
            index = 0
            while index < len(waiting) and waiting[index].priority < request.priority:
                index += 1
        else:
            while index > 0 and waiting[index - 1].priority > request.priority:
                index -= 1
        waiting.insert(index, request)

    # -- scheduling ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Build the next step. See the module docstring for the order of decisions."""
        step = _Step(out=SchedulerOutput(), budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            self._swap_in(step)
            if not self.swapped:
                self._admit_waiting(step)
        out = step.out
        out.scheduled = list(step.scheduled.values())
        out.copies = self.kv.take_copies()
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
            num_new = min(request.num_tokens - request.num_computed_tokens, step.budget)
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._pick_victim()
                self._preempt(victim, step)
                if victim is request:
                    break
            else:
                self._add_to_step(step, request, num_new)

    def _pick_victim(self) -> Request:
        """Lowest priority (highest value), then latest arrival; ties go to the latest
        admitted, hence the reversed scan."""
        return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))

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
            self.swapped.append(victim)
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

    def _swap_in(self, step: _Step) -> None:
        watermark = self.cache_config.watermark_blocks
        while self.swapped and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, step.budget)
            held = len(self.kv.host_tables[request.request_id])
            total = request.num_computed_tokens + num_new
            need = max(held, blocks_for_tokens(total, self.block_size))
            if need > self.kv.device.num_free - watermark:
                return
            self.swapped.popleft()
            pairs = self.kv.swap_in(request)
            step.out.swap_in.extend(pairs)
            self._counters.blocks_swapped_in += len(pairs)
            new_blocks = self.kv.allocate_slots(request, num_new)
            assert new_blocks is not None, "room for the swapped-in request was checked"
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_to_step(step, request, num_new)

    def _admit_waiting(self, step: _Step) -> None:
        max_seqs = self.config.max_num_seqs
        while self.waiting and step.budget > 0:
            request = self.waiting[0]
            group_size = 1 + len(self._unforked.get(request.group_id, ()))
            if self.running and len(self.running) + group_size > max_seqs:
                return
            # A request scoring its prompt must compute every position it scores.
            scores = request.sampling_params.prompt_logprobs is not None
            hits = [] if scores else self.kv.find_cached_prefix(request)
            num_hit = len(hits) * self.block_size
            num_new = min(request.num_tokens - num_hit, step.budget)
            reserve = self._admission_reserve(request, num_hit + num_new, group_size)
            if self.kv.allocate_slots(request, num_new, hits, reserve) is None:
                return
            self.waiting.popleft()
            self._on_admitted(request, num_hit)
            self.running.append(request)
            self._add_to_step(step, request, num_new)

    def _admission_reserve(self, request: Request, covered: int, group_size: int) -> int:
        """Blocks that must stay free after allocating the first chunk of ``request``.

        ``optimistic``: the watermark plus the rest of its prompt. ``reserve``: the
        watermark plus everything this group and all running and swapped requests may
        still need, so nothing ever has to be preempted.
        """
        reserve = self.cache_config.watermark_blocks
        block_size = self.block_size
        already = blocks_for_tokens(covered, block_size)
        if self.config.admission_policy != "reserve":
            return reserve + blocks_for_tokens(request.num_tokens, block_size) - already
        own = self._final_blocks(request) - already
        children = (group_size - 1) * self._child_blocks(request)
        return reserve + own + children + self._outstanding_blocks()

    def _outstanding_blocks(self) -> int:
        """Blocks live requests may still allocate before they finish (reserve policy)."""
        total = 0
        for request in self.running:
            held = self.kv.num_blocks(request.request_id)
            total += max(0, self._final_blocks(request) - held)
            total += len(self._unforked.get(request.group_id, ())) * self._child_blocks(request)
            if request.index > 0 and request.num_computed_tokens < request.num_prompt_tokens:
                total += 1  # a fresh fork still has to copy its shared last block
        for request in self.swapped:
            total += self._final_blocks(request)
        return total

    def _final_blocks(self, request: Request) -> int:
        return final_blocks(request, self.block_size, self.config.max_model_len)

    def _child_blocks(self, parent: Request) -> int:
        return child_blocks(parent, self.block_size, self.config.max_model_len)

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

    def _add_to_step(self, step: _Step, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        step.scheduled[request.request_id] = ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            num_computed_tokens=start,
            block_ids=self.kv.tables[request.request_id],
            sample=end == len(request.all_token_ids) and not request.sampling_params.prefill_only,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            seed=request.seed,
        )
        step.budget -= num_new

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
            num_new = len(scheduled.token_ids)
            request.num_computed_tokens += num_new
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
            delta = self._append_sample(request, result)
            any_finished |= delta.finished
            deltas.append(delta)
        if any_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        self._counters.steps += 1
        return deltas

    def _append_sample(self, request: Request, result: RunnerOutput) -> RequestDelta:
        rid = request.request_id
        token = result.sampled_token_ids[rid]
        request.append_output_token(token)
        self._counters.generation_tokens += 1
        logprob = result.logprobs.get(rid)
        delta = RequestDelta(
            request_id=rid,
            group_id=request.group_id,
            index=request.index,
            new_token_ids=[token],
            logprobs=None if logprob is None else [logprob],
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_token_ids),
        )
        if request.num_output_tokens == 1 and request.sampling_params.prompt_logprobs is not None:
            delta.prompt_logprobs = list(request.prompt_logprobs)
        status = self._stop_status(request, token)
        if status is not None:
            self._finish(request, delta, status)
        return delta

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

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        """EOS (unless ignore_eos) or a stop token id ends the sequence once ``min_tokens``
        are out; max_tokens and max_model_len cut it at length."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output > params.min_tokens and (
            token in params.stop_token_ids
            or (not params.ignore_eos and token in request.eos_token_ids)
        ):
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
        unforked = sum(len(children) for children in self._unforked.values())
        queued = len(self.running) + len(self.swapped) + len(self.waiting) + unforked
        assert queued == len(self._requests), "a live request is in no queue, or in two"

    def stats(self) -> EngineStats:
        queues = QueueSizes(
            running=len(self.running),
            waiting=len(self.waiting) + sum(len(c) for c in self._unforked.values()),
            swapped=len(self.swapped),
            live_tokens=sum(r.num_computed_tokens for r in self.running),
        )
        return snapshot(self.kv, self.kv_shape, self._counters, queues)


def _add_prompt_logprobs(request: Request, chunks: list[PromptLogprobChunk]) -> None:
    """Append the scored prompt positions that are new (a recompute after preemption
    scores positions again; those are already known)."""
    for chunk in sorted(chunks, key=lambda c: c.start):
        known = 1 + len(request.prompt_logprobs)  # next prompt position without a logprob
        skip = known - chunk.start
        if 0 <= skip < len(chunk.entries):
            request.prompt_logprobs.extend(chunk.entries[skip:])
