"""Engine fault containment, without HTTP: a real scheduler and EngineCore over the fake
paged-KV runner (tests/unit/fakes.py), whose tokens depend on what it reads back from the
blocks, wrapped by runners that fail the way devices do.

- a forward that raises fails only the requests of its batch; the rest finish exactly;
- an out-of-memory error is retried with smaller batches (down to halves of one chunk),
  and every request still gets exactly its reference tokens;
- a failed swap-out sends its victims back to be recomputed, and they still finish
  exactly;
- a failure during swap-ins or copies, a device-fatal error, or a run of failed steps
  raises ``EngineFault`` (the AsyncEngine then marks the engine dead);
- requests queued longer than the queue timeout are failed with ``queue_timeout``.
"""

from __future__ import annotations

import time

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.core import ENGINE_FAULT, QUEUE_TIMEOUT, EngineCore
from engine.kv.accounting import KVShape
from engine.outputs import RequestDelta, RunnerOutput, SchedulerOutput
from engine.request import SamplingParams
from engine.scheduler import Scheduler
from engine.step_executor import EngineFault, is_out_of_memory
from tests.unit.fakes import FakeKVRunner, PrefixHashModel, expected_for, make_group

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, kv_dtype="float32")
BLOCK = 4


class OOMRunner:
    """Raises torch's OutOfMemoryError whenever a forward exceeds ``max_tokens``: a
    device whose activation memory only fits small batches."""

    def __init__(self, inner: FakeKVRunner, max_tokens: int) -> None:
        self.inner = inner
        self.max_tokens = max_tokens
        self.ooms = 0

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        import torch

        if out.num_batched_tokens > self.max_tokens:
            self.ooms += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.inner.execute(out)


class FailOnStep:
    """Raises ``error`` on the forwards (calls with scheduled work) numbered in ``steps``."""

    def __init__(self, inner: FakeKVRunner, steps: set[int], error: Exception) -> None:
        self.inner = inner
        self.steps = steps
        self.error = error
        self.forwards = 0
        self.failed_batches: list[list[str]] = []

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if out.scheduled:
            self.forwards += 1
            if self.forwards in self.steps:
                self.failed_batches.append([r.request_id for r in out.scheduled])
                raise self.error
        return self.inner.execute(out)


class FailOnMoves:
    """Raises on every call that moves blocks of live requests (swap-in or copy)."""

    def __init__(self, inner: FakeKVRunner) -> None:
        self.inner = inner

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if out.swap_in or out.copies:
            raise RuntimeError("DMA engine stalled")
        return self.inner.execute(out)


class FailOnSwapOut:
    """Raises on every call that swaps blocks out."""

    def __init__(self, inner: FakeKVRunner) -> None:
        self.inner = inner
        self.failures = 0

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if out.swap_out:
            self.failures += 1
            raise RuntimeError("DMA engine stalled")
        return self.inner.execute(out)


def make_core(
    runner_factory: object,
    *,
    num_blocks: int = 256,
    num_host_blocks: int = 0,
    **scheduler: object,
) -> tuple[EngineCore, FakeKVRunner, SchedulerConfig]:
    config = SchedulerConfig(max_model_len=128, **scheduler)  # type: ignore[arg-type]
    cache = CacheConfig(
        num_device_blocks=num_blocks, block_size=BLOCK, num_host_blocks=num_host_blocks
    )
    fake = FakeKVRunner(num_blocks, BLOCK, num_host_blocks, PrefixHashModel())
    runner = runner_factory(fake) if callable(runner_factory) else fake
    return EngineCore(Scheduler(config, cache, SHAPE), runner), fake, config


def prompts(count: int, length: int = 13) -> dict[str, list[int]]:
    return {f"g{i}": [(7 * i + j) % 60 + 1 for j in range(length + i % 5)] for i in range(count)}


def add_all(
    core: EngineCore, config: SchedulerConfig, groups: dict[str, list[int]], n: int = 1
) -> dict[str, list[int]]:
    expected: dict[str, list[int]] = {}
    params = SamplingParams(max_tokens=10, ignore_eos=True, n=n, seed=3)
    for gid, prompt in groups.items():
        group = make_group(gid, prompt, params, arrival_time=time.monotonic())
        core.add_request(group)
        expected.update(expected_for(group, PrefixHashModel(), config))
    return expected


def drive(core: EngineCore, max_steps: int = 5000) -> list[RequestDelta]:
    deltas: list[RequestDelta] = []
    for _ in range(max_steps):
        if not core.has_unfinished():
            return deltas
        deltas.extend(core.step())
        core.scheduler.check_integrity()
    raise AssertionError("engine did not finish")


def tokens_by_request(deltas: list[RequestDelta]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for delta in deltas:
        out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return out


def assert_pool_empty(core: EngineCore) -> None:
    stats = core.stats()
    assert stats.device_blocks.used == 0, stats
    assert stats.host_blocks.used == 0, stats
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0


def test_oom_retries_smaller_batches_and_loses_nothing():
    core, _, config = make_core(
        lambda fake: OOMRunner(fake, max_tokens=5), max_num_batched_tokens=64
    )
    expected = add_all(core, config, prompts(6), n=2)
    deltas = drive(core)
    assert core.executor.num_oom_retries > 0
    assert not [d for d in deltas if d.error]
    assert tokens_by_request(deltas) == expected
    assert_pool_empty(core)


def test_oom_on_a_single_token_fails_only_that_request():
    # Even one token does not fit: the request fails alone; the engine stays usable.
    class Hopeless(OOMRunner):
        def execute(self, out: SchedulerOutput) -> RunnerOutput:
            if any(r.request_id == "g1" for r in out.scheduled):
                self.max_tokens = 0
            try:
                return super().execute(out)
            finally:
                self.max_tokens = 10_000

    core, _, config = make_core(lambda fake: Hopeless(fake, 10_000))
    expected = add_all(core, config, prompts(3))
    deltas = drive(core)
    errors = {d.request_id: d for d in deltas if d.error}
    assert set(errors) == {"g1"}
    assert errors["g1"].error_code == ENGINE_FAULT and "OutOfMemoryError" in errors["g1"].error
    # It was preempted (to retry later, in a smaller batch) before the engine gave up.
    assert "after 2 preemptions" in errors["g1"].error
    assert core.stats().preemptions_total["recompute"] == 2
    outputs = tokens_by_request(deltas)
    assert {rid: outputs[rid] for rid in ("g0", "g2")} == {r: expected[r] for r in ("g0", "g2")}
    assert_pool_empty(core)


def test_a_request_that_ooms_alone_once_is_preempted_and_then_completes_exactly():
    class OnceTooBig(OOMRunner):
        """g2 does not fit on its first try, even alone; later it does."""

        def execute(self, out: SchedulerOutput) -> RunnerOutput:
            import torch

            if self.ooms == 0 and any(r.request_id == "g2" for r in out.scheduled):
                if len(out.scheduled) == 1 and out.num_batched_tokens == 1:
                    self.ooms += 1
                raise torch.OutOfMemoryError("CUDA out of memory")
            return self.inner.execute(out)

    core, _, config = make_core(lambda fake: OnceTooBig(fake, 10_000))
    expected = add_all(core, config, prompts(4))
    deltas = drive(core)
    assert not [d for d in deltas if d.error]
    assert core.stats().preemptions_total["recompute"] == 1
    assert tokens_by_request(deltas) == expected
    assert_pool_empty(core)


def test_a_failing_forward_fails_only_its_batch():
    runner_box: list[FailOnStep] = []

    def factory(fake: FakeKVRunner) -> FailOnStep:
        runner_box.append(FailOnStep(fake, {3}, ValueError("bad kernel launch config")))
        return runner_box[0]

    # max_num_seqs=2: the other requests wait outside the failing batch.
    core, _, config = make_core(factory, max_num_seqs=2)
    expected = add_all(core, config, prompts(6), n=1)
    deltas = drive(core)
    (failed_batch,) = runner_box[0].failed_batches
    errors = {d.request_id for d in deltas if d.error}
    assert errors == set(failed_batch)
    assert all(d.finished and d.error_code == ENGINE_FAULT for d in deltas if d.error)
    survivors = set(expected) - errors
    assert len(survivors) >= 4
    outputs = tokens_by_request(deltas)
    assert {rid: outputs[rid] for rid in survivors} == {rid: expected[rid] for rid in survivors}
    assert_pool_empty(core)


def test_every_choice_of_a_failed_group_gets_a_finishing_delta():
    runner = []

    def factory(fake: FakeKVRunner) -> FailOnStep:
        runner.append(FailOnStep(fake, {2}, ValueError("boom")))
        return runner[0]

    core, _, config = make_core(factory)
    add_all(core, config, {"g0": list(range(1, 10))}, n=3)
    deltas = drive(core)
    finished = {d.index for d in deltas if d.finished}
    assert finished == {0, 1, 2}
    assert all(d.error for d in deltas if d.finished)
    assert_pool_empty(core)


@pytest.mark.parametrize(
    "error",
    [RuntimeError("CUDA error: an illegal memory access was encountered")],
)
def test_device_fatal_errors_raise_engine_fault(error: Exception):
    core, _, config = make_core(lambda fake: FailOnStep(fake, {2}, error))
    add_all(core, config, prompts(2))
    with pytest.raises(EngineFault, match="illegal memory access"):
        drive(core)


def test_consecutive_failed_steps_raise_engine_fault():
    # Every forward fails: each step fails its batch, and the third in a row is fatal.
    core, _, config = make_core(
        lambda fake: FailOnStep(fake, set(range(1, 100)), ValueError("always")), max_num_seqs=2
    )
    add_all(core, config, prompts(8))
    core.step()
    core.step()
    with pytest.raises(EngineFault, match="3 consecutive steps failed"):
        core.step()


def test_failed_swap_outs_fall_back_to_recompute_and_finish_exactly():
    core, _, config = make_core(
        FailOnSwapOut,
        num_blocks=12,
        num_host_blocks=64,
        preemption_mode="swap",
        swap_min_tokens=1,
    )
    expected = add_all(core, config, prompts(6, length=9))
    assert tokens_by_request(drive(core)) == expected
    assert core.executor.num_failed_swap_outs > 0
    assert core.executor.num_failed_swap_outs == core.runner.failures
    assert core.stats().blocks_swapped_in_total == 0  # every swap-out was abandoned
    assert_pool_empty(core)


def test_failure_during_block_moves_is_fatal():
    # A tiny pool with swap preemption: the first swap-in meets the failing move.
    core, _, config = make_core(
        FailOnMoves,
        num_blocks=12,
        num_host_blocks=64,
        preemption_mode="swap",
        swap_min_tokens=1,
    )
    add_all(core, config, prompts(6, length=9))
    with pytest.raises(EngineFault, match="block moves failed"):
        drive(core)


def test_oom_classification():
    import torch

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate: out of memory"))
    assert not is_out_of_memory(ValueError("out of range"))


def test_queue_timeout_fails_only_never_scheduled_requests():
    core, _, config = make_core(None, max_num_seqs=1)
    expected = add_all(core, config, prompts(3))
    first = core.step()  # g0 runs; g1 and g2 wait behind max_num_seqs=1
    assert core.expire_queued(3600.0) == []
    time.sleep(0.02)
    expired = core.expire_queued(0.01)
    assert {d.request_id for d in expired} == {"g1", "g2"}
    assert all(d.error_code == QUEUE_TIMEOUT and d.finished for d in expired)
    deltas = first + drive(core)
    assert tokens_by_request(deltas)["g0"] == expected["g0"]
    assert_pool_empty(core)
