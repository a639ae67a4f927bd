"""The CUDA path (fp16/bf16 on an NVIDIA GPU). Skipped on machines without one."""

from __future__ import annotations

import pytest
import torch

from engine.builder import build_engine
from engine.config import CacheConfig, EngineArgs, SchedulerConfig
from engine.model.loader import model_from_reference
from engine.request import Request, SamplingParams
from tests.model.engine_helpers import greedy, make_core, reference_greedy, run_all
from tests.model.paged import BlockTables, make_cache, run_step

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_close_to_fp32_reference(tiny_llama_factory, dtype):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    prompt = [5, 9, 17, 33, 65, 129, 7, 3, 2, 1]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    model = model_from_reference(reference.to("cuda", dtype))
    cache = make_cache(model, num_blocks=32, block_size=4, kv_dtype=str(dtype).split(".")[1])
    blocks = [BlockTables(32).allocate(len(prompt) + 4, 4)]
    logits = run_step(model, cache, [prompt[:6]], [0], blocks)
    logits = torch.cat([logits, run_step(model, cache, [prompt[6:]], [6], blocks)])
    tolerance = 0.05 if dtype == torch.float16 else 0.2
    torch.testing.assert_close(logits.cpu(), expected, atol=tolerance * expected.std(), rtol=0)


def test_greedy_parity_with_swap_preemption_on_cuda(tiny_llama_factory):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    prompts = {"a": [5, 9, 17, 33, 65, 129, 7], "b": [42] * 15, "c": [8, 9, 10]}
    expected = {rid: reference_greedy(reference, p, 10) for rid, p in prompts.items()}
    model = model_from_reference(reference.to("cuda"))  # float32 on the GPU: exact argmax
    scheduler = SchedulerConfig(max_model_len=32, preemption_mode="swap", swap_min_tokens=1)
    cache = CacheConfig(num_device_blocks=14, block_size=2, num_host_blocks=64, watermark=0)
    core = make_core(model, cache, scheduler)
    assert core.runner.host_pool.key.is_pinned()
    assert run_all(core, prompts, {rid: greedy(10) for rid in prompts}) == expected


def test_builder_on_cuda_picks_half_precision(tiny_model_dir):
    built = build_engine(EngineArgs(model=str(tiny_model_dir), device="auto", max_model_len=128))
    assert built.device == "cuda" and built.dtype in ("bfloat16", "float16")
    assert built.plan.activation_reserve_bytes > 0
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True)
    built.core.add_request([Request("r", [1, 2, 3, 4], params)])
    tokens = []
    while built.core.has_unfinished():
        tokens += [t for d in built.core.step() for t in d.new_token_ids]
    assert len(tokens) == 4
