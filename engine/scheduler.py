"""Continuous batching over paged KV blocks: admit, preempt, offload, and account.

Each ``schedule()`` call fills one step under two budgets, ``max_num_batched_tokens`` and
``max_num_seqs``, in this order:

1. running requests, in admission order: one decode token each, or their next prefill
   chunk. A request that cannot get a block preempts the lowest-priority, latest-arriving
   running request (possibly itself), by recompute or by swap to the host pool
   (engine/sched/preemption.py);
2. swapped-out and waiting requests together, in one order: the queue key
   (priority, arrival), swapped before waiting on a tie. Each is swapped in or admitted
   when it fits; one that does not fit is passed over by smaller ones behind it, but at
   most ``max_num_bypasses`` times: then it holds the line, and nothing behind it is
   admitted until it fits (running requests finish, so its blocks come free). The head of
   the order is never left waiting while the blocks it needs are free (see
   docs/reference/reliability.md, "Fairness"; engine/sched/admission.py).

Prefill tokens (chunks of running prompts, admissions) are bounded by the step's prefill
budget as well as the token budget: from ``max_step_time_s``, ``max_step_time_ratio`` (a
multiple of what the step's decodes alone take) and the step cost the core measures
(``set_step_cost``), so a step that re-admits long histories cannot stall every decode for
seconds. Decode tokens are never cut by it, and a step without decodes is not bounded in
time (no stream waits on it; engine/sched/step.py).

Nothing is admitted or swapped in during a step that preempted, which keeps a freshly freed
block from being refilled in the same step and rules out admit/preempt ping-pong.
``update()`` then advances the token counters with what the runner computed, applies the
stop rules and returns per-sequence deltas. Pure Python: no torch, no model config.

This module is the loop; the parts it runs live in engine/sched/ (see its ``__init__``),
all over one ``SchedulerState``, and the KV manager is reached through its methods only.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from engine.config import CacheConfig, SchedulerConfig
from engine.kv.accounting import KVShape, blocks_for_tokens
from engine.kv.budget import check_can_ever_run
from engine.kv.stats import QueueSizes, snapshot
from engine.outputs import EngineStats, RequestDelta, RunnerOutput, SchedulerOutput
from engine.request import Request, RequestStatus
from engine.sched import admission, preemption, results
from engine.sched.state import SchedulerState
from engine.sched.step import Step, prefill_budget
from engine.sched.stop import prefill_done
from engine.step_cost import StepCost

WRITE_AHEAD_STEPS = 4


class Scheduler(SchedulerState):
    """Decides, each step, which requests run and how many tokens each computes."""

    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_shape: KVShape
    ) -> None:
        super().__init__(scheduler_config, cache_config, kv_shape)
        # Cached blocks this close to the head of the free queue are copied to the host
        # tier ahead of their eviction: what WRITE_AHEAD_STEPS steps allocate at most,
        # short of tier loads (a token budget plus a new block per running sequence each).
        # Loads come in bursts (a whole history at once), hence more than one step.
        self._write_ahead_window = WRITE_AHEAD_STEPS * (
            blocks_for_tokens(scheduler_config.max_num_batched_tokens, self.block_size)
            + scheduler_config.max_num_seqs
        )

    # -- requests in and out -----------------------------------------------------------------

    def add_request(self, requests: list[Request]) -> None:
        """Queue one client request: its ``n`` sequences (same group, indices 0..n-1).

        Only index 0 is scheduled at first; the others fork from it once its prompt is
        computed. Raises ``RequestRejected`` when the group can never run or the queue is
        full; nothing is queued then.
        """
        group = sorted(requests, key=lambda r: r.index)
        self.groups.validate(group, self.live)
        parent = group[0]
        check_can_ever_run(parent, len(group), self.config, self.cache_config, self.kv.groups)
        self.queues.check_room(parent)
        for request in group:
            request.status = RequestStatus.WAITING
            self.queues.stamp_arrival(request)
            self.live[request.request_id] = request
        self.groups.add(group)
        self.queues.add_new(parent)

    def abort(self, group_id: str) -> None:
        """Drop every sequence of the group and free its blocks; unknown ids are ignored."""
        popped = self.groups.pop(group_id)
        if popped is None:
            return
        members, unforked = popped
        for request in members:
            if request.is_finished:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status is RequestStatus.SWAPPED:
                self.swapped.remove(request)
            elif request.status is RequestStatus.LOADING:
                self.loading.remove(request)
                self.loads.pop(request.request_id, None)
            elif not any(request is child for child in unforked):
                self.queues.remove_waiting(request)
            self.retire(request, RequestStatus.FINISHED_ABORTED)

    def abort_sequence(self, request_id: str) -> None:
        """Drop one sequence of a group (a choice of ``n`` that ended on a stop string)
        and free its blocks; its siblings go on. Unknown or finished ids are ignored. A
        parent whose children are not forked yet takes its whole group along (nothing
        of the group has produced a token yet)."""
        request = self.live.get(request_id)
        if request is None:
            return
        group_id = request.group_id
        if request.index == 0 and self.groups.num_unforked(group_id):
            self.abort(group_id)
            return
        if self.groups.drop_unforked(request):
            pass  # never forked: it is in no queue
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        else:
            self.waiting.remove(request)
        self.retire(request, RequestStatus.FINISHED_ABORTED)
        self.groups.forget_if_done(group_id)

    def preempt_unexecuted(self, request_id: str) -> bool:
        """Send a request scheduled in the last step back to the waiting queue, to be
        recomputed later: the runner could not execute its share (out of memory even
        alone). Call before ``update()``, which then skips it. False when it is not
        running (finished or aborted meanwhile)."""
        return preemption.preempt_unexecuted(self, request_id)

    def recompute_failed_swap_out(self, pairs: list[tuple[int, int]]) -> list[str]:
        """The runner could not copy these swap-out (device, host) pairs: the swapped
        requests owning them go back to the waiting queue to be recomputed. Call before
        ``update()``. Returns their request ids."""
        return preemption.recompute_failed_swap_out(self, pairs)

    def finish_loads(self, loaded: dict[str, int]) -> None:
        """The runner applied this step's tier ops: ``loaded`` maps a loading request to
        how many of its planned blocks (leading) arrived intact. Call after every step
        that had tier ops (an empty dict when nothing could be loaded)."""
        admission.finish_loads(self, loaded)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.loading)

    def set_step_cost(self, cost: StepCost) -> None:
        """The measured cost of a token (seconds, prefill and decode), for the prefill
        budget of the next steps; fed by the core, plain numbers."""
        self.step_cost = cost

    def unscheduled_older_than(self, cutoff: float) -> list[Request]:
        """Waiting requests never scheduled that arrived before ``cutoff`` (monotonic
        seconds), oldest first, for queue timeouts."""
        return self.queues.unscheduled_older_than(cutoff)

    # -- scheduling ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Build the next step. See the module docstring for the order of decisions."""
        step = Step(
            out=SchedulerOutput(),
            budget=self.config.max_num_batched_tokens,
            prefill_budget=prefill_budget(self.config, self.running, self.step_cost),
        )
        self._schedule_running(step)
        if not step.preempted:
            admission.admit(self, step)
        out = step.out
        out.scheduled = list(step.scheduled.values())
        kv = self.kv
        out.copies = kv.take_copies()
        out.tier_ops = kv.take_tier_ops()
        out.tier_writes_ahead = kv.write_ahead(self._write_ahead_window)
        out.finished_request_ids = self.finished_ids
        self.finished_ids = []
        return out

    def _schedule_running(self, step: Step) -> None:
        max_seqs = self.config.max_num_seqs
        kv = self.kv
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
            while kv.allocate_slots(request, num_new) is None:
                victim = preemption.pick_victim(self)
                preemption.preempt(self, victim, step)
                if victim is request:
                    break
            else:
                step.add(request, num_new, kv)

    def _schedule_drafts(self, step: Step, request: Request, num_new: int) -> bool:
        """Schedule ``request``'s decode with draft tokens when it speculates and their
        slots fit without preempting anyone; False: schedule it plainly (under memory
        pressure speculation simply turns off)."""
        if self.speculator is None or num_new != 1 or not request.output_token_ids:
            return False
        if request.group_id in self.groups.unforked:
            return False
        drafts = self.speculator.drafts(
            request, len(self.running), step.budget, self.config.max_model_len
        )
        if not drafts or self.kv.allocate_slots(request, 1 + len(drafts)) is None:
            return False
        step.add(request, 1, self.kv, drafts)
        return True

    # -- results -------------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[RequestDelta]:
        """Advance counters by what the runner computed, append sampled tokens, stop
        finished sequences and free their blocks. One delta per sampled token."""
        deltas = []
        any_finished = False
        kv, block_size, unforked = self.kv, self.block_size, self.groups.unforked
        for scheduled in out.scheduled:
            request = self.live.get(scheduled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted since the step was built
            num_new = results.computed_by_step(scheduled, result)
            request.num_computed_tokens += num_new
            if scheduled.num_draft_tokens:
                kv.trim(request)  # roll back the slots of rejected drafts
            if request.num_computed_tokens % block_size < num_new:  # a block filled up
                kv.cache_computed_blocks(request)
            chunks = result.prompt_logprobs.get(request.request_id)
            if chunks:
                results.add_prompt_logprobs(request, chunks)
            pooled = result.pooled.get(request.request_id)
            if pooled is not None:
                results.add_pooled(request, pooled)
            if not scheduled.sample:
                if prefill_done(request):
                    delta = results.prefill_only_delta(request)
                    self._finish(request, delta, RequestStatus.FINISHED_LENGTH)
                    deltas.append(delta)
                    any_finished = True
                continue
            if request.group_id in unforked:
                self.groups.fork_children(request, kv, self.running)
            delta, status = results.append_sample(
                request,
                result,
                scheduled.num_draft_tokens,
                self.config.max_model_len,
                self.counters,
            )
            if status is not None:
                self._finish(request, delta, status)
                any_finished = True
            deltas.append(delta)
        if any_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        self.counters.steps += 1
        return deltas

    def _finish(self, request: Request, delta: RequestDelta, status: RequestStatus) -> None:
        results.mark_finished(delta, request, status, self.kv.num_blocks(request.request_id))
        self.retire(request, status)
        self.groups.forget_if_done(request.group_id)

    # -- observation -----------------------------------------------------------------------------

    def live_requests(self) -> list[Request]:
        """Every live sequence (running, swapped, waiting, unforked), for observers."""
        return list(self.live.values())

    def stats(self) -> EngineStats:
        queues = QueueSizes(
            running=len(self.running),
            waiting=len(self.waiting) + self.groups.total_unforked(),
            swapped=len(self.swapped),
            live_tokens=sum(r.num_computed_tokens for r in self.running),
            loading=len(self.loading),
            retained_tokens=self._retained_tokens(),
            **self._lora_names(),
        )
        return snapshot(self.kv, self.kv_shape, self.counters, queues)

    def _lora_names(self) -> dict[str, tuple[str, ...]]:
        """The adapters running (loading included) and queued (swapped included), by name."""
        if not self.config.max_loras:
            return {}
        running = itertools.chain(self.running, self.loading)
        queued = itertools.chain(self.waiting, self.swapped)
        return {"running_loras": _adapter_names(running), "waiting_loras": _adapter_names(queued)}

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


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))
