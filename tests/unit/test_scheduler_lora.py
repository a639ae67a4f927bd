"""The scheduler with LoRA adapters: at most ``max_loras`` distinct adapters in a step,
none starved, prefix blocks never shared across adapters; all without torch."""

from __future__ import annotations

import dataclasses

from engine.config import CacheConfig, SchedulerConfig
from engine.core import EngineCore
from engine.kv.accounting import KVShape
from engine.request import LoRARequest, Request, SamplingParams
from engine.scheduler import Scheduler
from tests.unit.fakes import FakeKVRunner, drive, expected_for, make_group

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, kv_dtype="float32")
BLOCK = 4
ADAPTERS = tuple(LoRARequest(f"a{i}", i + 1, f"/adapters/a{i}", f"digest{i}") for i in range(3))


def make_core(max_loras: int, blocks: int = 256) -> tuple[EngineCore, FakeKVRunner]:
    config = SchedulerConfig(max_model_len=256, max_num_batched_tokens=64, max_loras=max_loras)
    runner = FakeKVRunner(blocks, BLOCK)
    cache = CacheConfig(num_device_blocks=blocks, block_size=BLOCK)
    return EngineCore(Scheduler(config, cache, SHAPE), runner), runner


def with_adapter(group: list[Request], lora: LoRARequest | None) -> list[Request]:
    for request in group:
        request.lora = lora
    return group


def adapters_per_step(runner: FakeKVRunner) -> list[set[int]]:
    return [{r.lora.id for r in out.scheduled if r.lora is not None} for out in runner.steps]


def test_a_step_holds_at_most_max_loras_adapters_and_every_request_finishes() -> None:
    core, runner = make_core(max_loras=2)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected: dict[str, list[int]] = {}
    for index in range(9):
        lora = None if index % 4 == 3 else ADAPTERS[index % 3]
        group = with_adapter(make_group(f"r{index}", [5 + index] * 9, params), lora)
        expected |= expected_for(group, runner.model, core.scheduler.config)
        core.add_request(group)
    assert drive(core) == expected
    steps = adapters_per_step(runner)
    assert max(len(ids) for ids in steps) == 2  # two adapters do share steps
    assert {i for ids in steps for i in ids} == {1, 2, 3}  # and the third one ran too


def test_without_a_bound_all_adapters_share_a_step() -> None:
    core, runner = make_core(max_loras=3)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for index, lora in enumerate(ADAPTERS):
        core.add_request(with_adapter(make_group(f"r{index}", [7] * 5, params), lora))
    drive(core)
    assert adapters_per_step(runner)[0] == {1, 2, 3}


def test_prefix_blocks_are_shared_only_by_requests_of_the_same_adapter_weights() -> None:
    core, _ = make_core(max_loras=2)
    prompt = list(range(1, 4 * BLOCK + 2))
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    same_files = dataclasses.replace(ADAPTERS[0], name="alias", id=9)  # one digest, two loads

    def cached(request_id: str, lora: LoRARequest | None) -> int:
        (request,) = with_adapter(make_group(request_id, prompt, params), lora)
        core.add_request([request])
        drive(core)
        return request.num_cached_tokens

    assert cached("first", ADAPTERS[0]) == 0
    assert cached("other adapter", ADAPTERS[1]) == 0
    assert cached("base", None) == 0
    assert cached("same adapter", ADAPTERS[0]) == 4 * BLOCK
    assert cached("same weights", same_files) == 4 * BLOCK
    assert cached("base again", None) == 4 * BLOCK


def test_stats_name_the_running_and_the_waiting_adapters() -> None:
    core, _ = make_core(max_loras=1)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    for index, lora in enumerate((ADAPTERS[0], ADAPTERS[1], None)):
        core.add_request(with_adapter(make_group(f"r{index}", [3] * 6, params), lora))
    core.step()
    stats = core.stats()
    assert stats.running_lora_adapters == ("a0",)
    assert stats.waiting_lora_adapters == ("a1",)
    assert stats.num_running == 2  # the base request is not bound by the adapter slots
