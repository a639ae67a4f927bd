"""The hybrid KV cache without torch: sliding-window and full-attention groups.

The fake runner keeps one block table per group, writes every token into each group's
block and reads back the whole prefix (full) or only the window (sliding): a block
released too early, reused while still read, or wrongly hit in one group changes the
tokens. Every workload must reproduce plain uncached generation exactly, through chunked
prefill, prefix hits, recompute and swap preemption, forks, speculation and the tiers,
with the block invariants checked after every step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from engine.core import EngineCore
from engine.kv.accounting import KVShape, blocks_for_tokens
from engine.kv.groups import KVGroup, plan_kv_groups
from engine.kv.tiers import TieredPrefixCache
from engine.outputs import NULL_BLOCK, EngineStats
from engine.request import SamplingParams
from engine.scheduler import Scheduler
from tests.unit.fakes import (
    FakeDisk,
    FakeKVRunner,
    FakeTierMover,
    PrefixHashModel,
    expected_for,
    make_group,
)

MIXED = (6, 6, None)  # two sliding groups in lock step and a full one (Gemma-like)
SLIDING = (9,)  # every layer slides (Mistral-like)


def shape_for(windows: tuple[int | None, ...]) -> KVShape:
    groups = tuple(KVGroup((i,), w) for i, w in enumerate(windows))
    return KVShape(len(windows), 1, 4, "float32", groups)


@dataclass(frozen=True)
class Setup:
    windows: tuple[int | None, ...]
    blocks: int
    block_size: int = 4
    host: int = 0
    budget: int = 4096
    mode: str = "recompute"
    policy: str = "optimistic"
    caching: bool = True
    tier_host: int = 0
    disk: bool = False
    speculative: bool = False
    max_model_len: int = 96


@dataclass
class Outcome:
    outputs: dict[str, list[int]]
    expected: dict[str, list[int]]
    stats: EngineStats
    max_sliding_blocks: int  # most blocks a one-token decode held in a sliding group
    tier_loads: int
    failed_loads: int = 0


def build(setup: Setup) -> tuple[EngineCore, FakeKVRunner, FakeTierMover | None]:
    config = SchedulerConfig(
        max_model_len=setup.max_model_len,
        max_num_seqs=16,
        max_num_batched_tokens=setup.budget,
        preemption_mode=setup.mode,  # type: ignore[arg-type]
        admission_policy=setup.policy,  # type: ignore[arg-type]
        swap_min_tokens=8,
        speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)
        if setup.speculative
        else None,
    )
    cache = CacheConfig(
        num_device_blocks=setup.blocks,
        block_size=setup.block_size,
        num_host_blocks=setup.host,
        enable_prefix_caching=setup.caching,
        watermark=0.0,
    )
    model = PrefixHashModel(vocab_size=48)
    runner = FakeKVRunner(setup.blocks, setup.block_size, setup.host, model, setup.windows)
    scheduler = Scheduler(config, cache, shape_for(setup.windows))
    mover = None
    if setup.tier_host or setup.disk:
        disk = FakeDisk() if setup.disk else None
        scheduler.kv.attach_tiers(TieredPrefixCache(setup.tier_host, disk))
        mover = FakeTierMover(runner, setup.tier_host, disk)
    return EngineCore(scheduler, runner, mover), runner, mover


def run_workload(setup: Setup, seed: int = 0, corrupt_every: int = 0) -> Outcome:
    rng = random.Random(seed)
    core, runner, mover = build(setup)
    config = core.scheduler.config
    window = setup.windows[0] if all(w is not None for w in setup.windows) else None
    system_prompt = [rng.randrange(1, 48) for _ in range(30)]  # several windows long
    expected: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}

    def step() -> None:
        for delta in core.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        core.scheduler.check_integrity()
        if mover is not None and mover.disk is not None and corrupt_every:
            mover.corrupt = set(list(mover.disk.entries)[::corrupt_every])

    for index in range(14):
        tail = [rng.randrange(1, 48) for _ in range(rng.randrange(1, 24))]
        prompt = system_prompt[: rng.randrange(0, 31)] + tail
        params = SamplingParams(
            max_tokens=rng.randrange(1, 30), n=rng.choice([1, 1, 1, 2, 3]), seed=index
        )
        group = make_group(f"r{index}", prompt, params, eos=(0,))
        core.add_request(group)
        expected.update(expected_for(group, runner.model, config, window))
        for _ in range(rng.randrange(0, 4)):  # staggered arrivals: earlier blocks are cached
            step()
    for _ in range(20_000):
        if not core.has_unfinished():
            break
        step()
    else:
        raise AssertionError("livelock")
    stats = core.stats()
    assert stats.device_blocks.used == 0 and stats.host_blocks.used == 0
    loads, failed = (mover.loads, mover.failed_loads) if mover is not None else (0, 0)
    return Outcome(outputs, expected, stats, runner.max_window_blocks, loads, failed)


def window_bound(setup: Setup) -> int:
    windows = [w for w in setup.windows if w is not None]
    return max(-(-(w - 1) // setup.block_size) + 1 for w in windows)


# -- exact tokens through every path -----------------------------------------------------------


@pytest.mark.parametrize("windows", [MIXED, SLIDING])
def test_plain_runs_match_the_reference_and_sliding_groups_stay_bounded(windows) -> None:
    setup = Setup(windows, blocks=600, caching=False)
    result = run_workload(setup)
    assert result.outputs == result.expected
    assert 0 < result.max_sliding_blocks <= window_bound(setup)


@pytest.mark.parametrize("windows", [MIXED, SLIDING])
def test_prefix_hits_per_group_keep_tokens_identical(windows) -> None:
    result = run_workload(Setup(windows, blocks=600, block_size=3))
    assert result.outputs == result.expected
    assert result.stats.prefix_cache_hits_total > 0


@pytest.mark.parametrize("windows", [MIXED, SLIDING])
def test_chunked_prefill_keeps_tokens_identical(windows) -> None:
    result = run_workload(Setup(windows, blocks=600, budget=5))
    assert result.outputs == result.expected


# Pools small enough to preempt: a sliding-only model needs far fewer blocks.
TIGHT = [(MIXED, 60), (SLIDING, 16)]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("windows", "blocks"), TIGHT)
def test_recompute_preemption_keeps_tokens_identical(windows, blocks: int, seed: int) -> None:
    result = run_workload(Setup(windows, blocks=blocks, mode="recompute"), seed)
    assert result.outputs == result.expected
    assert result.stats.preemptions_total["recompute"] > 0


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("windows", "blocks"), TIGHT)
def test_swap_preemption_keeps_tokens_identical(windows, blocks: int, seed: int) -> None:
    result = run_workload(Setup(windows, blocks=blocks, host=200, mode="swap"), seed)
    assert result.outputs == result.expected
    assert result.stats.preemptions_total["swap"] > 0


def test_reserve_policy_never_preempts() -> None:
    result = run_workload(Setup(MIXED, blocks=60, policy="reserve", budget=7))
    assert result.outputs == result.expected
    assert sum(result.stats.preemptions_total.values()) == 0


@pytest.mark.parametrize("windows", [MIXED, SLIDING])
def test_speculative_rollback_keeps_tokens_identical(windows) -> None:
    result = run_workload(Setup(windows, blocks=600, speculative=True))
    assert result.outputs == result.expected
    assert result.stats.spec_drafts_total > 0


@pytest.mark.parametrize(("windows", "blocks"), [(MIXED, 70), (SLIDING, 20)])
def test_host_and_disk_tiers_serve_evicted_blocks_per_group(windows, blocks: int) -> None:
    setup = Setup(windows, blocks=blocks, tier_host=8, disk=True, block_size=3, budget=12)
    result = run_workload(setup)
    assert result.outputs == result.expected
    assert result.tier_loads > 0


def test_a_failed_tier_load_falls_back_to_what_the_groups_still_serve() -> None:
    setup = Setup(MIXED, blocks=70, disk=True, block_size=3, budget=12)
    result = run_workload(setup, corrupt_every=3)
    assert result.outputs == result.expected
    assert result.failed_loads > 0


def test_everything_at_once() -> None:
    setup = Setup(
        MIXED, blocks=60, block_size=2, host=40, budget=6, mode="auto", tier_host=6, disk=True
    )
    result = run_workload(setup, seed=3)
    assert result.outputs == result.expected


# -- the bound and the release ----------------------------------------------------------------


def test_a_long_decode_holds_at_most_the_window_bound_in_each_sliding_group() -> None:
    setup = Setup((7, None), blocks=200, block_size=4, max_model_len=400)
    core, runner, _ = build(setup)
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    core.add_request(make_group("a", list(range(1, 40)), params))
    held_full = 0
    while core.has_unfinished():
        core.step()
        core.scheduler.check_integrity()
        tables = core.scheduler.kv.tables.get("a")
        held_full = len(tables[1]) if tables else held_full
    assert runner.max_window_blocks == -(-(7 - 1) // 4) + 1  # reached, never passed
    assert held_full == blocks_for_tokens(39 + 299, 4)  # the full group keeps everything


def test_released_blocks_stay_cached_and_a_repeat_hits_only_the_window() -> None:
    setup = Setup((8, None), blocks=200, block_size=4)
    core, _, _ = build(setup)
    prompt = list(range(1, 42))
    core.add_request(make_group("a", prompt, SamplingParams(max_tokens=1)))
    while core.has_unfinished():
        core.step()
    kv = core.scheduler.kv
    assert kv.device.cached_by_group[0] == len(prompt) // 4  # released or freed: all cached
    again = make_group("b", prompt, SamplingParams(max_tokens=1))[0]
    hit = kv.find_cached_prefix(again)
    assert hit.num_blocks == (len(prompt) - 1) // 4
    first_needed = max(0, hit.num_blocks * 4 - 8 + 1) // 4
    assert hit.tables[0][:first_needed] == [NULL_BLOCK] * first_needed
    assert NULL_BLOCK not in hit.tables[0][first_needed:]
    assert NULL_BLOCK not in hit.tables[1]


def test_a_sliding_hit_needs_only_the_window_before_it() -> None:
    """Evict the early sliding blocks: a full-attention hit would be lost, a sliding one is
    not, because the window before the hit is still cached."""
    setup = Setup(SLIDING, blocks=200, block_size=4)
    core, _, _ = build(setup)
    prompt = list(range(1, 50))
    core.add_request(make_group("a", prompt, SamplingParams(max_tokens=1)))
    while core.has_unfinished():
        core.step()
    kv = core.scheduler.kv
    request = make_group("b", prompt, SamplingParams(max_tokens=1))[0]
    hashes = kv._block_hashes(request, 12)
    early = kv.device.cached[hashes[0]].block_id
    kv.device.touch([early])  # take block 0 out of the cache: reuse it as if evicted
    kv.device.uncache(early, hashes[0])
    kv.device.free([early])
    assert kv.find_cached_prefix(request).num_blocks == 12


def test_a_cache_salt_isolates_every_group() -> None:
    """A request salted differently finds nothing in any group; the same salt finds what
    every group can serve, as an unsalted repeat does."""
    core, _, _ = build(Setup(MIXED, blocks=200, block_size=4))
    prompt = list(range(1, 42))
    core.add_request(make_group("a", prompt, SamplingParams(max_tokens=1), cache_salt="t1"))
    while core.has_unfinished():
        core.step()
    kv = core.scheduler.kv

    def hit(salt: str | None) -> int:
        # A new id each time: the manager keeps a request's block hashes by its id.
        request = make_group(
            f"probe-{salt}", prompt, SamplingParams(max_tokens=1), cache_salt=salt
        )[0]
        return kv.find_cached_prefix(request).num_blocks

    assert hit("t1") == (len(prompt) - 1) // 4
    assert hit("t2") == 0 and hit(None) == 0
    core.scheduler.check_integrity()


def test_groups_of_one_kind_are_cut_evenly_and_the_smallest_kind_sets_the_page() -> None:
    gemma3 = plan_kv_groups([1024] * 5 + [None] + [1024] * 5 + [None])
    assert [g.layers for g in gemma3] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10), (5, 11)]
    assert plan_kv_groups([4096] * 4) == (KVGroup((0, 1, 2, 3), 4096),)
    assert plan_kv_groups([8, None, 8, None], hybrid=False) == (KVGroup((0, 1, 2, 3)),)


def test_a_request_too_large_for_the_window_bound_is_still_admitted_exactly() -> None:
    """A prompt far longer than the pool could hold with every block kept is served:
    its sliding groups release as the prefill advances in chunks."""
    setup = Setup(SLIDING, blocks=12, block_size=4, budget=8, max_model_len=200)
    core, runner, _ = build(setup)
    prompt = [1 + (i * 7) % 40 for i in range(150)]
    group = make_group("a", prompt, SamplingParams(max_tokens=20))
    core.add_request(group)
    expected = expected_for(group, runner.model, core.scheduler.config, 9)
    outputs: list[int] = []
    while core.has_unfinished():
        for delta in core.step():
            outputs.extend(delta.new_token_ids)
        core.scheduler.check_integrity()
    assert outputs == expected["a"]
    assert not core.scheduler.has_unfinished()
