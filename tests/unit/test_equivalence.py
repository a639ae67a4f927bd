"""Same tokens whatever the scheduler does: the deterministic prefix-hash model.

Every sequence's tokens must equal plain uncached generation (``reference_tokens``) with
recompute and swap preemption, chunked prefill, prefix-cache hits and n > 1 forks. The
fake runner reads the prefix back from its simulated blocks, so a bookkeeping bug changes
the tokens."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.core import EngineCore
from engine.kv.accounting import KVShape
from engine.outputs import EngineStats
from engine.request import SamplingParams
from engine.scheduler import Scheduler
from tests.unit.fakes import FakeKVRunner, PrefixHashModel, drive, expected_for, make_group

SHAPE = KVShape(num_layers=1, num_kv_heads=1, head_dim=4, kv_dtype="float32")


@dataclass(frozen=True)
class Setup:
    blocks: int
    block_size: int = 4
    host: int = 0
    budget: int = 4096
    mode: str = "recompute"
    policy: str = "optimistic"
    caching: bool = True


@dataclass
class Outcome:
    outputs: dict[str, list[int]]
    expected: dict[str, list[int]]
    stats: EngineStats
    num_copies: int
    num_partial_chunks: int  # scheduled prefill chunks that did not reach the end


def run_workload(setup: Setup, seed: int = 0) -> Outcome:
    rng = random.Random(seed)
    model = PrefixHashModel(vocab_size=48)
    sched_config = SchedulerConfig(
        max_model_len=96,
        max_num_seqs=16,
        max_num_batched_tokens=setup.budget,
        preemption_mode=setup.mode,  # type: ignore[arg-type]
        admission_policy=setup.policy,  # type: ignore[arg-type]
        swap_min_tokens=8,
    )
    cache_config = CacheConfig(
        num_device_blocks=setup.blocks,
        block_size=setup.block_size,
        num_host_blocks=setup.host,
        enable_prefix_caching=setup.caching,
        watermark=0.0,
    )
    runner = FakeKVRunner(setup.blocks, setup.block_size, setup.host, model)
    core = EngineCore(Scheduler(sched_config, cache_config, SHAPE), runner)
    system_prompt = [rng.randrange(1, 48) for _ in range(13)]
    expected: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    for index in range(14):
        tail = [rng.randrange(1, 48) for _ in range(rng.randrange(1, 20))]
        prompt = system_prompt[: rng.randrange(0, 14)] + tail
        params = SamplingParams(
            max_tokens=rng.randrange(1, 24), n=rng.choice([1, 1, 1, 2, 3]), seed=index
        )
        group = make_group(f"r{index}", prompt, params, eos=(0,))
        core.add_request(group)
        expected.update(expected_for(group, model, sched_config))
        # Staggered arrivals: earlier requests' blocks are cached when later ones arrive.
        for _ in range(rng.randrange(0, 3)):
            for delta in core.step():
                outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            core.scheduler.check_integrity()
    for request_id, tokens in drive(core).items():
        outputs.setdefault(request_id, []).extend(tokens)
    stats = core.stats()
    assert stats.device_blocks.used == 0 and stats.host_blocks.used == 0
    num_copies = sum(len(step.copies) for step in runner.steps)
    partial = sum(not r.sample for step in runner.steps for r in step.scheduled)
    return Outcome(outputs, expected, stats, num_copies, partial)


def test_baseline_without_cache_or_pressure_matches_the_reference() -> None:
    result = run_workload(Setup(blocks=400, caching=False))
    assert result.outputs == result.expected
    assert sum(result.stats.preemptions_total.values()) == 0


def test_forks_copy_on_write_and_keep_tokens_identical() -> None:
    result = run_workload(Setup(blocks=400, block_size=5))
    assert result.outputs == result.expected
    assert any(rid.endswith("-1") for rid in result.expected), "the workload has n > 1"
    assert result.num_copies > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recompute_preemption_keeps_tokens_identical(seed: int) -> None:
    result = run_workload(Setup(blocks=24, mode="recompute"), seed)
    assert result.outputs == result.expected
    assert result.stats.preemptions_total["recompute"] > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_swap_preemption_keeps_tokens_identical(seed: int) -> None:
    result = run_workload(Setup(blocks=24, host=64, mode="swap"), seed)
    assert result.outputs == result.expected
    assert result.stats.preemptions_total["swap"] > 0 and result.stats.blocks_swapped_in_total > 0


def test_auto_preemption_keeps_tokens_identical() -> None:
    result = run_workload(Setup(blocks=24, host=6, mode="auto"))
    assert result.outputs == result.expected
    assert sum(result.stats.preemptions_total.values()) > 0


def test_chunked_prefill_keeps_tokens_identical() -> None:
    result = run_workload(Setup(blocks=400, budget=5))
    assert result.outputs == result.expected
    assert result.num_partial_chunks > 0


def test_prefix_hits_keep_tokens_identical() -> None:
    result = run_workload(Setup(blocks=400, block_size=2))
    assert result.outputs == result.expected
    assert result.stats.prefix_cache_hits_total > 0


def test_reserve_policy_keeps_tokens_identical_without_preempting() -> None:
    result = run_workload(Setup(blocks=40, policy="reserve", budget=7))
    assert result.outputs == result.expected
    assert sum(result.stats.preemptions_total.values()) == 0


def test_everything_at_once_with_block_size_one() -> None:
    setup = Setup(blocks=70, block_size=1, host=30, budget=6, mode="auto")
    result = run_workload(setup)
    assert result.outputs == result.expected
