"""The Triton backend (TritonKernels, CUDA's default) end to end through the model and the
engine, on the CPU under TRITON_INTERPRET: logits equal transformers', quantized caches
read as the torch backend reads them, greedy output equals the reference."""

from __future__ import annotations

import pytest
import torch

from tests.model.triton_setup import DEVICE  # isort: skip  (sets TRITON_INTERPRET first)
from engine.config import CacheConfig, SchedulerConfig
from engine.model.kernels.base import TorchKernels
from engine.model.kernels.metadata import SequenceChunk
from engine.model.kernels.native import NativeKernels
from engine.model.kernels.select import select_kernels
from engine.model.kernels.triton.triton_kernels import TritonKernels
from engine.model.loader import model_from_reference
from engine.model.runtime.cuda_metadata import StepMetadataBuilder
from tests.model.engine_helpers import greedy, make_core, reference_greedy, run_all
from tests.model.family_models import (
    DECODE_STEPS,
    PROMPTS,
    gemma2,
    mistral,
    random_reference,
    serve_greedy,
)
from tests.model.paged import BlockTables, make_cache, run_step

ATOL = 1e-4


def reference_logits(reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([ids], device=DEVICE)).logits[0].float().cpu()


@pytest.fixture(scope="module")
def triton_kernels() -> TritonKernels:
    return TritonKernels(DEVICE)


@pytest.mark.parametrize("block_size", [1, 16])
def test_chunked_prefill_and_mixed_decodes_match_transformers(
    tiny_llama_factory, triton_kernels, block_size
):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    model = model_from_reference(reference.to(DEVICE)).replace(kernels=triton_kernels)
    cache = make_cache(model, num_blocks=64, block_size=block_size)
    tables = BlockTables(64, seed=5)
    first, second = [5, 6, 7, 8, 9, 10, 11, 12, 13], [100, 101, 102]
    blocks = [tables.allocate(len(first) + 2, block_size), tables.allocate(8, block_size)]
    run_step(model, cache, [first[:4]], [0], [blocks[0]])
    # A chunk starting inside a block, and a fresh prefill beside it.
    logits = run_step(model, cache, [first[4:], second], [4, 0], blocks)
    expected = torch.cat(
        [reference_logits(reference, first)[4:], reference_logits(reference, second)]
    )
    torch.testing.assert_close(logits.cpu(), expected, atol=ATOL, rtol=0)
    # A decode and a prefill chunk in one forward.
    logits = run_step(model, cache, [[33], [7, 8]], [len(first), len(second)], blocks)
    expected = torch.cat(
        [
            reference_logits(reference, [*first, 33])[-1:],
            reference_logits(reference, [*second, 7, 8])[-2:],
        ]
    )
    torch.testing.assert_close(logits.cpu(), expected, atol=ATOL, rtol=0)


# Max |logit error| relative to the logits' spread through a quantized cache (the bounds
# tests/model/test_kv_quant.py holds the torch and native backends to).
RELATIVE_BOUND = {"int8": 0.05, "fp8": 0.2}


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_cache_logits_stay_close_to_full_precision(
    tiny_llama_factory, triton_kernels, kv_dtype
):
    """The torch backend attends a fresh prefill to unquantized K/V, Triton reads the
    cache it just wrote, so they differ by the quantization error: bound it."""
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=1)
    model = model_from_reference(reference.to(DEVICE)).replace(kernels=triton_kernels)
    cache = make_cache(model, num_blocks=32, block_size=4, kv_dtype=kv_dtype)
    blocks = [BlockTables(32, seed=2).allocate(16, 4)]
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11]
    logits = [run_step(model, cache, [prompt[:6]], [0], blocks)]
    for position in range(6, len(prompt)):
        logits.append(run_step(model, cache, [[prompt[position]]], [position], blocks))
    expected = reference_logits(reference, prompt)
    error = (torch.cat(logits).cpu() - expected).abs().max()
    assert error < RELATIVE_BOUND[kv_dtype] * expected.std()


def test_engine_greedy_output_equals_reference(tiny_llama_factory, triton_kernels):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    prompts = {"a": [5, 9, 17, 33, 65, 129, 7], "b": [42] * 11, "c": [8, 9, 10]}
    expected = {rid: reference_greedy(reference, p, 6) for rid, p in prompts.items()}
    model = model_from_reference(reference.to(DEVICE)).replace(kernels=triton_kernels)
    # A small token budget: prompts arrive in chunks beside other requests' decodes.
    scheduler = SchedulerConfig(max_model_len=32, max_num_batched_tokens=8)
    core = make_core(model, CacheConfig(num_device_blocks=24, block_size=4), scheduler)
    assert run_all(core, prompts, {rid: greedy(6) for rid in prompts}) == expected


def test_cpu_auto_choice_is_unchanged():
    chosen = select_kernels("auto", torch.device("cpu"), torch.float32)
    assert isinstance(chosen, NativeKernels | TorchKernels)
    assert not isinstance(chosen, TritonKernels)


def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_kernels("triton", torch.device("cpu"), torch.float32)


def test_soft_capped_sliding_layers_defer_to_torch_and_match_transformers(triton_kernels):
    """Gemma 2 (soft-cap on every layer, a window on half): every attention call defers
    to the torch kernels, whose results transformers' own agree with, past the window."""
    reference = random_reference(gemma2).to(DEVICE)
    model = model_from_reference(reference).replace(kernels=triton_kernels)
    tokens, logits = serve_greedy(model, block_size=8)
    for prompt, sequence, ours in zip(PROMPTS, tokens, logits, strict=True):
        fed = sequence[: len(prompt) + DECODE_STEPS]
        expected = reference_logits(reference, fed)
        torch.testing.assert_close(ours.cpu(), expected.cpu(), atol=ATOL, rtol=0)
        assert sequence[len(prompt) :] == expected[len(prompt) - 1 :].argmax(-1).tolist()


def test_a_varlen_step_past_the_window_defers_to_torch(triton_kernels):
    """One varlen launch (the CUDA runner's steps) with a decode and a prefill chunk whose
    contexts pass Mistral's window: the torch varlen attention serves it exactly."""
    reference = random_reference(mistral).to(DEVICE)
    model = model_from_reference(reference).replace(kernels=triton_kernels)
    cache = make_cache(model, num_blocks=64, block_size=4)
    tables = BlockTables(64, seed=9)
    first = [(5 * i + 1) % 250 for i in range(30)]
    second = [(3 * i + 2) % 250 for i in range(41)]
    blocks = [tables.allocate(40, 4), tables.allocate(44, 4)]
    run_step(model, cache, [first, second[:19]], [0, 0], blocks)
    chunks = [SequenceChunk(30, 1, blocks[0]), SequenceChunk(19, 22, blocks[1])]
    flat = [77, *second[19:]]
    step = StepMetadataBuilder(4, model.device).build(chunks, flat, list(range(len(flat))))
    assert step.meta.varlen is not None
    logits = model.logits(model.forward(step.token_ids, step.meta, cache))
    expected = torch.cat(
        [reference_logits(reference, [*first, 77])[-1:], reference_logits(reference, second)[19:]]
    )
    torch.testing.assert_close(logits.cpu(), expected.cpu(), atol=ATOL, rtol=0)


def test_lora_adapters_on_the_triton_backend_equal_the_merged_models(
    tiny_llama_factory, triton_kernels, tmp_path
):
    """The CUDA path's LoRA (stacked slots, masked GEMMs, no native op) with the Triton
    kernels: a mixed batch of the base and two peft adapters, each as its merged model."""
    import copy

    peft = pytest.importorskip("peft")
    from engine.config import LoRAConfig
    from engine.lora.catalog import LoRACatalog
    from engine.lora.runtime import attach_lora
    from engine.request import Request

    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    merged, paths = {None: reference}, {}
    for seed, name in enumerate(("one", "two")):
        torch.manual_seed(seed)
        config = peft.LoraConfig(
            r=4 * (seed + 1), lora_alpha=8, target_modules=modules, init_lora_weights=False
        )
        adapted = peft.get_peft_model(copy.deepcopy(reference), config)
        paths[name] = str(tmp_path / name)
        adapted.save_pretrained(paths[name])
        merged[name] = adapted.merge_and_unload().eval()
    model = model_from_reference(reference.to(DEVICE)).replace(kernels=triton_kernels)
    lora_config = LoRAConfig(max_loras=2, max_lora_rank=8)
    model, runtime = attach_lora(model, lora_config)
    catalog = LoRACatalog(runtime.targets, model.dtype)
    scheduler = SchedulerConfig(max_model_len=32, max_num_batched_tokens=16, max_loras=2)
    core = make_core(model, CacheConfig(num_device_blocks=24, block_size=4), scheduler)
    core.runner.lora = runtime
    prompt = [5, 9, 17, 33, 65, 129, 7]
    names = [None, "one", "two"]
    for index, name in enumerate(names):
        lora = catalog.load(name, paths[name]) if name is not None else None
        core.add_request([Request(f"r{index}", list(prompt), greedy(6), lora=lora)])
    outputs = {f"r{i}": [] for i in range(len(names))}
    while core.has_unfinished():
        for delta in core.step():
            outputs[delta.request_id] += delta.new_token_ids
    for index, name in enumerate(names):
        assert outputs[f"r{index}"] == reference_greedy(merged[name], prompt, 6), name
    assert len({tuple(tokens) for tokens in outputs.values()}) == 3  # each adapter counts
