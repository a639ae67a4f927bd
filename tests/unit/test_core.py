"""EngineCore: one step = schedule -> execute -> update; snapshot published after each."""

from __future__ import annotations

from engine.config import CacheConfig, SchedulerConfig
from engine.core import EngineCore, Runner
from engine.kv.accounting import KVShape
from engine.request import FinishReason, SamplingParams
from engine.scheduler import Scheduler
from tests.unit.fakes import FakeKVRunner, ScriptedRunner, make_group

SHAPE = KVShape(num_layers=1, num_kv_heads=1, head_dim=4, kv_dtype="float32")


def make_core(runner: Runner | None = None) -> EngineCore:
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(num_device_blocks=16, block_size=4), SHAPE)
    return EngineCore(scheduler, runner or ScriptedRunner())


def test_step_runs_the_runner_and_returns_deltas() -> None:
    runner = ScriptedRunner({"a": [5, 6]})
    core = make_core(runner)
    core.add_request(make_group("a", [1, 2, 3], SamplingParams(max_tokens=2)))
    first = core.step()
    assert [(d.request_id, d.new_token_ids, d.finish_reason) for d in first] == [("a", [5], None)]
    second = core.step()
    assert second[0].new_token_ids == [6] and second[0].finish_reason is FinishReason.LENGTH
    assert len(runner.steps) == 2 and not core.has_unfinished()


def test_idle_step_does_not_call_the_runner() -> None:
    runner = ScriptedRunner()
    core = make_core(runner)
    assert core.step() == []
    assert runner.steps == []


def test_finished_ids_reach_the_runner_even_when_nothing_is_scheduled() -> None:
    runner = ScriptedRunner()
    core = make_core(runner)
    core.add_request(make_group("a", [1, 2, 3]))
    core.step()
    core.abort("a")
    assert core.step() == []
    assert runner.steps[-1].finished_request_ids == ["a"]
    assert runner.steps[-1].scheduled == []


def test_stats_are_published_after_add_abort_and_step() -> None:
    core = make_core(FakeKVRunner(16, 4))
    assert core.stats().num_waiting == 0
    core.add_request(make_group("a", list(range(9))))
    assert core.stats().num_waiting == 1
    core.step()
    assert core.stats().num_running == 1 and core.stats().device_blocks.used == 3
    core.abort("a")
    assert core.stats().num_running == 0 and core.stats().device_blocks.used == 0
    assert core.stats().device_blocks.cached == 2  # the full prompt blocks stay cached
