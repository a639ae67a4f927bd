"""AsyncEngine threading semantics, against a small scripted core.

The real EngineCore is exercised through HTTP in the other server tests; here a scripted
core makes the thread-level behaviour observable: which thread runs steps, that aborts
land before the next step, that a failing step kills the engine and wakes every stream.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import pytest

from engine.async_engine import AsyncEngine
from engine.compute_thread import ComputeThread
from engine.errors import EngineDeadError, RequestRejected
from engine.outputs import EngineStats, PoolStats, RequestDelta
from engine.request import FinishReason, Request, SamplingParams


@dataclass
class ScriptedCore:
    """Emits token 7 per live request per step until max_tokens; records the calls."""

    fail_on_step: int | None = None
    reject_reason: str | None = None
    live: dict[str, list[Request]] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    step_threads: set[str] = field(default_factory=set)
    steps: int = 0
    step_gate: threading.Event | None = None

    def add_request(self, requests: list[Request]) -> None:
        if self.reject_reason:
            raise RequestRejected(self.reject_reason, f"rejected: {self.reject_reason}")
        self.calls.append(("add", requests[0].group_id))
        self.live[requests[0].group_id] = requests

    def abort(self, group_id: str) -> None:
        self.calls.append(("abort", group_id))
        self.live.pop(group_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def step(self) -> list[RequestDelta]:
        if self.step_gate is not None:
            self.step_gate.wait(5)
        self.steps += 1
        self.step_threads.add(threading.current_thread().name)
        self.calls.append(("step", ""))
        if self.fail_on_step == self.steps:
            raise RuntimeError("boom")
        deltas = []
        for group_id, requests in list(self.live.items()):
            for req in requests:
                if req.is_finished:
                    continue
                req.append_output_token(7)
                done = req.num_output_tokens >= req.sampling_params.max_tokens
                if done:
                    req.status = req.status.FINISHED_LENGTH
                deltas.append(
                    RequestDelta(
                        request_id=req.request_id,
                        group_id=group_id,
                        index=req.index,
                        new_token_ids=[7],
                        finish_reason=FinishReason.LENGTH if done else None,
                        num_output_tokens=req.num_output_tokens,
                    )
                )
            if all(r.is_finished for r in requests):
                del self.live[group_id]
        return deltas

    def stats(self) -> EngineStats:
        pool = PoolStats(total=1, used=0, free=1, cached=0)
        return EngineStats(pool, pool, 16, len(self.live), 0, 0, 0, 0, 0, 0)


def group(group_id: str, n: int = 1, max_tokens: int = 3) -> list[Request]:
    params = SamplingParams(max_tokens=max_tokens, n=n)
    return [
        Request(f"{group_id}-{i}", [1, 2, 3], params, group_id=group_id, index=i) for i in range(n)
    ]


async def run_with(core: ScriptedCore, body, compute: ComputeThread | None = None):  # type: ignore[no-untyped-def]
    engine = AsyncEngine(core, compute=compute)
    await engine.start()
    try:
        return await asyncio.wait_for(body(engine), timeout=10)
    finally:
        engine.request_shutdown()
        await asyncio.to_thread(engine.join)


def test_generate_streams_every_choice_until_finished():
    core = ScriptedCore()

    async def body(engine: AsyncEngine) -> list[RequestDelta]:
        return [d async for d in engine.generate(group("g", n=3, max_tokens=4))]

    deltas = asyncio.run(run_with(core, body))
    assert len(deltas) == 12
    assert sorted(d.index for d in deltas if d.finished) == [0, 1, 2]
    # Steps ran on the engine thread, never on the event loop's thread.
    assert core.step_threads == {"kvserve-engine"}


def test_steps_run_on_the_compute_thread_it_is_given():
    """The server builds the engine on a ComputeThread and steps it there (one OpenMP
    pool); the loop shares the thread with whatever ran before it."""
    core = ScriptedCore()
    compute = ComputeThread("kvserve-built-here")
    builder_thread = compute.call(lambda: threading.current_thread().name)

    async def body(engine: AsyncEngine) -> int:
        return len([d async for d in engine.generate(group("g", n=2, max_tokens=3))])

    assert asyncio.run(run_with(core, body, compute)) == 6
    assert core.step_threads == {builder_thread} == {"kvserve-built-here"}
    assert compute.call(lambda: "still serving") == "still serving"
    compute.close()


def test_rejection_reaches_the_caller_and_leaves_nothing_behind():
    core = ScriptedCore(reject_reason="queue_full")

    async def body(engine: AsyncEngine) -> None:
        with pytest.raises(RequestRejected) as info:
            await engine.add(group("g"))
        assert info.value.reason == "queue_full"
        assert engine.num_open_streams == 0

    asyncio.run(run_with(core, body))


def test_closing_a_stream_aborts_before_the_next_step():
    core = ScriptedCore()

    async def body(engine: AsyncEngine) -> tuple[int, int]:
        stream = await engine.add(group("g", max_tokens=10**6))
        async for _ in stream:
            break
        steps_at_close = core.steps
        stream.close()
        while ("abort", "g") not in core.calls:
            await asyncio.sleep(0.01)
        steps_before_abort = core.calls[: core.calls.index(("abort", "g"))].count(("step", ""))
        return steps_at_close, steps_before_abort

    steps_at_close, steps_before_abort = asyncio.run(run_with(core, body))
    # Only the step already running when the stream closed may complete before the abort.
    assert steps_before_abort <= steps_at_close + 1
    assert "g" not in core.live


def test_a_failing_step_kills_the_engine_and_wakes_streams():
    core = ScriptedCore(fail_on_step=2)

    async def body(engine: AsyncEngine) -> None:
        stream = await engine.add(group("g", max_tokens=10))
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert not engine.is_alive
        assert "RuntimeError: boom" in (engine.dead_reason or "")
        with pytest.raises(EngineDeadError):
            await engine.add(group("h"))

    asyncio.run(run_with(core, body))


def test_idle_engine_does_not_step():
    core = ScriptedCore()

    async def body(engine: AsyncEngine) -> int:
        await asyncio.sleep(0.2)
        return core.steps

    assert asyncio.run(run_with(core, body)) == 0


def test_shutdown_aborts_open_streams():
    core = ScriptedCore()

    async def body(engine: AsyncEngine) -> None:
        await engine.add(group("g", max_tokens=10**6))
        engine.request_shutdown()
        await asyncio.to_thread(engine.join)
        assert not engine.is_alive
        assert ("abort", "g") in core.calls

    asyncio.run(run_with(core, body))


def test_probe_runs_on_the_engine_thread_between_steps_and_wakes_an_idle_engine():
    core = ScriptedCore()

    def look(seen: ScriptedCore) -> tuple[str, int, list[str]]:
        return threading.current_thread().name, seen.steps, list(seen.live)

    async def body(engine: AsyncEngine) -> None:
        idle = await engine.probe(look)  # nothing to step: the probe still answers
        assert idle == ("kvserve-engine", 0, [])
        stream = await engine.add(group("g", max_tokens=10**6))
        async for _ in stream:
            break
        busy = await engine.probe(look)
        assert busy[0] == "kvserve-engine" and busy[1] >= 1 and busy[2] == ["g"]
        stream.close()

    asyncio.run(run_with(core, body))


def test_probe_errors_reach_the_caller_and_a_dead_engine_refuses_probes():
    core = ScriptedCore(fail_on_step=2)

    def broken(_: ScriptedCore) -> None:
        raise ValueError("observer bug")

    async def body(engine: AsyncEngine) -> None:
        with pytest.raises(ValueError, match="observer bug"):
            await engine.probe(broken)
        assert engine.is_alive  # an observer's bug does not kill the engine
        stream = await engine.add(group("g", max_tokens=10))
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            engine.probe(lambda c: c.steps)

    asyncio.run(run_with(core, body))
