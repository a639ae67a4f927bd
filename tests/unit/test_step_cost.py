"""The step-time bound: measured cost per token (fake costs here) -> prefill budget."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.kv.accounting import KVShape
from engine.outputs import RunnerOutput, SchedulerOutput
from engine.request import SamplingParams
from engine.scheduler import Scheduler
from engine.step_cost import StepCost, StepCostMeter, prefill_token_budget
from tests.unit.fakes import make_group

SHAPE = KVShape(num_layers=1, num_kv_heads=1, head_dim=4, kv_dtype="float32")


def test_decode_steps_measure_decode_cost_and_prefill_gets_the_rest() -> None:
    meter = StepCostMeter(alpha=0.5)
    assert meter.observe(0, 10, 0.100).decode_s_per_token == pytest.approx(0.010)
    assert meter.observe(0, 10, 0.200).decode_s_per_token == pytest.approx(0.015)  # EWMA
    # 10 decodes explain 0.15 s of a 1.15 s step: 1 s for 500 prefill tokens.
    cost = meter.observe(500, 10, 1.150)
    assert cost.prefill_s_per_token == pytest.approx(0.002)
    assert cost.decode_s_per_token == pytest.approx(0.015)
    # A step faster than its decodes explain is no negative cost.
    assert meter.observe(100, 10, 0.0).prefill_s_per_token == pytest.approx(0.001)


def test_prefill_budget_fills_the_target_next_to_the_decodes() -> None:
    cost = StepCost(prefill_s_per_token=0.001, decode_s_per_token=0.01)
    assert prefill_token_budget(cost, 0.4, num_decodes=0, min_tokens=32) == 400
    assert prefill_token_budget(cost, 0.4, num_decodes=20, min_tokens=32) == 200
    # Decodes alone over the target: prefills still advance by the floor.
    assert prefill_token_budget(cost, 0.4, num_decodes=100, min_tokens=32) == 32
    # Not measured yet: no time bound.
    assert prefill_token_budget(StepCost(), 0.4, 5, 32) >= 1 << 20


def _scheduler(max_step_time_s: float) -> Scheduler:
    config = SchedulerConfig(
        max_model_len=1024,
        max_num_batched_tokens=2048,
        max_step_time_s=max_step_time_s,
        min_prefill_tokens=16,
    )
    return Scheduler(config, CacheConfig(num_device_blocks=512, block_size=16), SHAPE)


def _run(sched: Scheduler, out: SchedulerOutput) -> None:
    sampled = {r.request_id: 1 for r in out.scheduled if r.sample}
    sched.update(out, RunnerOutput(sampled_token_ids=sampled))


@pytest.mark.parametrize("target_s", [0.0, 0.1])
def test_a_long_prefill_is_chunked_to_the_step_time_and_decodes_always_run(
    target_s: float,
) -> None:
    sched = _scheduler(target_s)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    for name in ("d1", "d2", "d3"):
        sched.add_request(make_group(name, [1, 2, 3], params))
    _run(sched, sched.schedule())  # the three short prompts: now decoding
    sched.set_step_cost(StepCost(prefill_s_per_token=0.0005, decode_s_per_token=0.01))
    sched.add_request(make_group("long", list(range(1, 900)), params))
    out = sched.schedule()
    tokens = {r.request_id: r.num_new_tokens for r in out.scheduled}
    assert {tokens["d1"], tokens["d2"], tokens["d3"]} == {1}
    if target_s == 0.0:
        assert tokens["long"] == 899  # only the token budget applies
    else:
        # (0.1 s - 3 decodes x 0.01 s) / 0.0005 s per token = 140 tokens.
        assert tokens["long"] == 140
        _run(sched, out)
        out = sched.schedule()
        tokens = {r.request_id: r.num_new_tokens for r in out.scheduled}
        assert tokens == {"d1": 1, "d2": 1, "d3": 1, "long": 140}
