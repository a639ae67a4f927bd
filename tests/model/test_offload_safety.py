"""Block copies are bounded and a failed swap-out costs a recompute, not the engine.

- ``copy_blocks`` moves blocks in chunks through fixed staging buffers: whatever the
  chunk size, every destination block equals its source (values and quantization
  scales), and no other block changes.
- A swap-out whose copy fails (an injected ``torch.OutOfMemoryError`` that survives the
  retry, or any other error) sends its victims back to be recomputed: every request still
  completes with the same greedy output and the block pools add up after every step.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.kv import accounting
from engine.kv.accounting import KVShape
from engine.model.loader import model_from_reference
from engine.model.runtime.kv_cache import CopyStaging, KVPool, KVPoolLayout, copy_blocks
from engine.outputs import RunnerOutput, SchedulerOutput
from tests.model.engine_helpers import greedy, make_core, run_all

CPU = torch.device("cpu")


def filled_pool(shape: KVShape, num_blocks: int, block_size: int, seed: int) -> KVPool:
    pool = KVPool(KVPoolLayout(shape, num_blocks, block_size), CPU)
    generator = torch.Generator().manual_seed(seed)
    for tensor in pool.tensors():
        noise = torch.randint(0, 100, tensor.shape, generator=generator)
        tensor.copy_(noise.to(tensor.dtype))
    return pool


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("staging_bytes", [1, 700, accounting.COPY_STAGING_BYTES])
def test_chunked_copies_move_exactly_the_named_blocks(kv_dtype: str, staging_bytes: int):
    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=8, kv_dtype=kv_dtype)
    src = filled_pool(shape, num_blocks=20, block_size=4, seed=1)
    dst = filled_pool(shape, num_blocks=30, block_size=4, seed=2)
    before = [t.clone() for t in dst.tensors()]
    staging = CopyStaging(dst.layout, CPU, staging_bytes)
    assert staging.nbytes == accounting.copy_staging_bytes(shape, 4, staging_bytes)
    pairs = [(3, 29), (0, 0), (17, 5), (4, 12), (19, 13), (8, 2), (11, 27)]
    copy_blocks(src, dst, pairs, staging)
    if staging_bytes == 1:
        assert staging.chunk_blocks == 1  # seven chunks of one block
    moved = {d for _, d in pairs}
    for src_tensor, dst_tensor, old in zip(src.tensors(), dst.tensors(), before, strict=True):
        for s, d in pairs:
            assert torch.equal(dst_tensor[:, :, d], src_tensor[:, :, s])
        untouched = [b for b in range(30) if b not in moved]
        assert torch.equal(dst_tensor[:, :, untouched], old[:, :, untouched])


class FailingSwapOut:
    """Wraps the real runner; the next ``failures`` calls that swap blocks out raise
    ``error`` before copying anything, as an allocation failure in the copy would."""

    def __init__(self, runner, error: Exception, failures: int):
        self.runner = runner
        self.error = error
        self.failures = failures
        self.raised = 0

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if out.swap_out and self.failures > 0:
            self.failures -= 1
            self.raised += 1
            raise self.error
        return self.runner.execute(out)


PROMPTS = {
    "a": [5, 9, 17, 33, 65, 129, 7, 3, 2, 1, 99, 100, 101],
    "b": [11, 12],
    "c": [200, 150, 100, 50, 25, 12, 6, 3],
    "d": [42] * 21,
}


@pytest.fixture(scope="module")
def model(tiny_llama_factory):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    return model_from_reference(reference)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("error", "failures"),
    [
        (torch.OutOfMemoryError("injected: out of memory allocating the swap copy"), 2),
        (RuntimeError("injected: the swap copy failed"), 1),
    ],
    ids=["out-of-memory-twice", "runtime-error"],
)
def test_failed_swap_out_falls_back_to_recompute(model, error, failures):
    params = {rid: greedy(12) for rid in PROMPTS}
    roomy = make_core(model, CacheConfig(num_device_blocks=512, block_size=2))
    expected = run_all(roomy, PROMPTS, params)

    scheduler = SchedulerConfig(max_model_len=64, preemption_mode="swap", swap_min_tokens=1)
    cache = CacheConfig(num_device_blocks=20, block_size=2, num_host_blocks=64, watermark=0.0)
    core = make_core(model, cache, scheduler)
    failing = FailingSwapOut(core.runner, error, failures)
    core.runner = failing
    outputs = run_all(core, PROMPTS, params)  # check_integrity() after every step

    assert failing.raised == failures  # the failure really hit a swap-out (and its retry)
    assert core.executor.num_failed_swap_outs == 1
    assert outputs == expected
    stats = core.stats()
    assert stats.preemptions_total["swap"] > 0
    assert stats.host_blocks.used == 0 and stats.device_blocks.used == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_chunked_swaps_between_cuda_and_pinned_host(kv_dtype: str):
    """Device -> pinned host -> device in 1-block chunks returns every block intact."""
    cuda = torch.device("cuda")
    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=8, kv_dtype=kv_dtype)
    layout = KVPoolLayout(shape, 24, 4)
    device_pool = KVPool(layout, cuda)
    host_pool = KVPool(layout, CPU, pin_memory=True)
    assert host_pool.key.is_pinned()
    for tensor in device_pool.tensors():
        tensor.copy_(torch.randint(0, 100, tensor.shape, device=cuda).to(tensor.dtype))
    original = [t.clone() for t in device_pool.tensors()]
    staging = CopyStaging(layout, cuda, staging_bytes=1)
    out_pairs = [(5, 0), (9, 1), (2, 2), (23, 3)]
    copy_blocks(device_pool, host_pool, out_pairs, staging)
    for tensor in device_pool.tensors():
        tensor.zero_()
    copy_blocks(host_pool, device_pool, [(h, d) for d, h in out_pairs], staging)
    torch.cuda.synchronize()
    for tensor, before in zip(device_pool.tensors(), original, strict=True):
        blocks = [d for d, _ in out_pairs]
        assert torch.equal(tensor[:, :, blocks], before[:, :, blocks])
