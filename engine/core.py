"""EngineCore: one synchronous step of the engine, and a stats snapshot for other threads.

    step():  out = scheduler.schedule() -> result = runner.execute(out) -> scheduler.update()
             (tier moves before the forward; tier write-aheads beside it, done on return)

The runner runs through a ``StepExecutor`` (engine/step_executor.py): a failure inside a
step's forward fails only that batch's requests (their deltas carry ``error``), an
out-of-memory error is retried with smaller batches first, and only failures that cannot
be contained raise (``EngineFault``), which the AsyncEngine treats as a dead engine.

The core is single-threaded; the AsyncEngine serialises ``add_request``/``abort``/``step``
on its loop thread. ``stats()`` may be called from any thread: it returns the immutable
snapshot published after the last mutation (a reference swap, atomic under the GIL).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from engine.outputs import EngineStats, RequestDelta, RunnerOutput, SchedulerOutput, TierOp
from engine.request import FinishReason, Request
from engine.scheduler import Scheduler
from engine.step_cost import StepCostMeter
from engine.step_executor import EngineFault, StepExecutor

logger = logging.getLogger(__name__)

# RequestDelta.error_code values.
QUEUE_TIMEOUT = "queue_timeout"
ENGINE_FAULT = "engine_fault"
# A request that runs out of memory even alone is preempted (recomputed later) this many
# times before it is failed.
MAX_OOM_PREEMPTIONS = 2


class Runner(Protocol):
    """Executes one step on a device: swap_out, swap_in, copies, then the forward and
    sampling for ``scheduled``; drops per-request state of ``finished_request_ids``."""

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput: ...


class TierMover(Protocol):
    """Applies the tiered prefix cache's moves (engine/model/runtime/tier_io.py)."""

    def apply(self, ops: list[TierOp], *, wait_for_disk: bool = False) -> dict[str, int]: ...
    def start_writes_ahead(self, ops: list[TierOp]) -> None: ...
    def wait_writes_ahead(self) -> BaseException | None: ...
    def close(self) -> None: ...


class Closeable(Protocol):
    def close(self) -> None: ...


class EngineCore:
    """Drives a scheduler and a runner in lock step."""

    def __init__(
        self, scheduler: Scheduler, runner: Runner, tier_io: TierMover | None = None
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tier_io = tier_io
        # The KV event publisher (engine/kv/event_publisher.py), closed last at shutdown.
        self.kv_events: Closeable | None = None
        self.executor = StepExecutor(runner)
        # Every live client request's sequences, so a failure can end all of its choices.
        self._groups: dict[str, list[Request]] = {}
        self._oom_preemptions: dict[str, int] = {}  # request id -> count
        self._stats = scheduler.stats()
        # Seconds per prefill and decode token, measured around the runner; the
        # scheduler sizes its prefill budget from it (SchedulerConfig.max_step_time_s).
        self.step_cost = StepCostMeter()

    @property
    def runner(self) -> Runner:
        return self._runner

    @runner.setter
    def runner(self, runner: Runner) -> None:
        # Tests and tools wrap the runner after construction; the executor follows.
        self._runner = runner
        if hasattr(self, "executor"):
            self.executor.runner = runner

    def add_request(self, requests: list[Request]) -> None:
        """Queue one client request (its ``n`` sequences); may raise ``RequestRejected``."""
        self.scheduler.add_request(requests)
        if requests:
            self._groups[requests[0].group_id] = list(requests)
        self._publish()

    def abort(self, group_id: str) -> None:
        """Abort a client request; its blocks are free before the next step runs."""
        self.scheduler.abort(group_id)
        for request in self._groups.pop(group_id, ()):
            self._oom_preemptions.pop(request.request_id, None)
        self._publish()

    def abort_sequence(self, request_id: str) -> None:
        """Abort one sequence of a client request (a choice of ``n`` the server ended);
        its blocks are free before the next step runs, its siblings go on."""
        self.scheduler.abort_sequence(request_id)
        self._oom_preemptions.pop(request_id, None)
        for group_id, members in list(self._groups.items()):
            if any(r.request_id == request_id for r in members):
                if all(r.is_finished for r in members):
                    del self._groups[group_id]
                break
        self._publish()

    def step(self) -> list[RequestDelta]:
        """Run one engine step and return what it produced for each sequence.

        A step with nothing to compute still reaches the runner when requests left since
        the last one, so it can drop their state; a fully idle step costs nothing.
        Raises ``EngineFault`` when a failure cannot be contained to the step's batch.
        """
        out = self.scheduler.schedule()
        if out.tier_ops:
            self._apply_tier_ops(out)
        writer = self.tier_io if out.tier_writes_ahead else None
        if writer is not None:
            writer.start_writes_ahead(out.tier_writes_ahead)
        try:
            return self._execute(out)
        finally:
            if writer is not None:
                self._finish_writes_ahead(writer, out.tier_writes_ahead)

    def _execute(self, out: SchedulerOutput) -> list[RequestDelta]:
        if out.is_empty and not out.finished_request_ids:
            self._publish()  # a step may preempt (recompute) without scheduling anything
            return []
        started = time.perf_counter()
        result = self.executor.execute(out)
        self._measure(out, time.perf_counter() - started)
        if result.failed_swap_out:
            self.scheduler.recompute_failed_swap_out(result.failed_swap_out)
        reasons = {**result.failed, **self._preempt_unexecuted(result.unexecuted)}
        failed = self._fail(reasons, ENGINE_FAULT) if reasons else []
        deltas = failed + self.scheduler.update(out, result.output)
        self._forget_finished(deltas)
        if failed:
            self._check_after_failure()
        self._publish()
        return deltas

    def _apply_tier_ops(self, out: SchedulerOutput) -> None:
        """Tier moves run first (they read blocks this step may overwrite); the requests
        loading a prefix then join the running set with what arrived."""
        loaded = self.tier_io.apply(out.tier_ops) if self.tier_io is not None else {}
        self.scheduler.finish_loads(loaded)

    def _finish_writes_ahead(self, writer: TierMover, ops: list[TierOp]) -> None:
        """Wait for the step's write-aheads (long done: a forward is slower than a copy).
        A failed one costs only its cached copies, never the engine."""
        assert self.scheduler.kv.tiers is not None
        error = writer.wait_writes_ahead()
        if error is not None:
            logger.error(
                "tier write-ahead failed (%s); its %d blocks stay uncached", error, len(ops)
            )
            self.scheduler.kv.tiers.forget_writes(ops)

    def close(self) -> None:
        """At shutdown: put every cached prefix block on disk (when there is a disk tier)
        and let the writes finish, so a restarted server finds them; then publish the last
        KV events."""
        if self.tier_io is not None:
            ops = self.scheduler.kv.persist_ops()
            if ops:
                self.tier_io.apply(ops, wait_for_disk=True)
            self.tier_io.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def expire_queued(self, timeout_s: float) -> list[RequestDelta]:
        """Fail the requests that have waited more than ``timeout_s`` without ever being
        scheduled (preempted requests already started and are not counted)."""
        if timeout_s <= 0:
            return []
        cutoff = time.monotonic() - timeout_s
        expired = {
            r.request_id: f"waited more than {timeout_s:g} s in the queue; retry later"
            for r in self.scheduler.unscheduled_older_than(cutoff)
        }
        if not expired:
            return []
        deltas = self._fail(expired, QUEUE_TIMEOUT)
        self._publish()
        return deltas

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """The snapshot published after the last step, add or abort."""
        return self._stats

    def _fail(self, reasons: dict[str, str], code: str) -> list[RequestDelta]:
        """Abort the client requests of the given sequences; one finishing delta, carrying
        the error, for every sequence of theirs that was still live."""
        deltas: list[RequestDelta] = []
        for group_id, members in list(self._groups.items()):
            reason = next((reasons[r.request_id] for r in members if r.request_id in reasons), None)
            if reason is None:
                continue
            live = [r for r in members if not r.is_finished]
            self.abort(group_id)
            deltas.extend(_error_delta(r, reason, code) for r in live)
        return deltas

    def _preempt_unexecuted(self, unexecuted: dict[str, str]) -> dict[str, str]:
        """Preempt (for recompute in a later, smaller batch) what ran out of memory even
        alone; return the requests that already had their retries, to be failed."""
        give_up = {}
        for request_id, reason in unexecuted.items():
            count = self._oom_preemptions.get(request_id, 0)
            if count < MAX_OOM_PREEMPTIONS and self.scheduler.preempt_unexecuted(request_id):
                self._oom_preemptions[request_id] = count + 1
            else:
                give_up[request_id] = f"{reason} (after {count} preemptions)"
        return give_up

    def _forget_finished(self, deltas: list[RequestDelta]) -> None:
        for group_id in {d.group_id for d in deltas if d.finished}:
            members = self._groups.get(group_id)
            if members is not None and all(r.is_finished for r in members):
                del self._groups[group_id]
                for request in members:
                    self._oom_preemptions.pop(request.request_id, None)

    def _check_after_failure(self) -> None:
        """After failing a batch the block pools must still add up; if not, the failure
        was not contained and the engine must stop."""
        try:
            self.scheduler.check_integrity()
        except AssertionError as exc:
            raise EngineFault(f"KV state inconsistent after a failed step: {exc}") from exc

    def _measure(self, out: SchedulerOutput, seconds: float) -> None:
        """Feed the step's duration to the cost meter and the new estimate to the
        scheduler (decode: one token of a request that samples; the rest is prefill)."""
        decodes = sum(1 for r in out.scheduled if r.num_new_tokens == 1 and r.sample)
        prefill = sum(r.num_new_tokens for r in out.scheduled) - decodes
        self.scheduler.set_step_cost(self.step_cost.observe(prefill, decodes, seconds))

    def _publish(self) -> None:
        self._stats = self.scheduler.stats()


def _error_delta(request: Request, reason: str, code: str) -> RequestDelta:
    return RequestDelta(
        request_id=request.request_id,
        group_id=request.group_id,
        index=request.index,
        new_token_ids=[],
        finish_reason=FinishReason.ABORT,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_output_tokens=request.num_output_tokens,
        error=reason,
        error_code=code,
    )
