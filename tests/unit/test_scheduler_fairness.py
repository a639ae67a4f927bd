"""Fairness of swap-ins and admissions: one queue order, no request starved.

Property (checked after every ``schedule()`` that preempted nothing, before the step's
results free anything): the first request in queue order (priority, then arrival) among
the waiting and swapped ones is never left queued while the blocks, token budget and
sequence slot it needs are free; no request is passed over (a request behind it in queue
order admitted while it waits) more than ``max_num_bypasses`` times; and every request
finishes with the tokens plain generation gives. Together: no request waits forever while
the blocks it needs are free.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, SchedulerConfig
from engine.errors import RequestRejected
from engine.kv.accounting import KVShape, blocks_for_tokens
from engine.outputs import SchedulerOutput
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler
from tests.unit.fakes import FakeKVRunner, PrefixHashModel, expected_for, make_group

SHAPE = KVShape(num_layers=1, num_kv_heads=1, head_dim=4, kv_dtype="float32")
MAX_MODEL_LEN = 48
MAX_STEPS = 5_000


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt_len: int
    max_tokens: int
    priority: int


arrivals = st.lists(
    st.builds(
        Arrival,
        step=st.integers(0, 30),
        prompt_len=st.integers(1, 30),
        max_tokens=st.integers(1, 12),
        priority=st.integers(-3, 3),
    ),
    min_size=1,
    max_size=14,
)


def queue_key(sched: Scheduler, request: Request) -> tuple[int, float]:
    priority = request.priority if sched.config.scheduling_policy == "priority" else 0
    return (priority, request.arrival_time)


def head_could_run(
    sched: Scheduler, head: Request, out: SchedulerOutput, decodes_at_start: int
) -> bool:
    """Whether ``head`` fits what is left of the step: sequence slot, token budgets and
    blocks (optimistic admission, no prefix cache)."""
    config, cache = sched.config, sched.cache_config
    scheduled = [r.num_new_tokens for r in out.scheduled]
    budget_left = config.max_num_batched_tokens - sum(scheduled)
    prefill_left = config.max_num_batched_tokens - decodes_at_start
    prefill_left -= sum(n for n in scheduled if n > 1)
    remaining = head.num_tokens - head.num_computed_tokens
    num_new = (
        min(remaining, budget_left) if remaining <= 1 else min(remaining, budget_left, prefill_left)
    )
    if num_new <= 0:
        return False
    free = sched.kv.device.num_free - cache.watermark_blocks
    if head.status is RequestStatus.SWAPPED:
        if len(sched.running) >= config.max_num_seqs:
            return False
        held = len(sched.kv.host_tables[head.request_id][0])
        total = head.num_computed_tokens + num_new
        return max(held, blocks_for_tokens(total, cache.block_size)) <= free
    if sched.running and len(sched.running) + 1 > config.max_num_seqs:
        return False
    return blocks_for_tokens(head.num_tokens, cache.block_size) <= free


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=arrivals,
    blocks=st.integers(6, 24),
    block_size=st.sampled_from([1, 2, 4]),
    mode=st.sampled_from(["swap", "recompute", "auto"]),
    policy=st.sampled_from(["fcfs", "priority"]),
    budget=st.integers(2, 40),
    max_seqs=st.integers(1, 6),
    max_bypasses=st.integers(0, 4),
    watermark=st.sampled_from([0.0, 0.1]),
)
def test_no_request_waits_while_the_blocks_it_needs_are_free(
    plan: list[Arrival],
    blocks: int,
    block_size: int,
    mode: str,
    policy: str,
    budget: int,
    max_seqs: int,
    max_bypasses: int,
    watermark: float,
) -> None:
    config = SchedulerConfig(
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        preemption_mode=mode,  # type: ignore[arg-type]
        swap_min_tokens=4,
        scheduling_policy=policy,  # type: ignore[arg-type]
        max_num_bypasses=max_bypasses,
    )
    cache = CacheConfig(
        num_device_blocks=blocks,
        block_size=block_size,
        num_host_blocks=16,
        enable_prefix_caching=False,
        watermark=watermark,
    )
    sched = Scheduler(config, cache, SHAPE)
    model = PrefixHashModel(vocab_size=32)
    runner = FakeKVRunner(blocks, block_size, 16, model)
    expected: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    bypassed: dict[str, int] = {}
    pending = sorted(enumerate(plan), key=lambda item: item[1].step)
    for step_index in range(MAX_STEPS):
        while pending and pending[0][1].step <= step_index:
            number, arrival = pending.pop(0)
            prompt = [(number * 7 + i) % 31 + 1 for i in range(arrival.prompt_len)]
            params = SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True)
            group = make_group(
                f"r{number}", prompt, params, priority=arrival.priority,
                arrival_time=step_index + number / 100,
            )  # fmt: skip
            try:
                sched.add_request(group)
            except RequestRejected:
                continue
            expected.update(expected_for(group, model, config))
        if not sched.has_unfinished() and not pending:
            break
        queued_before = list(sched.waiting) + list(sched.swapped)
        decodes_at_start = sum(
            1 for r in sched.running if r.num_tokens - r.num_computed_tokens <= 1
        )
        out = sched.schedule()
        if out.num_preempted == 0:
            queued = sorted(
                list(sched.waiting) + list(sched.swapped), key=lambda r: queue_key(sched, r)
            )
            if queued:
                head = queued[0]
                assert not head_could_run(sched, head, out, decodes_at_start), (
                    f"{head.request_id} ({head.status.value}) left waiting at step "
                    f"{step_index} with {sched.kv.device.num_free} free blocks"
                )
            admitted = [r for r in queued_before if r.status is RequestStatus.RUNNING]
            for request in queued:
                key = queue_key(sched, request)
                behind = sum(1 for a in admitted if queue_key(sched, a) > key)
                bypassed[request.request_id] = bypassed.get(request.request_id, 0) + behind
                assert bypassed[request.request_id] <= max_bypasses, (
                    f"{request.request_id} passed over {bypassed[request.request_id]} times"
                )
            for request in admitted:
                bypassed.pop(request.request_id, None)
        for delta in sched.update(out, runner.execute(out)):
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        sched.check_integrity()
    assert not sched.has_unfinished() and not pending, "a request never finished (starved?)"
    assert outputs == expected


def test_a_swapped_request_does_not_block_a_more_important_one_that_fits() -> None:
    """The issue's case: a priority 5 request swapped out needs 8 blocks, 7 of 16 are
    free; a priority -10 request needing 1 block must be admitted at once, not wait for
    the swapped one."""
    config = SchedulerConfig(
        max_model_len=40, max_num_batched_tokens=64, preemption_mode="swap",
        swap_min_tokens=1, scheduling_policy="priority",
    )  # fmt: skip
    cache = CacheConfig(num_device_blocks=16, block_size=4, num_host_blocks=16, watermark=0.0)
    sched = Scheduler(config, cache, SHAPE)
    runner = FakeKVRunner(16, 4, 16)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    (low,) = make_group("low", list(range(1, 30)), params, priority=5, arrival_time=0.0)
    (mid,) = make_group("mid", list(range(1, 33)), params, priority=0, arrival_time=1.0)
    sched.add_request([low])
    sched.add_request([mid])
    swapped_at = None
    for step_index in range(40):
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        if low.status is RequestStatus.SWAPPED:
            swapped_at = step_index
            break
    assert swapped_at is not None, "the low-priority request was meant to be swapped out"
    # Free blocks for the urgent one, not for the swapped one.
    need_low = len(sched.kv.host_tables["low"][0])
    assert sched.kv.device.num_free < need_low
    (urgent,) = make_group("urgent", [5, 6, 7], params, priority=-10, arrival_time=2.0)
    sched.add_request([urgent])
    out = sched.schedule()
    assert "urgent" in {r.request_id for r in out.scheduled}
    assert low.status is RequestStatus.SWAPPED
