"""Temperature 0 means one answer under ``--batch-invariant``: a request's greedy tokens
are the same alone, in a batch of 32 others, arriving while others decode, and after its
prefix was cached, for every weight format and KV dtype.

Without the flag int8 and int4 weights break this (fbgemm's activation scale is shared by
the batch; int4 switches to float dot products past eight rows): the control test below
shows the check is sharp enough to see it on this tiny model."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.core import EngineCore
from engine.model.kernels.native import NativeKernels, load_native_ops
from engine.model.layers.decoder import DecoderModel
from engine.model.layers.linear import DenseLinear, Int4Linear, Int8Linear, bf16_rowwise_supported
from engine.model.layers.quantize import quantize_weights
from engine.model.loader import model_from_reference
from engine.request import Request
from tests.model import family_models
from tests.model.engine_helpers import greedy, make_core
from tests.model.family_models import random_reference

pytestmark = pytest.mark.skipif(not load_native_ops(), reason="needs the native kernels")

MAX_TOKENS = 24
PROMPT = [random.Random(7).randrange(3, 256) for _ in range(37)]


def serving_model(reference, method: str, batch_invariant: bool = True) -> DecoderModel:
    model = model_from_reference(reference).replace(kernels=NativeKernels())
    weights = quantize_weights(model.weights, method, True, "native", batch_invariant)
    return model.replace(weights=weights)


def engine(model: DecoderModel, kv_dtype: str) -> EngineCore:
    return make_core(
        model,
        CacheConfig(num_device_blocks=512, block_size=8),
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512),
        kv_dtype=kv_dtype,
    )


def others(count: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {
        f"other-{i}": [rng.randrange(3, 256) for _ in range(rng.randrange(5, 60))]
        for i in range(count)
    }


def run(core: EngineCore, prompts: dict[str, list[int]], late: dict[str, list[int]]) -> dict:
    """Greedy tokens of ``prompts`` (added first) and ``late`` (added after three steps, so
    their prefill shares steps with the others' decodes)."""
    outputs: dict[str, list[int]] = {rid: [] for rid in {**prompts, **late}}
    for rid, prompt in prompts.items():
        core.add_request([Request(rid, list(prompt), greedy(MAX_TOKENS))])
    for step in range(10_000):
        if step == 3:
            for rid, prompt in late.items():
                core.add_request([Request(rid, list(prompt), greedy(MAX_TOKENS))])
        if step > 3 and not core.has_unfinished():
            break
        for delta in core.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
        core.scheduler.check_integrity()
    return outputs


def answers(model: DecoderModel, kv_dtype: str) -> dict[str, list[int]]:
    """The same prompt alone, then again (its prefix cached), in a batch of 32, and late
    into a batch of 31 that is decoding."""
    core = engine(model, kv_dtype)
    alone = run(core, {"p": PROMPT}, {})["p"]
    cached = run(core, {"p": PROMPT}, {})["p"]
    assert core.stats().prefix_cache_hits_total >= len(PROMPT) // 8 * 8
    batched = run(engine(model, kv_dtype), {"p": PROMPT, **others(31, 1)}, {})["p"]
    late = run(engine(model, kv_dtype), others(31, 2), {"p": PROMPT})["p"]
    assert len(alone) == MAX_TOKENS
    return {"alone": alone, "prefix cached": cached, "batch of 32": batched, "late": late}


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("method", ["none", "int8", "int4"])
def test_greedy_tokens_do_not_depend_on_the_batch(tiny_llama_factory, method, kv_dtype):
    _, reference = tiny_llama_factory(num_kv_heads=2)
    got = answers(serving_model(reference, method), kv_dtype)
    assert {name: tokens == got["alone"] for name, tokens in got.items()} == dict.fromkeys(
        got, True
    )


def test_bf16_weights_are_invariant_where_the_cpu_has_the_kernel(tiny_llama_factory):
    """bf16's row-wise kernel needs AVX512_BF16: there the tokens hold still; elsewhere
    the flag is refused at build time, naming the way out."""
    _, reference = tiny_llama_factory(num_kv_heads=2)
    model = model_from_reference(reference.to(torch.bfloat16)).replace(kernels=NativeKernels())
    if not bf16_rowwise_supported(model.weights.embed):
        with pytest.raises(ValueError, match="--dtype float32"):
            quantize_weights(model.weights, "none", True, "native", batch_invariant=True)
        return
    weights = quantize_weights(model.weights, "none", True, "native", batch_invariant=True)
    got = answers(model.replace(weights=weights), "bfloat16")
    assert all(tokens == got["alone"] for tokens in got.values())


def test_without_the_flag_int8_answers_depend_on_the_batch(tiny_llama_factory):
    """The control: fbgemm's per-call activation scale moves some answer (so the checks
    above can fail)."""
    _, reference = tiny_llama_factory(num_kv_heads=2)
    got = answers(serving_model(reference, "int8", batch_invariant=False), "float32")
    assert any(tokens != got["alone"] for tokens in got.values())


def test_the_flag_refuses_torch_kernels_and_moe_layers(tiny_llama_factory):
    _, reference = tiny_llama_factory(num_kv_heads=2)
    weights = model_from_reference(reference).weights
    with pytest.raises(ValueError, match="native CPU kernels"):
        quantize_weights(weights, "int8", False, "torch", batch_invariant=True)
    moe = model_from_reference(random_reference(family_models.mixtral)).weights
    with pytest.raises(ValueError, match="mixture-of-experts"):
        quantize_weights(moe, "int8", True, "native", batch_invariant=True)


@pytest.mark.parametrize("method", ["none", "int8", "int4"])
def test_an_invariant_projection_gives_a_row_the_same_bits_in_any_batch(method):
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * 0.1
    linear = {
        "none": lambda: DenseLinear(weight, rowwise=True, invariant=True),
        "int8": lambda: Int8Linear.from_dense(weight, rowwise=True, invariant=True),
        "int4": lambda: Int4Linear.from_dense(weight, invariant=True),
    }[method]()
    batch = torch.randn(37, 128)
    full = linear(batch)  # more rows than any few-row kernel takes at once
    for row in (0, 17, 36):
        assert torch.equal(linear(batch[row : row + 1])[0], full[row])
    assert torch.equal(linear(batch[5:14]), full[5:14])
    stored = linear.unpack().dequantize() if method == "int4" else weight
    torch.testing.assert_close(full, batch @ stored.T, atol=0.05, rtol=0.05)
