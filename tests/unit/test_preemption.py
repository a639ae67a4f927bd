"""Admission policies, preemption (victim choice, recompute, swap, auto) and n > 1 forks."""

from __future__ import annotations

from engine.config import CacheConfig, SchedulerConfig
from engine.core import EngineCore
from engine.kv.accounting import KVShape
from engine.outputs import RunnerOutput, SchedulerOutput
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler
from tests.unit.fakes import FakeKVRunner, ScriptedRunner, drive, make_group

SHAPE = KVShape(num_layers=1, num_kv_heads=1, head_dim=4, kv_dtype="float32")


def make_scheduler(
    blocks: int, block_size: int = 4, host: int = 0, watermark: float = 0.0, **kwargs: object
) -> Scheduler:
    cache = CacheConfig(
        num_device_blocks=blocks, block_size=block_size, num_host_blocks=host, watermark=watermark
    )
    defaults: dict[str, object] = {
        "max_model_len": 256,
        "max_num_batched_tokens": 64,
        "scheduling_policy": "priority",
    }
    defaults.update(kwargs)
    return Scheduler(SchedulerConfig(**defaults), cache, SHAPE)  # type: ignore[arg-type]


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    result = RunnerOutput(sampled_token_ids={r.request_id: 1 for r in out.scheduled if r.sample})
    sched.update(out, result)
    sched.check_integrity()
    return out


def fill_two_requests(sched: Scheduler, priority_b: int = 0) -> tuple[Request, Request]:
    """a and b each take 2 of 4 blocks (8 tokens) and need a third to decode."""
    (a,) = make_group("a", list(range(8)), SamplingParams(max_tokens=8), arrival_time=1.0)
    (b,) = make_group(
        "b",
        list(range(100, 108)),
        SamplingParams(max_tokens=8),
        arrival_time=2.0,
        priority=priority_b,
    )
    sched.add_request([a])
    sched.add_request([b])
    step(sched)
    assert sched.kv.device.num_free == 0
    return a, b


def test_recompute_preempts_the_latest_arrival_and_puts_it_first_in_line() -> None:
    sched = make_scheduler(blocks=4, preemption_mode="recompute")
    _a, b = fill_two_requests(sched)
    sched.add_request(make_group("c", [5, 6], arrival_time=3.0))
    out = step(sched)
    assert out.num_preempted == 1
    assert [r.request_id for r in out.scheduled] == ["a"]  # no admission in this step
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert b.num_preemptions == 1
    assert sched.stats().preemptions_total == {"recompute": 1, "swap": 0}


def test_victim_is_the_lowest_priority_even_if_it_arrived_first() -> None:
    sched = make_scheduler(blocks=4, preemption_mode="recompute")
    a, _b = fill_two_requests(sched, priority_b=-1)  # b is more important
    out = step(sched)
    assert a.status is RequestStatus.WAITING
    assert [r.request_id for r in out.scheduled] == ["b"]


def test_swap_moves_the_victim_to_host_and_it_returns_before_waiting_requests() -> None:
    sched = make_scheduler(blocks=4, host=4, preemption_mode="swap")
    _a, b = fill_two_requests(sched)
    sched.add_request(make_group("c", [5, 6], arrival_time=3.0))
    out = step(sched)
    assert b.status is RequestStatus.SWAPPED
    assert len(out.swap_out) == 2 and b.num_computed_tokens == 8
    sched.abort("a")  # make room
    out = step(sched)
    assert len(out.swap_in) == 2
    assert [r.request_id for r in out.scheduled] == ["b", "c"]
    assert out.scheduled[0].num_computed_tokens == 8  # continues where it was
    stats = sched.stats()
    assert stats.blocks_swapped_out_total == 2 and stats.blocks_swapped_in_total == 2


def test_swap_falls_back_to_recompute_without_host_room() -> None:
    sched = make_scheduler(blocks=4, host=1, preemption_mode="swap")
    _, b = fill_two_requests(sched)
    step(sched)
    assert b.status is RequestStatus.WAITING
    assert sched.stats().preemptions_total == {"recompute": 1, "swap": 0}


def test_auto_swaps_only_victims_above_the_token_threshold() -> None:
    short = make_scheduler(blocks=4, host=8, preemption_mode="auto", swap_min_tokens=64)
    _, b = fill_two_requests(short)
    step(short)
    assert b.status is RequestStatus.WAITING
    long = make_scheduler(blocks=4, host=8, preemption_mode="auto", swap_min_tokens=8)
    _, b = fill_two_requests(long)
    step(long)
    assert b.status is RequestStatus.SWAPPED


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_victim() -> None:
    sched = make_scheduler(blocks=4, preemption_mode="recompute")
    a, _b = fill_two_requests(sched)
    a.priority = 5  # a is now the least important: preempted first; b decodes
    out = step(sched)
    assert a.status is RequestStatus.WAITING
    assert [r.request_id for r in out.scheduled] == ["b"]


def test_watermark_holds_back_admission() -> None:
    sched = make_scheduler(blocks=12, watermark=0.2)  # 2 blocks held back
    sched.add_request(make_group("a", list(range(24)), SamplingParams(max_tokens=12)))
    sched.add_request(make_group("b", list(range(100, 120)), SamplingParams(max_tokens=1)))
    for _ in range(8):  # b's 5 blocks would leave fewer than 2 free
        out = step(sched)
        assert [r.request_id for r in out.scheduled] == ["a"]
    assert sched.kv.device.num_free == 4
    sched.abort("a")
    assert [r.request_id for r in step(sched).scheduled] == ["b"]


def test_optimistic_admits_what_reserve_holds_back_and_reserve_never_preempts() -> None:
    def run(policy: str) -> tuple[int, int]:
        sched = make_scheduler(blocks=8, admission_policy=policy, preemption_mode="recompute")
        for gid in "abcd":
            sched.add_request(make_group(gid, list(range(4)), SamplingParams(max_tokens=12)))
        first = len(sched.schedule().scheduled)
        core = EngineCore(sched, ScriptedRunner())
        drive(core)
        return first, sum(sched.stats().preemptions_total.values())

    optimistic_admitted, optimistic_preemptions = run("optimistic")
    reserve_admitted, reserve_preemptions = run("reserve")
    assert optimistic_admitted == 4 and optimistic_preemptions > 0
    assert reserve_admitted == 2 and reserve_preemptions == 0  # 4 blocks each, 8 in all


def test_n_greater_than_one_forks_after_the_prompt_and_copies_on_write() -> None:
    sched = make_scheduler(blocks=16)
    group = make_group("g", list(range(6)), SamplingParams(max_tokens=3, n=3, seed=7))
    sched.add_request(group)
    out = step(sched)
    assert [r.request_id for r in out.scheduled] == ["g-0"]
    assert sched.kv.device.ref_count(sched.kv.block_table("g-0")[0]) == 3
    out = sched.schedule()
    ids = [(r.request_id, r.num_computed_tokens, r.seed) for r in out.scheduled]
    assert ids == [("g-0", 6, 7), ("g-1", 5, 8), ("g-2", 5, 9)]
    assert len(out.copies) == 2  # two children copy; the parent writes in place
    assert sched.stats().prompt_tokens_total == 6


def test_n_greater_than_one_yields_distinct_correct_tokens_per_choice() -> None:
    sched = make_scheduler(blocks=16)
    runner = FakeKVRunner(16, 4)
    core = EngineCore(sched, runner)
    group = make_group("g", list(range(6)), SamplingParams(max_tokens=4, n=3, seed=7), eos=())
    core.add_request(group)
    outputs = drive(core)
    assert sorted(outputs) == ["g-0", "g-1", "g-2"]
    assert len({tuple(tokens) for tokens in outputs.values()}) == 3
    assert sched.kv.device.num_used == 0


def test_reserve_never_preempts_forked_groups_even_with_a_tiny_token_budget() -> None:
    sched = make_scheduler(
        blocks=12,
        admission_policy="reserve",
        preemption_mode="recompute",
        max_num_batched_tokens=2,
    )
    core = EngineCore(sched, FakeKVRunner(12, 4))
    for gid in "abc":
        core.add_request(make_group(gid, list(range(6)), SamplingParams(max_tokens=5, n=2, seed=1)))
    outputs = drive(core)
    assert len(outputs) == 6
    assert sum(sched.stats().preemptions_total.values()) == 0


def test_a_victim_already_scheduled_in_this_step_is_taken_back_out() -> None:
    sched = make_scheduler(blocks=4, preemption_mode="recompute")
    (low,) = make_group("low", list(range(6)), priority=1, arrival_time=1.0)
    (high,) = make_group("high", list(range(100, 108)), priority=0, arrival_time=2.0)
    sched.add_request([low])
    sched.add_request([high])
    step(sched)
    # low decodes in place (scheduled first); high needs a fifth block: low must go.
    out = step(sched)
    assert [r.request_id for r in out.scheduled] == ["high"]
    assert out.num_batched_tokens == 1
    assert low.status is RequestStatus.WAITING and low.num_computed_tokens == 0


def test_a_recomputed_victim_queues_behind_more_important_waiting_requests() -> None:
    sched = make_scheduler(blocks=4, preemption_mode="recompute")
    fill_two_requests(sched)
    (urgent,) = make_group("urgent", [1, 2], priority=-1, arrival_time=9.0)
    (later,) = make_group("later", [3, 4], priority=0, arrival_time=9.0)
    sched.add_request([later])
    sched.add_request([urgent])
    step(sched)  # b is preempted
    assert [r.request_id for r in sched.waiting] == ["urgent", "b", "later"]


def test_aborting_a_swapped_request_frees_its_host_blocks() -> None:
    sched = make_scheduler(blocks=4, host=4, preemption_mode="swap")
    _, b = fill_two_requests(sched)
    step(sched)
    assert b.status is RequestStatus.SWAPPED and sched.kv.host.num_used == 2
    sched.abort("b")
    assert sched.kv.host.num_used == 0 and not sched.swapped
    sched.check_integrity()
