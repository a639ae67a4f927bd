"""Sliding-window and hybrid models through the real engine, exact past their window.

Mistral (every layer slides), Gemma 2 and gpt-oss (alternating; gpt-oss with sinks and
experts) and Gemma 3 (five local to one global) run through the real scheduler with
their KV groups (ModelSpec.kv_shape): sliding groups release the blocks before their
window, prefix hits take only the window, and blocks move by copy-on-write, swap and
recompute. Greedy tokens must equal transformers' over prompts several windows long, for
the torch and native kernels, on every path that moves or drops a block: chunked
prefill, prefix hits, recompute and swap preemption, speculative decoding, and (through
build_engine) the host and disk tiers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from engine.builder import build_engine
from engine.config import CacheConfig, EngineArgs, SchedulerConfig, SpeculativeConfig
from engine.model.loader import model_from_reference
from engine.outputs import NULL_BLOCK
from engine.request import Request
from tests.model.engine_helpers import greedy, make_core, reference_greedy, run_all
from tests.model.family_models import FAMILIES, WINDOW, random_reference

HYBRID = ("mistral", "gemma2", "gemma3_text", "gpt_oss")
SHARED = [(5 * i + 2) % 240 + 3 for i in range(40)]  # a head several windows long
PROMPTS = {
    "a": [*SHARED, 7, 8, 9, 10, 11],
    "b": [(11 * i + 5) % 253 for i in range(58)],
    "c": [*SHARED, 200, 201, 202],  # shares "a"'s head: a prefix hit once "a" computed it
}
MAX_TOKENS = 32  # decode steps compared with transformers on every path (issue 34: 32+)
SCENARIOS: dict[str, tuple[CacheConfig, SchedulerConfig]] = {
    "plain": (CacheConfig(num_device_blocks=512, block_size=4), SchedulerConfig()),
    "chunked": (
        CacheConfig(num_device_blocks=512, block_size=4),
        SchedulerConfig(max_num_batched_tokens=13),
    ),
    # Pools that hold "b" or "c" alone but not both (set per family below).
    "recompute": (
        CacheConfig(num_device_blocks=1, block_size=4, watermark=0.0),
        SchedulerConfig(max_model_len=128, preemption_mode="recompute", max_num_batched_tokens=16),
    ),
    "swap": (
        CacheConfig(num_device_blocks=1, block_size=4, num_host_blocks=512, watermark=0.0),
        SchedulerConfig(
            max_model_len=128, preemption_mode="swap", swap_min_tokens=1, max_num_batched_tokens=16
        ),
    ),
    "speculative": (
        CacheConfig(num_device_blocks=512, block_size=4),
        SchedulerConfig(speculative=SpeculativeConfig(prompt_lookup_min=1)),
    ),
}
# Pools (16-token prompt chunks) that admit "b" and "c" together but not their growth:
# the sliding groups' share is bounded by the window, the full group's is not.
TIGHT_POOL = {"mistral": 12, "gemma2": 40, "gemma3_text": 80, "gpt_oss": 40}


@pytest.fixture(scope="module", params=HYBRID)
def family(request: pytest.FixtureRequest) -> tuple[str, Any, dict[str, list[int]]]:
    reference = random_reference(FAMILIES[request.param][0])
    expected = {rid: reference_greedy(reference, p, MAX_TOKENS) for rid, p in PROMPTS.items()}
    return request.param, reference, expected


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_tokens_equal_transformers_past_the_window(family, kernels, scenario: str) -> None:
    name, reference, expected = family
    model = model_from_reference(reference).replace(kernels=kernels)
    groups = model.spec.kv_shape("float32").groups
    assert any(g.window == WINDOW for g in groups), "the model has sliding groups"
    check_scenario(model, scenario, expected, tight_pool=TIGHT_POOL[name], groups=groups)


def check_scenario(
    model: Any,
    scenario: str,
    expected: dict[str, list[int]],
    *,
    tight_pool: int,
    groups: tuple[Any, ...] = (),
) -> None:
    """Run ``PROMPTS`` through a real engine in ``scenario`` ("a" first, then "b" and "c"
    together; ``tight_pool`` blocks where it preempts); greedy tokens must equal
    ``expected`` and the scenario's path must have been taken."""
    cache, scheduler = SCENARIOS[scenario]
    if scenario in ("recompute", "swap"):
        cache = dataclasses.replace(cache, num_device_blocks=tight_pool)
    core = make_core(model, cache, scheduler, groups=groups)
    outputs = run_all(core, {"a": PROMPTS["a"]}, {"a": greedy(MAX_TOKENS)})
    rest = {rid: p for rid, p in PROMPTS.items() if rid != "a"}
    outputs |= run_all(core, rest, {rid: greedy(MAX_TOKENS) for rid in rest})
    assert outputs == expected
    stats = core.stats()
    if scenario in ("recompute", "swap"):
        assert stats.preemptions_total[scenario] > 0
    else:  # (a tight pool evicts "a"'s blocks before "c" arrives)
        assert stats.prefix_cache_hits_total > 0  # "c" reused "a"'s head, per group
    if scenario == "speculative":
        assert stats.spec_drafts_total > 0


def test_sliding_groups_hold_only_their_window_while_decoding(family) -> None:
    _, reference, expected = family
    model = model_from_reference(reference)
    groups = model.spec.kv_shape("float32").groups
    core = make_core(model, CacheConfig(num_device_blocks=512, block_size=4), groups=groups)
    core.add_request([Request("a", PROMPTS["a"], greedy(MAX_TOKENS))])
    bound = -(-(WINDOW - 1) // 4) + 1
    tokens: list[int] = []
    while core.has_unfinished():
        for delta in core.step():
            tokens += delta.new_token_ids
        tables = core.scheduler.kv.tables.get("a")
        request = core.scheduler._requests.get("a")
        if tables is None or request is None or request.num_output_tokens < 2:
            continue  # right after the prefill, the chunk's blocks go at the next step
        for group, table in zip(groups, tables, strict=True):
            held = len(table) - table.count(NULL_BLOCK)
            if group.window is not None:
                assert held <= bound
            else:
                assert held == -(-request.num_computed_tokens // 4)
    assert tokens == expected["a"]


def saved(reference: Any, tokenizer: Any, path: Path) -> Path:
    """The reference re-made with the tokenizer's vocabulary, saved with it."""
    config = reference.config
    config.vocab_size = len(tokenizer)
    config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    rebuilt = random_reference(lambda: type(reference)(config))
    rebuilt.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_tiers_reload_every_group_and_the_plan_equals_the_built_pool(
    family, smollm_tokenizer: Any, tmp_path: Path
) -> None:
    """Through build_engine with a host and a disk tier: a conversation whose blocks were
    evicted from the device comes back from the tiers, group by group, with the tokens
    of a fresh computation; the pool is the bytes the plan says."""
    _, reference, _ = family
    model_dir = saved(reference, smollm_tokenizer, tmp_path / "model")
    args = EngineArgs(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        num_kv_blocks=200,
        block_size=4,
        max_model_len=256,
        swap_space_gib=0,
        # Room in the host tier for every block the run demotes: a full host tier passes
        # its evictions to the disk writer's bounded queue, which drops writes when it
        # falls behind, and whether "first" survived would then depend on the timing.
        kv_cache_host_gib=4 / 1024,
        kv_cache_disk_dir=str(tmp_path / "disk"),
        kv_cache_disk_gib=0.01,
    )
    built = build_engine(args)
    core = built.core
    runner = core.runner
    assert runner.device_pool.nbytes == built.plan.kv_pool_bytes  # type: ignore[attr-defined]
    assert built.plan.groups, "a hybrid plan lists its groups"
    prompt = [(3 * i + 1) % 200 + 10 for i in range(60)]

    def run(rid: str, tokens: list[int]) -> list[int]:
        out = run_all(core, {rid: tokens}, {rid: greedy(8)})
        return out[rid]

    first = run("first", prompt)
    for index in range(10):  # fillers evict the first conversation's blocks
        run(f"filler{index}", [(index * 17 + i) % 230 + 5 for i in range(70)])
    again = run("again", prompt)
    assert again == first
    loaded = sum(t.loaded_bytes_total for t in core.stats().tiers)
    assert loaded > 0, "the prefix came back from a tier"
    core.close()
