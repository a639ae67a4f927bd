"""Speculative decoding without torch: the n-gram proposer, the config, and the scheduler's
drafts, rollback and limits, checked against a fake runner that verifies drafts greedily
from the tokens it reads back out of the simulated KV blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from engine.core import EngineCore
from engine.kv.accounting import KVShape, blocks_for_tokens
from engine.request import SamplingParams
from engine.scheduler import Scheduler
from engine.speculative.ngram import NgramIndex, NgramProposer
from tests.unit.fakes import FakeKVRunner, PrefixHashModel, expected_for, make_group

SHAPE = KVShape(num_layers=1, num_kv_heads=1, head_dim=4, kv_dtype="float32")
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


@dataclass(frozen=True)
class LoopingModel(PrefixHashModel):
    """The next token depends on the last two only, over 6 tokens: outputs soon repeat,
    so n-gram drafts are often right (and sometimes wrong)."""

    vocab_size: int = 6

    def next_token(self, prefix: Sequence[int], seed: int | None) -> int:
        return super().next_token(prefix[-2:], seed)


# -- the proposer ----------------------------------------------------------------------------


def test_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    index = NgramIndex(low=1, high=3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    # Suffix (2, 3) occurred at 1-2 (then 9) and 5-6 (then 7): the latest wins; (9, 2, 3)
    # does not occur, so the 2-gram is the longest match.
    assert index.propose(tokens, 3) == [7, 5, 2]
    assert index.propose([*tokens, 7], 2) == [5, 2]  # extended incrementally
    assert NgramIndex(low=1, high=3).propose([*tokens, 7], 2) == [5, 2]  # same as fresh


def test_prefers_the_longer_match_and_respects_the_minimum():
    tokens = [4, 5, 6, 1, 5, 6, 2, 4, 5, 6]
    assert NgramIndex(low=1, high=3).propose(tokens, 1) == [1]  # (4, 5, 6) beats (5, 6)
    assert NgramIndex(low=2, high=3).propose([1, 2, 3, 4, 2], 2) == []  # only a 1-gram matches
    assert NgramIndex(low=1, high=2).propose([7, 8, 9], 2) == []  # no earlier occurrence


def test_proposer_caps_by_k_and_forgets():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1))
    tokens = [1, 2, 3, 4, 5, 1]
    assert proposer.propose("r", tokens, max_tokens=10) == [2, 3]
    assert proposer.propose("r", tokens, max_tokens=1) == [2]
    assert proposer.propose("r", tokens, max_tokens=0) == []
    proposer.forget("r")
    assert "r" not in proposer._indexes


# -- the config ------------------------------------------------------------------------------


def test_config_parses_vllm_json():
    config = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,'
        ' "prompt_lookup_min": 3}'
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_min) == (5, 3)
    assert SpeculativeConfig.from_json('{"prompt_lookup_max": 1}').prompt_lookup_min == 1
    assert SpeculativeConfig.from_json('{"prompt_lookup_min": 7}').prompt_lookup_max == 7


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nope", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle"}', "method"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"num_speculative_tokens": "4"}', "must be int"),
        ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"draft_model": "x"}', "unknown keys"),
    ],
)
def test_config_rejects_bad_json(text, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json(text)


# -- the scheduler ---------------------------------------------------------------------------


def make_core(blocks: int, block_size: int = 4, spec=SPEC, **scheduler) -> EngineCore:
    config = SchedulerConfig(**{"max_model_len": 256, "speculative": spec, **scheduler})
    cache = CacheConfig(num_device_blocks=blocks, block_size=block_size, watermark=0.0)
    runner = FakeKVRunner(blocks, block_size, model=LoopingModel())
    return EngineCore(Scheduler(config, cache, SHAPE), runner)


def drive_checking_rollback(core: EngineCore) -> dict[str, list[int]]:
    """Step to the end; after every step each running request holds exactly the blocks
    its computed tokens need (rejected drafts' blocks are back in the pool)."""
    outputs: dict[str, list[int]] = {}
    scheduler = core.scheduler
    while core.has_unfinished():
        for delta in core.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        scheduler.check_integrity()
        for request in scheduler.running:
            held = scheduler.kv.num_blocks(request.request_id)
            assert held == blocks_for_tokens(request.num_computed_tokens, scheduler.block_size)
    return outputs


def add(core: EngineCore, name: str, prompt: list[int], params: SamplingParams) -> dict:
    group = make_group(name, prompt, params, eos=(0,))
    core.add_request(group)
    return expected_for(group, LoopingModel(), core.scheduler.config)


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_outputs_match_plain_decoding_and_blocks_roll_back(block_size):
    core = make_core(blocks=256, block_size=block_size)
    expected = {}
    for name, prompt in {"a": [1, 2, 3, 1, 2], "b": [4, 5, 4, 5, 4], "c": [3, 3, 3]}.items():
        expected |= add(core, name, prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    assert drive_checking_rollback(core) == expected
    stats = core.stats()
    assert stats.spec_drafts_total > 0
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total
    assert stats.generation_tokens_total == 3 * 40
    # Fewer steps than tokens: verifications emitted several tokens at once.
    assert stats.steps_total < 40


def test_stop_token_and_max_tokens_cut_a_verification():
    core = make_core(blocks=256)
    expected = add(core, "eos", [1, 2, 1, 2], SamplingParams(max_tokens=200))  # EOS is 0
    expected |= add(core, "len", [3, 4, 3, 4], SamplingParams(max_tokens=13, ignore_eos=True))
    assert drive_checking_rollback(core) == expected
    assert len(expected["len"]) == 13


def test_memory_pressure_turns_drafts_off_instead_of_preempting():
    # Exactly the blocks prompt + max_tokens need: no room for a draft's extra block.
    core = make_core(blocks=3, block_size=4)
    expected = add(core, "a", [1, 2, 1, 2], SamplingParams(max_tokens=8, ignore_eos=True))
    assert drive_checking_rollback(core) == expected
    assert sum(core.stats().preemptions_total.values()) == 0


def test_drafts_respect_the_token_budget_and_the_batch_size():
    core = make_core(blocks=256, max_num_batched_tokens=3)
    expected = add(core, "a", [1, 2, 1, 2, 1], SamplingParams(max_tokens=30, ignore_eos=True))
    scheduled_sizes = []
    outputs: list[int] = []
    while core.has_unfinished():
        out = core.scheduler.schedule()
        scheduled_sizes += [r.num_new_tokens for r in out.scheduled]
        for delta in core.scheduler.update(out, core.runner.execute(out)):
            outputs += delta.new_token_ids
    assert outputs == expected["a"]
    assert max(scheduled_sizes) == 3
    assert core.scheduler.stats().spec_drafts_total > 0

    crowded = make_core(blocks=256, spec=SpeculativeConfig(disable_by_batch_size=1))
    for name in "ab":
        add(crowded, name, [1, 2, 1, 2], SamplingParams(max_tokens=10, ignore_eos=True))
    drive_checking_rollback(crowded)
    assert crowded.stats().spec_drafts_total == 0


def test_requests_that_verification_cannot_reproduce_do_not_speculate():
    core = make_core(blocks=256)
    params = SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=0.5)
    add(core, "a", [1, 2, 1, 2], params)
    drive_checking_rollback(core)
    assert core.stats().spec_drafts_total == 0


def test_preempted_speculating_requests_recompute_correctly():
    core = make_core(blocks=12, block_size=2, preemption_mode="recompute")
    expected = {}
    for name, prompt in {"a": [1, 2, 1, 2], "b": [3, 4, 3], "c": [5, 5]}.items():
        expected |= add(core, name, prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    assert drive_checking_rollback(core) == expected
    stats = core.stats()
    assert stats.preemptions_total["recompute"] > 0
    assert stats.spec_drafts_total > 0
