"""Scheduler: batching order, chunked prefill, budgets, rejection, abort, stop rules, stats."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.core import EngineCore
from engine.errors import RequestRejected
from engine.kv.accounting import KVShape, bytes_per_block, payload_bytes
from engine.outputs import RunnerOutput
from engine.request import FinishReason, RequestStatus, SamplingParams
from engine.scheduler import Scheduler
from tests.unit.fakes import ScriptedRunner, drive, make_group

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, kv_dtype="float32")


def make_scheduler(
    blocks: int = 32, block_size: int = 4, host: int = 0, watermark: float = 0.0, **kwargs: object
) -> Scheduler:
    cache = CacheConfig(
        num_device_blocks=blocks, block_size=block_size, num_host_blocks=host, watermark=watermark
    )
    defaults: dict[str, object] = {"max_model_len": 256, "max_num_batched_tokens": 64}
    defaults.update(kwargs)
    return Scheduler(SchedulerConfig(**defaults), cache, SHAPE)  # type: ignore[arg-type]


def params(max_tokens: int = 8, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]


def sample_all(out: object, token: int = 1) -> RunnerOutput:
    scheduled = out.scheduled  # type: ignore[attr-defined]
    return RunnerOutput(sampled_token_ids={r.request_id: token for r in scheduled if r.sample})


def test_running_requests_decode_first_then_waiting_ones_get_the_rest_of_the_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_group("a", [1, 2, 3]))
    sched.add_request(make_group("b", [4, 5, 6]))
    out = sched.schedule()
    assert [(r.request_id, len(r.token_ids), r.sample) for r in out.scheduled] == [
        ("a", 3, True),
        ("b", 3, True),
    ]
    sched.update(out, sample_all(out))
    sched.add_request(make_group("c", list(range(20))))
    out = sched.schedule()
    assert [(r.request_id, len(r.token_ids), r.sample) for r in out.scheduled] == [
        ("a", 1, True),
        ("b", 1, True),
        ("c", 8, False),  # chunked: capped by what is left of the 10-token budget
    ]
    assert out.num_batched_tokens == 10


def test_long_prompt_is_prefilled_in_chunks_and_samples_only_at_the_end() -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_group("a", list(range(10))))
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        (req,) = out.scheduled
        chunks.append((req.num_computed_tokens, req.token_ids, req.sample))
        sched.update(out, sample_all(out))
    assert chunks == [(0, [0, 1, 2, 3], False), (4, [4, 5, 6, 7], False), (8, [8, 9], True)]
    sched.check_integrity()


def test_max_num_seqs_bounds_the_batch() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for gid in "abc":
        sched.add_request(make_group(gid, [1, 2]))
    out = sched.schedule()
    assert [r.request_id for r in out.scheduled] == ["a", "b"]
    assert sched.stats().num_waiting == 1


def test_prompt_at_max_model_len_is_rejected_with_both_numbers() -> None:
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(RequestRejected) as info:
        sched.add_request(make_group("a", list(range(16))))
    assert info.value.reason == "too_long"
    assert "16 tokens" in str(info.value) and "max_model_len is 16" in str(info.value)
    assert not sched.has_unfinished()


def test_prompt_plus_max_tokens_beyond_max_model_len_is_accepted_and_cut_at_length() -> None:
    sched = make_scheduler(max_model_len=8)
    core = EngineCore(sched, ScriptedRunner())
    core.add_request(make_group("a", list(range(6)), params(max_tokens=100)))
    deltas = [d for _ in range(4) for d in core.step()]
    assert [d.finish_reason for d in deltas] == [None, FinishReason.LENGTH]


def test_request_needing_more_blocks_than_exist_is_rejected() -> None:
    sched = make_scheduler(blocks=4, block_size=4)
    with pytest.raises(RequestRejected) as info:
        sched.add_request(make_group("a", list(range(10)), params(max_tokens=10)))
    assert info.value.reason == "no_capacity"
    assert "5 KV blocks" in str(info.value) and "4 are usable" in str(info.value)
    sched.add_request(make_group("b", list(range(10)), params(max_tokens=6)))  # 16 tokens fit


def test_queue_bounds_reject_with_queue_full() -> None:
    sched = make_scheduler(max_queued_requests=1)
    sched.add_request(make_group("a", [1]))
    with pytest.raises(RequestRejected) as info:
        sched.add_request(make_group("b", [1]))
    assert info.value.reason == "queue_full"
    tokens = make_scheduler(max_queued_tokens=10)
    tokens.add_request(make_group("a", list(range(6))))
    with pytest.raises(RequestRejected, match="6 prompt tokens are already queued"):
        tokens.add_request(make_group("b", list(range(6))))


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(RequestRejected) as info:
        make_scheduler().add_request(make_group("a", []))
    assert info.value.reason == "empty_prompt"


def test_duplicate_ids_are_a_caller_error() -> None:
    sched = make_scheduler()
    sched.add_request(make_group("a", [1]))
    with pytest.raises(ValueError, match="already live"):
        sched.add_request(make_group("a", [1]))


def test_abort_frees_blocks_reports_the_ids_and_produces_no_delta() -> None:
    sched = make_scheduler()
    sched.add_request(make_group("a", list(range(10))))
    sched.add_request(make_group("b", [1, 2]))
    out = sched.schedule()
    sched.update(out, sample_all(out))
    assert sched.kv.device.num_used > 0
    sched.abort("a")
    sched.abort("a")  # twice, and unknown ids, are ignored
    sched.abort("nope")
    assert sched.kv.block_table("a") == []
    out = sched.schedule()
    assert out.finished_request_ids == ["a"]
    assert [r.request_id for r in out.scheduled] == ["b"]
    assert all(d.request_id == "b" for d in sched.update(out, sample_all(out)))
    sched.check_integrity()


def test_abort_of_a_group_drops_its_unforked_children() -> None:
    sched = make_scheduler()
    group = make_group("g", list(range(6)), params(n=3, seed=1))
    sched.add_request(group)
    sched.abort("g")
    assert not sched.has_unfinished()
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in group)
    assert sorted(sched.schedule().finished_request_ids) == ["g-0", "g-1", "g-2"]


@pytest.mark.parametrize(
    ("sampling", "script", "expected", "reason"),
    [
        (params(), [5, 0, 7], [5, 0], FinishReason.STOP),  # EOS
        (params(max_tokens=3, ignore_eos=True), [5, 0, 7], [5, 0, 7], FinishReason.LENGTH),
        (params(stop_token_ids=(7,)), [5, 7, 9], [5, 7], FinishReason.STOP),
        (params(min_tokens=2), [0, 0, 0, 4], [0, 0, 0], FinishReason.STOP),
        (params(max_tokens=2), [5, 6, 7], [5, 6], FinishReason.LENGTH),
    ],
)
def test_stop_rules(
    sampling: SamplingParams, script: list[int], expected: list[int], reason: FinishReason
) -> None:
    core = EngineCore(make_scheduler(), ScriptedRunner({"a": script}))
    core.add_request(make_group("a", [1, 2, 3], sampling, eos=(0,)))
    deltas = [d for _ in range(10) for d in core.step()]
    assert [t for d in deltas for t in d.new_token_ids] == expected
    assert deltas[-1].finish_reason is reason
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert not core.has_unfinished()


def test_finishing_delta_carries_the_accounting_fields() -> None:
    sched = make_scheduler()
    core = EngineCore(sched, ScriptedRunner())
    core.add_request(make_group("warm", list(range(9)), params(max_tokens=1)))
    drive(core)
    core.add_request(make_group("a", [*range(9), 42], params(max_tokens=2)))
    deltas = [d for _ in range(3) for d in core.step()]
    first, last = deltas
    assert (first.num_prompt_tokens, first.num_cached_tokens, first.num_output_tokens) == (
        10,
        8,
        1,
    )
    assert last.finished and last.num_output_tokens == 2
    assert last.num_blocks == 3  # 11 computed slots of 12 tokens in 4-token blocks
    assert last.queue_time is not None and last.queue_time >= 0


def test_stats_account_payload_allocation_sharing_and_counters() -> None:
    sched = make_scheduler(block_size=4)
    core = EngineCore(sched, ScriptedRunner())
    core.add_request(make_group("a", list(range(9)), params(max_tokens=20)))
    core.step()
    core.add_request(make_group("b", [*range(8), 77], params(max_tokens=20)))
    core.step()
    stats = core.stats()
    per_block = bytes_per_block(SHAPE, 4)
    # a: 10 computed tokens in 3 blocks; b: hit 8 tokens (2 shared blocks) + 1 computed.
    assert stats.live_tokens == 10 + 9
    assert stats.payload_bytes == payload_bytes(SHAPE, 19)
    assert stats.device_blocks.used == 4
    assert stats.allocated_bytes == 4 * per_block
    assert stats.shared_bytes == 2 * per_block
    assert stats.prefix_cache_queries_total == 18 and stats.prefix_cache_hits_total == 8
    assert stats.prompt_tokens_total == 18 and stats.generation_tokens_total == 3
    assert stats.num_running == 2 and stats.steps_total == 2
    total = stats.device_blocks
    assert total.used + total.free + total.cached == total.total


def test_stats_snapshot_is_immutable_after_later_steps() -> None:
    core = EngineCore(make_scheduler(), ScriptedRunner())
    core.add_request(make_group("a", [1, 2], params(max_tokens=3)))
    before = core.stats()
    drive(core)
    assert before.num_waiting == 1 and before.generation_tokens_total == 0
    assert core.stats().generation_tokens_total == 3
    assert core.stats().device_blocks.used == 0


def test_update_skips_requests_aborted_after_the_step_was_built() -> None:
    sched = make_scheduler()
    sched.add_request(make_group("a", [1, 2, 3]))
    sched.add_request(make_group("b", [4, 5, 6]))
    out = sched.schedule()
    sched.abort("a")  # e.g. its batch failed inside the runner
    deltas = sched.update(out, sample_all(out))
    assert [d.request_id for d in deltas] == ["b"]
    sched.check_integrity()


@pytest.mark.parametrize(
    ("group", "message"),
    [
        ([], "at least one request"),
        (make_group("g", [1, 2], SamplingParams(n=2))[1:], "indices must be 0..n-1"),
    ],
)
def test_malformed_groups_are_caller_errors(group: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_scheduler().add_request(group)


def test_sequences_of_a_group_must_share_the_prompt() -> None:
    group = make_group("g", [1, 2], SamplingParams(n=2))
    group[1].prompt_token_ids = [3]
    with pytest.raises(ValueError, match="share the prompt"):
        make_scheduler().add_request(group)
