"""Runs one scheduled step on the runner and contains what can go wrong there.

The scheduler's bookkeeping for a step is final before the runner starts, so a failure
inside the runner is survivable exactly when the damage stays inside that step's batch:

- block moves run first, on their own; an out-of-memory error is retried once after
  freeing memory (the moves are idempotent as long as no forward ran after them).
  Swap-outs run before everything else: a swap-out only reads device blocks the
  scheduler has already given up and writes host blocks, so when it fails even after the
  retry its victims are reported (``failed_swap_out``) and the core sends them back to
  be recomputed instead of failing the engine. Swap-ins and copy-on-write copies touch
  blocks that live requests will read, so a failure there is fatal for the engine.
- the forward and sampling then run over the batch. An out-of-memory error frees cached
  device memory and retries the batch in halves, down to single requests and then to
  halves of one request's token chunk (a chunked prefill, exact because attention reads
  the K/V the earlier piece wrote). A request that does not fit even alone is reported
  ``unexecuted``: the core preempts it (recompute, later, in a smaller batch) a few times
  before giving up on it. Any other exception fails the whole batch -- and only it.
- errors that leave the device unusable (CUDA errors, device-side asserts) and a run of
  consecutive failed steps are fatal: they raise ``EngineFault``.

Nothing here imports torch at module level: the scheduler tests drive it with fake runners.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from dataclasses import dataclass, field
from typing import Protocol

from engine.errors import AdapterUnavailable
from engine.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

# Substrings of errors after which the device (or its context) cannot be trusted again.
_DEVICE_FATAL_MARKERS = ("CUDA error", "device-side assert", "illegal memory access", "NCCL")


class Runner(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput: ...


class EngineFault(RuntimeError):
    """A failure the engine cannot contain to one batch: the engine must stop."""


@dataclass
class StepResult:
    """The runner's output for what ran; the requests that failed (id -> why) and those
    that ran out of memory even alone (id -> why). The caller must fail or preempt those
    before it applies ``output``."""

    output: RunnerOutput
    failed: dict[str, str] = field(default_factory=dict)
    unexecuted: dict[str, str] = field(default_factory=dict)
    # Swap-out (device, host) pairs that could not be copied: their host blocks hold
    # nothing usable, so their requests must be recomputed.
    failed_swap_out: list[tuple[int, int]] = field(default_factory=list)


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (any device) or a RuntimeError saying 'out of memory'."""
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def is_device_fatal(exc: BaseException) -> bool:
    if type(exc).__name__ == "AcceleratorError":
        return True
    message = str(exc)
    return any(marker in message for marker in _DEVICE_FATAL_MARKERS)


def release_device_memory() -> None:
    """Give back what an out-of-memory error may have left behind: dead tensors held by
    the traceback's frames and the CUDA caching allocator's unused blocks."""
    gc.collect()
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class StepExecutor:
    """Executes ``SchedulerOutput``s on a runner with the containment described above."""

    def __init__(self, runner: Runner, *, max_consecutive_failures: int = 3) -> None:
        self.runner = runner
        self.max_consecutive_failures = max_consecutive_failures
        self._consecutive_failures = 0
        self.num_oom_retries = 0  # forward pieces re-run after an out-of-memory error
        self.num_failed_swap_outs = 0  # steps whose swap-out fell back to recompute

    def execute(self, out: SchedulerOutput) -> StepResult:
        failed_swap_out = self._run_swap_out(out.swap_out) if out.swap_out else []
        forward = dataclasses.replace(out, swap_out=[])
        if out.scheduled and (out.swap_in or out.copies):
            self._run_moves(_moves_only(forward))
            forward = SchedulerOutput(scheduled=out.scheduled)
        try:
            result = StepResult(self.runner.execute(forward))
        except AdapterUnavailable as exc:
            # A client's bad adapter, not a sick engine: not counted as a failed step.
            result = self._without_adapter(out.scheduled, exc)
            result.failed_swap_out = failed_swap_out
            return result
        except Exception as exc:
            self._raise_if_fatal(exc)
            if forward.swap_in or forward.copies:
                # Only moves, no batch: a failed move is never safe to contain.
                raise EngineFault(f"block moves failed: {_describe(exc)}") from exc
            if not is_out_of_memory(exc):
                logger.exception("a step failed; failing its %d requests", len(out.scheduled))
                result = _fail_all(out.scheduled, exc)
            else:
                logger.warning("out of memory in a forward of %d requests", len(out.scheduled))
                release_device_memory()
                result = self._retry_smaller(out.scheduled)
        result.failed_swap_out = failed_swap_out
        self._count(result)
        return result

    # -- moves ---------------------------------------------------------------------------

    def _run_swap_out(self, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Copy the swap-out victims' blocks to the host; the pairs that failed (all of
        them: a partly done copy is as unusable as none), or [] when it worked."""
        moves = SchedulerOutput(swap_out=pairs)
        for attempt in range(2):
            try:
                self.runner.execute(moves)
                return []
            except Exception as exc:
                self._raise_if_fatal(exc)
                logger.warning(
                    "swap-out of %d blocks failed (%s)%s",
                    len(pairs),
                    _describe(exc),
                    "; retrying" if attempt == 0 and is_out_of_memory(exc) else "",
                )
                if not is_out_of_memory(exc):
                    break
                release_device_memory()
        self.num_failed_swap_outs += 1
        return list(pairs)

    def _run_moves(self, moves: SchedulerOutput) -> None:
        try:
            self.runner.execute(moves)
            return
        except Exception as exc:
            self._raise_if_fatal(exc)
            if not is_out_of_memory(exc):
                raise EngineFault(f"block moves failed: {_describe(exc)}") from exc
        release_device_memory()
        try:
            self.runner.execute(moves)
        except Exception as exc:
            raise EngineFault(f"block moves failed twice: {_describe(exc)}") from exc

    def _without_adapter(
        self, batch: list[ScheduledRequest], exc: AdapterUnavailable
    ) -> StepResult:
        """Fail the requests on the adapter that could not be read; run the others."""
        logger.warning("%s; failing the requests that use it", exc)
        lost = [r for r in batch if r.lora is not None and r.lora.id == exc.lora_id]
        result = _fail_all(lost, exc)
        rest = [r for r in batch if r not in lost]
        if rest:
            try:
                _merge(result, StepResult(self.runner.execute(SchedulerOutput(scheduled=rest))))
            except AdapterUnavailable as again:  # a second adapter of the step is gone too
                _merge(result, self._without_adapter(rest, again))
        return result

    # -- out-of-memory retries -------------------------------------------------------------

    def _retry_smaller(self, batch: list[ScheduledRequest]) -> StepResult:
        result = StepResult(RunnerOutput())
        pending = _halves(batch)
        while pending:
            # The later pieces of a request whose earlier piece did not run are moot.
            piece = [r for r in pending.pop(0) if not _is_lost(result, r.request_id)]
            if not piece:
                continue
            self.num_oom_retries += 1
            try:
                output = self.runner.execute(SchedulerOutput(scheduled=piece))
            except Exception as exc:
                self._raise_if_fatal(exc)
                if not is_out_of_memory(exc):
                    _merge(result, _fail_all(piece, exc))
                    continue
                release_device_memory()
                smaller = _halves(piece)
                if smaller:
                    pending[:0] = smaller
                else:
                    result.unexecuted.update(_fail_all(piece, exc).failed)
                continue
            _merge(result, StepResult(output))
        return result

    # -- failure accounting ----------------------------------------------------------------

    def _raise_if_fatal(self, exc: Exception) -> None:
        if is_device_fatal(exc):
            raise EngineFault(f"the device failed: {_describe(exc)}") from exc

    def _count(self, result: StepResult) -> None:
        # Out-of-memory victims are not counted: the core retries and gives up per request.
        if not result.failed:
            self._consecutive_failures = 0
            return
        self._consecutive_failures += 1
        if self._consecutive_failures >= self.max_consecutive_failures:
            reason = next(iter(result.failed.values()))
            raise EngineFault(
                f"{self._consecutive_failures} consecutive steps failed; last: {reason}"
            )


def _is_lost(result: StepResult, request_id: str) -> bool:
    return request_id in result.failed or request_id in result.unexecuted


def _moves_only(out: SchedulerOutput) -> SchedulerOutput:
    return SchedulerOutput(
        swap_out=out.swap_out,
        swap_in=out.swap_in,
        copies=out.copies,
        finished_request_ids=out.finished_request_ids,
    )


def _halves(batch: list[ScheduledRequest]) -> list[list[ScheduledRequest]]:
    """Two smaller pieces of work with the same effect, or [] when nothing is left to
    split. One request splits its token chunk: the first part computes K/V only, the
    second attends to it and samples (if the original sampled)."""
    if len(batch) > 1:
        middle = len(batch) // 2
        return [batch[:middle], batch[middle:]]
    (request,) = batch
    if request.num_new_tokens < 2:
        return []
    middle = request.num_new_tokens // 2
    head = dataclasses.replace(request, token_ids=request.token_ids[:middle], sample=False)
    tail = dataclasses.replace(
        request,
        token_ids=request.token_ids[middle:],
        num_computed_tokens=request.num_computed_tokens + middle,
    )
    return [[head], [tail]]


def _fail_all(batch: list[ScheduledRequest], exc: BaseException) -> StepResult:
    reason = _describe(exc)
    return StepResult(RunnerOutput(), {request.request_id: reason for request in batch})


def _merge(into: StepResult, part: StepResult) -> None:
    into.output.sampled_token_ids.update(part.output.sampled_token_ids)
    into.output.logprobs.update(part.output.logprobs)
    into.output.grammar_completed.update(part.output.grammar_completed)
    for request_id, chunks in part.output.prompt_logprobs.items():
        into.output.prompt_logprobs.setdefault(request_id, []).extend(chunks)
    into.output.pooled.update(part.output.pooled)
    into.failed.update(part.failed)
    into.unexecuted.update(part.unexecuted)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
