"""EngineCore: one synchronous step of the engine, and a stats snapshot for other threads.

    step():  out = scheduler.schedule() -> result = runner.execute(out) -> scheduler.update()

The core is single-threaded; the AsyncEngine serialises ``add_request``/``abort``/``step``
on its loop thread. ``stats()`` may be called from any thread: it returns the immutable
snapshot published after the last mutation (a reference swap, atomic under the GIL).
"""

from __future__ import annotations

from typing import Protocol

from engine.outputs import EngineStats, RequestDelta, RunnerOutput, SchedulerOutput
from engine.request import Request
from engine.scheduler import Scheduler


class Runner(Protocol):
    """Executes one step on a device: swap_out, swap_in, copies, then the forward and
    sampling for ``scheduled``; drops per-request state of ``finished_request_ids``."""

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput: ...


class EngineCore:
    """Drives a scheduler and a runner in lock step."""

    def __init__(self, scheduler: Scheduler, runner: Runner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self._stats = scheduler.stats()

    def add_request(self, requests: list[Request]) -> None:
        """Queue one client request (its ``n`` sequences); may raise ``RequestRejected``."""
        self.scheduler.add_request(requests)
        self._publish()

    def abort(self, group_id: str) -> None:
        """Abort a client request; its blocks are free before the next step runs."""
        self.scheduler.abort(group_id)
        self._publish()

    def step(self) -> list[RequestDelta]:
        """Run one engine step and return what it produced for each sequence.

        A step with nothing to compute still reaches the runner when requests left since
        the last one, so it can drop their state; a fully idle step costs nothing.
        """
        out = self.scheduler.schedule()
        if out.is_empty and not out.finished_request_ids:
            self._publish()  # a step may preempt (recompute) without scheduling anything
            return []
        result = self.runner.execute(out)
        deltas = self.scheduler.update(out, result)
        self._publish()
        return deltas

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """The snapshot published after the last step, add or abort."""
        return self._stats

    def _publish(self) -> None:
        self._stats = self.scheduler.stats()
