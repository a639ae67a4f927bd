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


def test_the_fit_separates_the_fixed_part_from_the_per_token_costs() -> None:
    # Steps of a made-up machine: 10 ms fixed, 1 ms a decode, 0.25 ms a prefill token.
    meter = StepCostMeter()
    for decodes, prefill in [(32, 0), (1, 0), (8, 500), (0, 2048), (16, 0), (4, 100)] * 3:
        cost = meter.observe(prefill, decodes, 0.010 + decodes * 0.001 + prefill * 0.00025)
    # (within 5%: the ridge that keeps an unvaried fit defined biases it slightly)
    assert cost.fixed_s == pytest.approx(0.010, rel=0.05)
    assert cost.decode_s_per_token == pytest.approx(0.001, rel=0.05)
    assert cost.prefill_s_per_token == pytest.approx(0.00025, rel=0.05)
    # Seconds per decode token alone (the old estimate) would call a one-row step 33 ms / 32
    # = 1 ms; the fit says 11 ms.
    assert cost.decode_seconds(1) == pytest.approx(0.011, rel=0.05)


def test_the_fit_forgets_old_steps_and_never_goes_negative() -> None:
    meter = StepCostMeter()
    steps = [(32, 0), (8, 500), (1, 0), (4, 100), (0, 2048)]
    for decodes, prefill in steps * 4:
        meter.observe(prefill, decodes, 0.010 + decodes * 0.001 + prefill * 0.001)
    for decodes, prefill in steps * 40:  # the machine got 4x faster at prefill
        cost = meter.observe(prefill, decodes, 0.010 + decodes * 0.001 + prefill * 0.00025)
    assert cost.prefill_s_per_token == pytest.approx(0.00025, rel=0.05)
    # Steps faster than any positive model explains: coefficients pinned at zero.
    for _ in range(50):
        cost = meter.observe(100, 10, 0.0)
    assert min(cost.fixed_s, cost.decode_s_per_token, cost.prefill_s_per_token) >= 0.0


def test_decode_only_steps_leave_the_prefill_cost_unmeasured() -> None:
    meter = StepCostMeter()
    for _ in range(5):
        cost = meter.observe(0, 32, 0.033)
    assert cost.prefill_s_per_token == 0.0  # no time bound until a prefill is timed
    assert cost.decode_seconds(32) == pytest.approx(0.033, rel=0.01)


def test_prefill_budget_fills_the_target_next_to_the_decodes() -> None:
    cost = StepCost(prefill_s_per_token=0.001, decode_s_per_token=0.01)
    assert prefill_token_budget(cost, 0.4, num_decodes=0, min_tokens=32) == 400
    assert prefill_token_budget(cost, 0.4, num_decodes=20, min_tokens=32) == 200
    # Decodes alone over the target: prefills still advance by the floor.
    assert prefill_token_budget(cost, 0.4, num_decodes=100, min_tokens=32) == 32
    # Not measured yet: no time bound.
    assert prefill_token_budget(StepCost(), 0.4, 5, 32) >= 1 << 20
    # The fixed part is paid once per step.
    with_fixed = StepCost(prefill_s_per_token=0.001, decode_s_per_token=0.01, fixed_s=0.1)
    assert prefill_token_budget(with_fixed, 0.4, num_decodes=20, min_tokens=32) == 100


def test_the_ratio_bounds_a_step_to_a_multiple_of_its_decodes() -> None:
    # A fast machine: 32 decodes take 10 + 32 x 0.7 = 32.4 ms.
    cost = StepCost(prefill_s_per_token=0.00025, decode_s_per_token=0.0007, fixed_s=0.010)
    decode_s = cost.decode_seconds(32)
    budget = prefill_token_budget(cost, 0.8, num_decodes=32, min_tokens=32, ratio=4.0)
    assert budget == int(3 * decode_s / 0.00025)  # the step: 4x its decodes, not 800 ms
    assert (decode_s + budget * 0.00025) == pytest.approx(4 * decode_s, rel=0.01)
    # A slow machine: the absolute bound is the tighter one.
    slow = StepCost(prefill_s_per_token=0.0027, decode_s_per_token=0.007, fixed_s=0.03)
    assert prefill_token_budget(slow, 0.8, 32, 32, ratio=4.0) == prefill_token_budget(
        slow, 0.8, 32, 32
    )
    # Nothing decoding: no inter-token gap to protect, the absolute bound alone.
    assert prefill_token_budget(cost, 0.8, 0, 32, ratio=4.0) == int(0.79 / 0.00025)


def _scheduler(max_step_time_s: float, ratio: float = 0.0, max_model_len: int = 1024) -> Scheduler:
    config = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_batched_tokens=2048,
        max_step_time_s=max_step_time_s,
        max_step_time_ratio=ratio,
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


def test_a_step_without_decodes_takes_the_whole_token_budget() -> None:
    """Nothing decodes: the time bound protects no stream, so prompts are chunked by the
    token budget alone; once one of them decodes, the bound is back for the next chunk."""
    sched = _scheduler(0.1, max_model_len=4096)
    sched.set_step_cost(StepCost(prefill_s_per_token=0.0005, decode_s_per_token=0.01))
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    sched.add_request(make_group("long", list(range(1, 3000)), params))
    sched.add_request(make_group("short", [1, 2, 3], params))
    out = sched.schedule()
    assert {r.request_id: r.num_new_tokens for r in out.scheduled} == {"long": 2048}
    _run(sched, out)
    out = sched.schedule()  # the rest of "long", and "short" in what is left
    assert {r.request_id: r.num_new_tokens for r in out.scheduled} == {"long": 951, "short": 3}
    _run(sched, out)
    sched.add_request(make_group("next", list(range(5000, 5899)), params))
    tokens = {r.request_id: r.num_new_tokens for r in sched.schedule().scheduled}
    # Two decodes now: (0.1 s - 2 x 0.01 s) / 0.0005 s per token = 160 prefill tokens.
    assert tokens == {"long": 1, "short": 1, "next": 160}


def test_the_scheduler_holds_a_mixed_step_to_the_ratio_of_its_decodes() -> None:
    sched = _scheduler(0.8, ratio=4.0)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    for name in ("d1", "d2", "d3"):
        sched.add_request(make_group(name, [1, 2, 3], params))
    _run(sched, sched.schedule())
    # 3 decodes: 10 ms + 3 x 2 ms = 16 ms; 4x that is 64 ms, 48 ms of it for prefill.
    cost = StepCost(prefill_s_per_token=0.0005, decode_s_per_token=0.002, fixed_s=0.010)
    sched.set_step_cost(cost)
    sched.add_request(make_group("long", list(range(1, 900)), params))
    tokens = {r.request_id: r.num_new_tokens for r in sched.schedule().scheduled}
    assert tokens == {"d1": 1, "d2": 1, "d3": 1, "long": 96}


def test_the_ratio_needs_the_time_bound_on() -> None:
    with pytest.raises(ValueError, match="max_step_time_ratio"):
        SchedulerConfig(max_model_len=64, max_step_time_ratio=0.5)
    sched = _scheduler(0.0, ratio=4.0)  # --max-step-time-ms 0: token budget only
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    sched.add_request(make_group("d1", [1, 2, 3], params))
    _run(sched, sched.schedule())
    sched.set_step_cost(StepCost(prefill_s_per_token=0.0005, decode_s_per_token=0.002))
    sched.add_request(make_group("long", list(range(1, 900)), params))
    tokens = {r.request_id: r.num_new_tokens for r in sched.schedule().scheduled}
    assert tokens["long"] == 899
