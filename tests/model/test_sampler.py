"""Sampler: every control does what it says, vectorised over mixed rows."""

from __future__ import annotations

import math

import pytest
import torch

from engine.request import SamplingParams
from engine.sampler import Sampler, SamplingRow, apply_penalties, greedy_tokens

VOCAB = 32


def row(rid: str = "r", prompt=(), output=(), seed=None, **params) -> SamplingRow:
    return SamplingRow(rid, SamplingParams(**params), list(prompt), list(output), seed)


def logits_for(*rows_of_values: list[float]) -> torch.Tensor:
    return torch.tensor(rows_of_values, dtype=torch.float32)


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_rows_take_the_argmax_next_to_sampled_rows():
    logits = random_logits(4)
    rows = [row("a", temperature=0.0), row("b"), row("c", temperature=0.0), row("d", seed=1)]
    tokens = Sampler().sample(logits, rows).token_ids
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [VOCAB, 49152])  # SmolLM2's vocabulary: vectorised paths
def test_greedy_tokens_are_argmax_ties_and_nans_included(dtype, width):
    """The first index of a row's maximum, as argmax defines it: ties go to the lower
    index, a NaN wins over every number, -inf rows pick index 0."""
    logits = torch.randn(6, width, generator=torch.Generator().manual_seed(3)).to(dtype)
    logits[1, [5, width - 3]] = 50.0  # a tie across the row
    logits[2, [width - 9, width - 2]] = 50.0  # a tie in the tail
    logits[3, width // 2] = float("nan")
    logits[4] = float("-inf")
    logits[5, [0, 1]] = 50.0
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(logits)[1] == 5 and greedy_tokens(logits)[3] == width // 2


def test_same_seed_same_tokens_whatever_the_batch():
    base = random_logits(1, seed=3)
    alone = Sampler(seed=11)
    crowded = Sampler(seed=99)
    target = row("x", seed=1234, temperature=1.5)
    solo, mixed = [], []
    for step in range(20):
        solo += alone.sample(base, [target]).token_ids
        others = [row(f"o{i}", temperature=1.0) for i in range(step % 5)]
        batch = torch.cat([random_logits(len(others), seed=step), base]) if others else base
        mixed.append(crowded.sample(batch, [*others, target]).token_ids[-1])
    assert solo == mixed
    assert len(set(solo)) > 1  # it really sampled


def test_different_seeds_give_different_streams():
    logits = torch.zeros(1, VOCAB)
    streams = []
    for seed in (1, 2):
        sampler = Sampler()
        streams.append(
            [sampler.sample(logits, [row("r", seed=seed)]).token_ids[0] for _ in range(20)]
        )
    assert streams[0] != streams[1]


def test_forget_restarts_a_seeded_stream():
    logits = torch.zeros(1, VOCAB)
    sampler = Sampler()
    first = [sampler.sample(logits, [row("r", seed=5)]).token_ids[0] for _ in range(10)]
    sampler.forget(["r"])
    again = [sampler.sample(logits, [row("r", seed=5)]).token_ids[0] for _ in range(10)]
    assert first == again


def draw_many(logits_row: torch.Tensor, n: int = 4000, **params) -> torch.Tensor:
    """n independent draws from one row (as n batch rows, unseeded)."""
    rows = [row(f"r{i}", **params) for i in range(n)]
    tokens = Sampler(seed=7).sample(logits_row.expand(n, -1).clone(), rows).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.shape[-1])


def test_temperature_sampling_follows_the_softmax():
    values = torch.tensor([2.0, 1.0, 0.0, -1.0] + [-30.0] * (VOCAB - 4))
    counts = draw_many(values, n=8000, temperature=2.0)
    expected = torch.softmax(values / 2.0, dim=-1) * 8000
    assert counts[4:].sum() == 0
    for i in range(4):
        assert abs(counts[i] - expected[i]) < 5 * math.sqrt(expected[i]) + 5


def test_top_k_top_p_min_p_truncate_the_distribution():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    values = probs.log()
    assert set(draw_many(values, top_k=2).nonzero().flatten().tolist()) == {0, 1}
    # top_p 0.6: mass before token 2 is 0.65 >= 0.6 -> tokens 0 and 1 only.
    assert set(draw_many(values, top_p=0.6).nonzero().flatten().tolist()) == {0, 1}
    # min_p 0.3: keep p >= 0.12 -> tokens 0, 1, 2.
    assert set(draw_many(values, min_p=0.3).nonzero().flatten().tolist()) == {0, 1, 2}
    assert set(draw_many(values, top_k=1).nonzero().flatten().tolist()) == {0}


def test_penalties_match_their_definitions():
    base = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0, 1.0]])
    captured = apply_penalties(
        base.clone(),
        [
            row(
                prompt=[0],
                output=[1, 3, 3],
                repetition_penalty=2.0,
                frequency_penalty=0.5,
                presence_penalty=0.25,
            )
        ],
    )
    expected = base.clone()
    expected[0, 0] = 2.0 / 2.0  # prompt token, positive: divided
    expected[0, 1] = -1.0 * 2.0 - 0.5 * 1 - 0.25  # output once, negative: multiplied
    expected[0, 3] = 3.0 / 2.0 - 0.5 * 2 - 0.25  # output twice
    torch.testing.assert_close(captured, expected)


def test_logit_bias_forces_and_bans_tokens():
    logits = random_logits(2)
    rows = [
        row("a", logit_bias=((7, 100.0),)),
        row("b", temperature=0.0, logit_bias=((int(logits[1].argmax()), -100.0),)),
    ]
    tokens = Sampler().sample(logits, rows).token_ids
    assert tokens[0] == 7
    assert tokens[1] != int(logits[1].argmax())


@pytest.mark.parametrize(("outputs", "masked"), [(0, True), (2, True), (3, False)])
def test_min_tokens_masks_eos_and_stop_ids(outputs, masked):
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 50.0  # EOS
    logits[0, 9] = 49.0  # a stop token id
    params = dict(temperature=0.0, min_tokens=3, stop_token_ids=(9,))
    token = Sampler(eos_token_ids=(2,)).sample(logits, [row(output=[5] * outputs, **params)])
    assert (token.token_ids[0] not in (2, 9)) if masked else token.token_ids[0] == 2


def test_logprobs_are_the_raw_log_softmax_with_sorted_alternatives():
    logits = random_logits(3)
    rows = [row("a", temperature=0.0, logprobs=3), row("b", logprobs=0), row("c")]
    result = Sampler().sample(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    first = result.logprobs[0]
    assert first is not None and first.token_id == result.token_ids[0]
    assert first.logprob == pytest.approx(float(reference[0].max()), abs=1e-5)
    assert [t for t, _ in first.top] == reference[0].topk(3).indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(
        reference[0].topk(3).values.tolist(), abs=1e-5
    )
    second = result.logprobs[1]
    assert second is not None and second.top == ()
    assert second.logprob == pytest.approx(float(reference[1, result.token_ids[1]]), abs=1e-5)
    assert result.logprobs[2] is None


def test_tokens_of_zero_probability_are_never_drawn():
    """Masked logits (a grammar's -inf, a banned token) have zero probability: the inverse
    CDF never lands on them, at either end of the vocabulary or between allowed tokens."""
    logits = torch.full((64, VOCAB), float("-inf"))
    allowed = [1, 2, 7, VOCAB - 2]
    logits[:, allowed] = torch.randn(64, len(allowed))
    rows = [row(f"r{i}", seed=i if i % 2 else None, temperature=1.5) for i in range(64)]
    sampler = Sampler()
    drawn: set[int] = set()
    for _ in range(50):
        drawn.update(sampler.sample(logits.clone(), rows).token_ids)
    assert drawn == set(allowed)
