"""Sampling through the real engine: seeds are batch-independent, logprobs flow out."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig
from engine.model.loader import model_from_reference
from engine.request import Request, SamplingParams
from tests.model.engine_helpers import make_core, run_all

PROMPT = [5, 9, 17, 33, 65, 129, 7]


@pytest.fixture(scope="module")
def model(tiny_llama_factory):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    return model_from_reference(reference)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)


def test_seeded_request_is_reproducible_alone_and_in_a_crowd(model):
    alone = run_all(
        make_core(model, CacheConfig(num_device_blocks=128, block_size=4)),
        {"s": PROMPT},
        {"s": seeded(42)},
    )
    crowd_prompts = {"s": PROMPT, **{f"o{i}": [i + 1] * (3 + i) for i in range(5)}}
    crowd_params = {"s": seeded(42), **{f"o{i}": seeded(i) for i in range(5)}}
    crowd_params["o0"] = SamplingParams(max_tokens=16, temperature=0.7)  # unseeded neighbour
    crowded = run_all(
        make_core(model, CacheConfig(num_device_blocks=128, block_size=4)),
        crowd_prompts,
        crowd_params,
    )
    assert alone["s"] == crowded["s"]
    assert crowded["s"] != crowded["o1"]


def test_logprobs_reach_the_deltas(model):
    core = make_core(model, CacheConfig(num_device_blocks=64, block_size=4))
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, ignore_eos=True)
    core.add_request([Request("r", list(PROMPT), params)])
    deltas = []
    while core.has_unfinished():
        deltas += core.step()
    assert len(deltas) == 3
    for delta in deltas:
        (logprob,) = delta.logprobs
        assert logprob.token_id == delta.new_token_ids[0]
        assert len(logprob.top) == 2 and logprob.top[0][0] == logprob.token_id  # greedy
        assert logprob.logprob <= 0.0
