"""Per-row sampling parameters reach the device without a host sync (on CUDA), and are the
same values as ``torch.tensor`` builds (everywhere)."""

from __future__ import annotations

import pytest
import torch

from engine.device_tensor import to_device
from engine.request import SamplingParams
from engine.sampler import Sampler, SamplingRow


@pytest.mark.parametrize(
    ("values", "dtype"),
    [([1, 2, 3], None), ([0.5, 2.0], None), ([True, False], None), ([7], torch.long)],
)
def test_same_tensor_as_torch_tensor(values, dtype):
    got = to_device(values, torch.device("cpu"), dtype)
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_sampling_a_mixed_batch_makes_no_host_sync_before_reading_the_ids():
    device = torch.device("cuda")
    logits = torch.randn(4, 64, device=device)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5, min_tokens=3, logit_bias=((3, 2.0),)),
        SamplingParams(temperature=1.2, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=0.9, seed=11),
    ]
    rows = [SamplingRow(f"r{i}", p, [1, 2], [5], seed=p.seed) for i, p in enumerate(params)]
    sampler = Sampler(eos_token_ids=(0,))
    sampler._choose(sampler.process(logits, rows), rows)  # warm-up: generators, caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sampler._choose(sampler.process(logits, rows), rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(tokens.tolist()) == 4
