"""The verification of drafts keeps the target distribution (chi-square on a toy
vocabulary), and greedy verification keeps exactly the argmax chain."""

from __future__ import annotations

import torch

from engine.outputs import ScheduledRequest
from engine.request import SamplingParams
from engine.sampler import Sampler, SamplingRow, apply_truncation
from engine.speculative.verify import verify

VOCAB = 6
# Chi-square 0.999 quantile with VOCAB - 1 = 5 degrees of freedom: a correct sampler
# exceeds it once in a thousand seeds; a biased one by orders of magnitude.
CHI2_999_DF5 = 20.52
SAMPLES = 20_000


def scheduled(rid: str, drafts: list[int], params: SamplingParams) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=rid,
        token_ids=[1, *drafts],
        num_computed_tokens=10,
        block_tables=[[]],
        sample=True,
        sampling_params=params,
        prompt_token_ids=[3] * 10,
        output_token_ids=[1],
        num_draft_tokens=len(drafts),
    )


def target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What plain sampling draws from: softmax at the temperature, then truncation."""
    row = SamplingRow("x", params, [], [])
    probs = torch.softmax(logits.unsqueeze(0) / params.temperature, dim=-1)
    probs = apply_truncation(probs, [row])[0]
    return probs / probs.sum()


def chi_square(observed: list[int], expected: torch.Tensor) -> float:
    total = sum(observed)
    stat = 0.0
    for count, p in zip(observed, expected.tolist(), strict=True):
        if p == 0:
            assert count == 0, "a token of probability zero was emitted"
            continue
        stat += (count - total * p) ** 2 / (total * p)
    return stat


def run(logits: torch.Tensor, drafts: list[int], params: SamplingParams) -> list[list[int]]:
    requests = [scheduled(f"r{i}", drafts, params) for i in range(SAMPLES)]
    batch = logits.repeat(SAMPLES, 1)
    results = verify(Sampler(seed=7), batch, requests)
    return [results[r.request_id].token_ids for r in requests]


def test_each_emitted_token_follows_the_target_distribution():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=generator) * 1.5
    drafts = [2, 4]
    params = SamplingParams(temperature=0.8, max_tokens=10)
    emitted = run(logits, drafts, params)
    first = [0] * VOCAB
    second = [0] * VOCAB
    third = [0] * VOCAB
    for tokens in emitted:
        assert 1 <= len(tokens) <= 3
        assert tokens[:-1] == drafts[: len(tokens) - 1]  # only accepted drafts precede
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
        if len(tokens) > 2:
            third[tokens[2]] += 1
    assert chi_square(first, target(logits[0], params)) < CHI2_999_DF5
    # Given the first draft was emitted, the next token follows row 1 (the draft's
    # acceptance and the residual draw together), and after both drafts row 2.
    assert chi_square(second, target(logits[1], params)) < CHI2_999_DF5
    assert chi_square(third, target(logits[2], params)) < CHI2_999_DF5


def test_truncation_applies_and_a_draft_outside_it_is_always_rejected():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, -1.0, -3.0], [0.0] * VOCAB])
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=10)
    emitted = run(logits, [5], params)  # token 5 is outside the top 3
    first = [0] * VOCAB
    for tokens in emitted:
        assert len(tokens) == 1
        first[tokens[0]] += 1
    assert chi_square(first, target(logits[0], params)) < CHI2_999_DF5


def test_greedy_accepts_the_argmax_chain_and_corrects_the_first_miss():
    logits = torch.full((4, VOCAB), -1.0)
    for row, best in enumerate([3, 1, 2, 5]):
        logits[row, best] = 1.0
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1)
    requests = [
        scheduled("all", [3, 1, 2], params),
        scheduled("miss", [3, 4, 2], params),
        scheduled("none", [0, 1, 2], params),
    ]
    results = verify(Sampler(), logits.repeat(3, 1), requests)
    assert results["all"].token_ids == [3, 1, 2, 5]
    assert results["miss"].token_ids == [3, 1]
    assert results["none"].token_ids == [3]
    logprobs = results["miss"].logprobs
    assert logprobs is not None and [e.token_id for e in logprobs] == [3, 1]
    expected = torch.log_softmax(logits[0], dim=-1)[3].item()
    assert abs(logprobs[0].logprob - expected) < 1e-6
