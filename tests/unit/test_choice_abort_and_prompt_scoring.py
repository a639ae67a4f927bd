"""Scheduler and core: one choice of ``n`` aborted alone (issue 13), prompt logprobs
stitched from prefill chunks, and prefill-only (max_tokens 0) requests."""

from __future__ import annotations

from engine.config import CacheConfig, SchedulerConfig
from engine.core import EngineCore
from engine.kv.accounting import KVShape
from engine.outputs import PromptLogprobChunk, RunnerOutput, SchedulerOutput, TokenLogprob
from engine.request import FinishReason, RequestStatus, SamplingParams
from engine.scheduler import Scheduler
from tests.unit.fakes import ScriptedRunner, make_group

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, kv_dtype="float32")


def make_scheduler(batched_tokens: int = 64) -> Scheduler:
    cache = CacheConfig(num_device_blocks=32, block_size=4, num_host_blocks=0)
    config = SchedulerConfig(max_model_len=256, max_num_batched_tokens=batched_tokens)
    return Scheduler(config, cache, SHAPE)


class ScoringRunner(ScriptedRunner):
    """Samples token 1 and scores prompt position p with logprob -p (rank p), as the
    real runner's prompt_logprobs would, for the positions each step covers."""

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        result = super().execute(scheduler_output)
        for req in scheduler_output.scheduled:
            start = req.num_computed_tokens
            end = min(start + req.num_new_tokens, len(req.prompt_token_ids) - 1)
            if req.sampling_params.prompt_logprobs is None or end <= start:
                continue
            entries = tuple(
                TokenLogprob(req.prompt_token_ids[p], -float(p), rank=p)
                for p in range(start + 1, end + 1)
            )
            result.prompt_logprobs[req.request_id] = [PromptLogprobChunk(start + 1, entries)]
        return result


def test_one_choice_aborted_frees_its_blocks_and_the_siblings_go_on() -> None:
    runner = ScriptedRunner()
    core = EngineCore(make_scheduler(), runner)
    group = make_group("g", [1, 2, 3, 4, 5], SamplingParams(max_tokens=12, n=3, ignore_eos=True))
    core.add_request(group)
    for _ in range(4):
        core.step()
    held = core.scheduler.kv.num_blocks("g-1")
    used = core.stats().device_blocks.used
    assert held > 0
    core.abort_sequence("g-1")
    assert group[1].status is RequestStatus.FINISHED_ABORTED
    assert core.stats().device_blocks.used < used  # freed before the next step
    core.scheduler.check_integrity()
    aborted_at = len(runner.steps)
    deltas = [d for _ in range(20) for d in core.step()]
    assert all(d.request_id != "g-1" for d in deltas)
    finished = {d.request_id: d.finish_reason for d in deltas if d.finished}
    assert finished == {"g-0": FinishReason.LENGTH, "g-2": FinishReason.LENGTH}
    assert [len(r.output_token_ids) for r in group] == [12, group[1].num_output_tokens, 12]
    assert group[1].num_output_tokens < 12
    assert not core.has_unfinished() and core.stats().device_blocks.used == 0
    # Steps after the abort never schedule the aborted sequence (they did before it).
    assert any(r.request_id == "g-1" for out in runner.steps[:aborted_at] for r in out.scheduled)
    assert all(r.request_id != "g-1" for out in runner.steps[aborted_at:] for r in out.scheduled)


def test_aborting_the_parent_before_the_fork_aborts_the_group() -> None:
    core = EngineCore(make_scheduler(), ScriptedRunner())
    group = make_group("g", [1, 2, 3], SamplingParams(max_tokens=4, n=2))
    core.add_request(group)
    core.abort_sequence("g-0")
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in group)
    assert not core.has_unfinished()


def test_prompt_logprobs_are_stitched_across_chunks_and_skip_the_prefix_cache() -> None:
    core = EngineCore(make_scheduler(batched_tokens=4), ScoringRunner())
    prompt = list(range(10, 20))
    core.add_request(make_group("warm", prompt, SamplingParams(max_tokens=1)))
    for _ in range(10):
        core.step()
    scoring = SamplingParams(max_tokens=2, prompt_logprobs=0, ignore_eos=True)
    core.add_request(make_group("s", prompt, scoring))
    deltas = [d for _ in range(10) for d in core.step()]
    first = next(d for d in deltas if d.request_id == "s")
    assert first.num_cached_tokens == 0  # the warm request's blocks were not reused
    assert first.prompt_logprobs is not None
    assert [lp.token_id for lp in first.prompt_logprobs] == prompt[1:]
    assert [lp.rank for lp in first.prompt_logprobs] == list(range(1, 10))
    later = [d for d in deltas if d.request_id == "s" and d is not first]
    assert all(d.prompt_logprobs is None for d in later)


def test_max_tokens_zero_finishes_after_the_prompt_without_sampling() -> None:
    runner = ScoringRunner()
    core = EngineCore(make_scheduler(batched_tokens=4), runner)
    prompt = list(range(30, 39))
    core.add_request(make_group("z", prompt, SamplingParams(max_tokens=0, prompt_logprobs=1)))
    deltas = [d for _ in range(10) for d in core.step()]
    assert len(deltas) == 1
    (delta,) = deltas
    assert delta.finish_reason is FinishReason.LENGTH and delta.new_token_ids == []
    assert [lp.token_id for lp in delta.prompt_logprobs or []] == prompt[1:]
    assert all(not r.sample for out in runner.steps for r in out.scheduled)
    assert core.stats().generation_tokens_total == 0
    assert not core.has_unfinished() and core.stats().device_blocks.used == 0
