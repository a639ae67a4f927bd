"""Speculative decoding through the real engine: greedy output token-for-token identical
with speculation on and off (chunked prefill, prefix hits, preemption by recompute and
swap, n > 1, stop tokens, max_tokens), KV blocks rolled back cleanly (the scheduler's
integrity check after every step), and logprobs of the emitted tokens."""

from __future__ import annotations

import math

import pytest

from engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from engine.model.layers.quantize import quantize_weights
from engine.model.loader import model_from_reference
from engine.request import Request, SamplingParams
from tests.model.engine_helpers import greedy, make_core, run_all

# Repetitive prompts: an n-gram proposer finds matches in them, and a random tiny model's
# greedy output soon loops, so drafts are both accepted and rejected.
PROMPTS = {
    "a": [5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17, 33, 5],
    "b": [11, 12, 13, 11, 12],
    "c": list(range(40, 60)) + list(range(40, 50)),
    "d": [42] * 21,
}
MAX_TOKENS = 24
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.fixture(scope="module")
def model(tiny_llama_factory, kernels):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2, tie_embeddings=True)
    return model_from_reference(reference).replace(kernels=kernels)


def run(model, cache, scheduler, prompts=PROMPTS, params=None):
    params = params or {rid: greedy(MAX_TOKENS) for rid in prompts}
    core = make_core(model, cache, scheduler)
    return run_all(core, prompts, params), core.stats()


def both(model, cache, **scheduler):
    """Outputs with speculation off and on, and the speculating run's stats."""
    plain, _ = run(model, cache, SchedulerConfig(**scheduler))
    spec, stats = run(model, cache, SchedulerConfig(speculative=SPEC, **scheduler))
    return plain, spec, stats


def assert_speculated(stats):
    assert stats.spec_drafts_total > 0
    assert 0 < stats.spec_accepted_tokens_total <= stats.spec_draft_tokens_total
    assert stats.spec_emitted_tokens_total == stats.spec_accepted_tokens_total + (
        stats.spec_drafts_total
    )


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_identical_with_speculation(model, block_size):
    cache = CacheConfig(num_device_blocks=512, block_size=block_size)
    plain, spec, stats = both(model, cache)
    assert spec == plain
    assert_speculated(stats)
    assert stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total  # some rejected
    assert stats.generation_tokens_total == len(PROMPTS) * MAX_TOKENS


def test_chunked_prefill_and_prefix_hits(model):
    cache = CacheConfig(num_device_blocks=256, block_size=4)
    plain, spec, stats = both(model, cache, max_num_batched_tokens=5, max_model_len=64)
    assert spec == plain
    assert_speculated(stats)
    core = make_core(model, cache, SchedulerConfig(speculative=SPEC))
    run_all(core, {"a": PROMPTS["a"]}, {"a": greedy(MAX_TOKENS)})
    again = run_all(core, {"a2": PROMPTS["a"]}, {"a2": greedy(MAX_TOKENS)})
    assert core.stats().prefix_cache_hits_total > 0
    assert again["a2"] == plain["a"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_speculation(model, mode):
    scheduler = dict(max_model_len=64, preemption_mode=mode, swap_min_tokens=1)
    cache = CacheConfig(num_device_blocks=30, block_size=2, num_host_blocks=64, watermark=0.0)
    plain, spec, stats = both(model, cache, **scheduler)
    assert sum(stats.preemptions_total.values()) > 0
    assert spec == plain
    assert_speculated(stats)


def test_max_tokens_and_stop_tokens_cut_a_verification(model):
    cache = CacheConfig(num_device_blocks=256, block_size=4)
    reference, _ = run(model, cache, SchedulerConfig())
    stop = reference["a"][9]  # some token the output reaches mid-way
    first_stop = reference["a"].index(stop)
    params = {
        "a": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=(stop,)),
        "d": greedy(7),
    }
    prompts = {"a": PROMPTS["a"], "d": PROMPTS["d"]}
    outputs, stats = run(model, cache, SchedulerConfig(speculative=SPEC), prompts, params)
    assert outputs["a"] == reference["a"][: first_stop + 1]
    assert outputs["d"] == reference["d"][:7]
    assert_speculated(stats)


def test_n_greater_than_one_and_logprobs(model):
    cache = CacheConfig(num_device_blocks=256, block_size=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)

    def generate(scheduler):
        core = make_core(model, cache, scheduler)
        core.add_request([Request("x", PROMPTS["a"], params)])
        group = [Request(f"n{i}", PROMPTS["c"], params, group_id="n", index=i) for i in range(3)]
        core.add_request(group)
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list] = {}
        while core.has_unfinished():
            for delta in core.step():
                tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
                assert delta.logprobs is not None
                assert len(delta.logprobs) == len(delta.new_token_ids)
                logprobs.setdefault(delta.request_id, []).extend(delta.logprobs)
            core.scheduler.check_integrity()
        return tokens, logprobs, core.stats()

    plain_tokens, plain_logprobs, _ = generate(SchedulerConfig())
    spec_tokens, spec_logprobs, stats = generate(SchedulerConfig(speculative=SPEC))
    assert spec_tokens == plain_tokens
    assert_speculated(stats)
    for rid, entries in spec_logprobs.items():
        for got, want in zip(entries, plain_logprobs[rid], strict=True):
            assert got.token_id == want.token_id
            assert math.isclose(got.logprob, want.logprob, abs_tol=1e-3)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]


def test_speculation_turns_off_past_the_batch_size(model):
    cache = CacheConfig(num_device_blocks=512, block_size=4)
    config = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=3)
    _, stats = run(model, cache, SchedulerConfig(speculative=config))
    assert stats.spec_drafts_total == 0  # four requests run together all along


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights(model, quantization):
    """With int8/int4 weights a verification reproduces plain decoding while its rows stay
    on the few-row kernels (int8: up to 4 rows, int4: 8), which keep each row to itself and
    differ from the one-row kernel at most in float32 summation order. Beyond them
    (fbgemm's dynamic int8 scales activations per batch; int4 tiles 16 rows) quantized
    logits depend on the batch, for plain decoding as much as for speculation."""
    if model.kernels.name != "native":
        pytest.skip("the few-row int8/int4 kernels are native")
    weights = quantize_weights(model.weights, quantization, rowwise=True)
    quantized = model.replace(weights=weights)
    cache = CacheConfig(num_device_blocks=512, block_size=4)
    three = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    for rid, prompt in PROMPTS.items():  # one request at a time: 1 + 3 rows a verification
        prompts, params = {rid: prompt}, {rid: greedy(MAX_TOKENS)}
        plain, _ = run(quantized, cache, SchedulerConfig(), prompts, params)
        spec, stats = run(quantized, cache, SchedulerConfig(speculative=three), prompts, params)
        assert spec == plain
        assert stats.spec_drafts_total > 0
