"""Truncation (top-k, top-p, min-p) keeps exactly the set transformers keeps.

transformers applies its warpers in the order temperature -> top-k -> top-p -> min-p,
each on the distribution the previous one left (renormalised); vLLM does the same. The
reference here is transformers' own logits processors, on random distributions and
random parameter mixes, batched the way the engine batches them (one row per request,
each with its own parameters).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.request import SamplingParams
from engine.sampler import Sampler, SamplingRow, apply_truncation

VOCAB = 64


def reference_kept(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """The token ids transformers' warpers leave finite for one row."""
    scores = logits.unsqueeze(0).clone()
    input_ids = torch.zeros(1, 1, dtype=torch.long)
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        warpers.append(MinPLogitsWarper(params.min_p))
    for warper in warpers:
        scores = warper(input_ids, scores)
    return set(torch.isfinite(scores[0]).nonzero().flatten().tolist())


def kvserve_kept(logits: torch.Tensor, rows: list[SamplingRow]) -> list[set[int]]:
    temperature = torch.tensor([r.params.temperature for r in rows]).unsqueeze(1)
    probs = torch.softmax(logits / temperature, dim=-1)
    kept = apply_truncation(probs, rows) > 0
    return [set(k.nonzero().flatten().tolist()) for k in kept]


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.5]),
        top_k=rng.choice([0, 1, 2, 3, 5, 10, 40]),
        top_p=rng.choice([1.0, 0.95, 0.8, 0.6, 0.3, 0.1]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.2, 0.5]),
    )


def test_top_k_then_top_p_on_the_renormalised_distribution():
    # The example: after top-k=3 the mass is (0.43, 0.29, 0.29); top-p 0.6 keeps 2.
    probs = torch.tensor([0.3, 0.2, 0.2, 0.1, 0.1, 0.05, 0.05])
    params = SamplingParams(top_k=3, top_p=0.6)
    rows = [SamplingRow("r", params, [], [])]
    # Tokens 1 and 2 tie, so which of them stays is the sort's choice; the count is not.
    (kept,) = kvserve_kept(probs.log().unsqueeze(0), rows)
    assert 0 in kept and len(kept) == 2
    reference = reference_kept(probs.log(), params)
    assert 0 in reference and len(reference) == 2


@pytest.mark.parametrize("seed", range(8))
def test_kept_sets_match_transformers_on_random_batches(seed: int):
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    batch = 32
    # Peaked and flat rows alike: logits scaled between 0.5 and 4.
    scale = torch.rand(batch, 1, generator=generator) * 3.5 + 0.5
    logits = torch.randn(batch, VOCAB, generator=generator) * scale
    rows = [SamplingRow(f"r{i}", random_params(rng), [], []) for i in range(batch)]
    got = kvserve_kept(logits, rows)
    for i, row in enumerate(rows):
        assert got[i] == reference_kept(logits[i], row.params), row.params


def test_sampled_tokens_stay_inside_the_reference_set():
    rng = random.Random(5)
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    rows = [SamplingRow(f"r{i}", random_params(rng), [], []) for i in range(16)]
    sampler = Sampler(seed=3)
    for _ in range(50):
        tokens = sampler.sample(logits, rows).token_ids
        for i, token in enumerate(tokens):
            assert token in reference_kept(logits[i], rows[i].params)
