"""Penalty counts kept on the device between steps equal the full rebuild from the token
lists, step after step, through discarded steps, preemption, n > 1 and forgotten ids."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.model.loader import model_from_reference
from engine.penalty_state import PenaltyState
from engine.request import Request, SamplingParams
from engine.sampler import SamplingRow, apply_penalties, token_counts
from tests.model.engine_helpers import make_core

VOCAB = 48
PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.6)


def test_tracked_counts_equal_the_rebuild_over_many_steps():
    """A simulated batch: requests arrive, grow, lose a step's token (a discarded result
    never reaches the output list), stall (preempted, outputs kept), roll back, finish;
    ids are reused after ``forget``. Every step the penalised logits must be identical."""
    rng = random.Random(0)
    state = PenaltyState(initial_rows=2)
    live: dict[str, tuple[SamplingParams, list[int], list[int]]] = {}
    next_id = 0
    for step in range(300):
        if len(live) < 6 and rng.random() < 0.3:
            params = SamplingParams(
                **{
                    k: rng.choice([v, 0.0 if k != "repetition_penalty" else 1.0])
                    for k, v in PENALTIES.items()
                }
            )
            if not params.needs_penalties:
                params = SamplingParams(frequency_penalty=0.2)
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
            live[f"r{next_id % 9}"] = (params, prompt, [])  # ids come back after forget
            next_id += 1
        rows = []
        for request_id, (params, prompt, output) in live.items():
            if rng.random() < 0.2:
                continue  # preempted or not scheduled this step: outputs kept
            rows.append(SamplingRow(request_id, params, prompt, output))
        if rows:
            logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(step))
            tracked = apply_penalties(logits.clone(), rows, state)
            rebuilt = apply_penalties(logits.clone(), rows)
            torch.testing.assert_close(tracked, rebuilt, rtol=0, atol=0)
            for row in rows:
                if rng.random() < 0.1:
                    continue  # the step's result was discarded
                row.output_token_ids.append(rng.randrange(VOCAB))
                if rng.random() < 0.03:
                    del row.output_token_ids[-3:]  # a rollback
        done = [rid for rid, (_, _, output) in live.items() if len(output) > rng.randint(5, 40)]
        for request_id in done:
            del live[request_id]
        state.forget(done)
        assert len(state) <= len(live)


def test_counts_of_a_request_match_token_counts():
    state = PenaltyState()
    prompt, output = [1, 2, 2, 7], [3, 3, 3, 1]
    counts, seen = state.counts(["r"], [prompt], [output], VOCAB, torch.device("cpu"))
    expected = token_counts([output], VOCAB, torch.device("cpu"))
    assert torch.equal(counts, expected)
    assert seen[0].nonzero().flatten().tolist() == [1, 2, 3, 7]
    output.append(7)
    counts, _ = state.counts(["r"], [prompt], [output], VOCAB, torch.device("cpu"))
    assert counts[0, 7] == 1 and counts[0, 3] == 3
    state.forget(["r"])
    assert len(state) == 0


class RebuildingPenalties(PenaltyState):
    """The old behaviour: counts rebuilt from the full token lists every step."""

    def counts(self, request_ids, prompts, outputs, vocab, device):
        output_counts = token_counts(outputs, vocab, device)
        seen = (token_counts(prompts, vocab, device) > 0) | (output_counts > 0)
        return output_counts, seen


@pytest.fixture(scope="module")
def model(tiny_llama_factory):
    _, reference = tiny_llama_factory(num_heads=4, num_kv_heads=2)
    return model_from_reference(reference)


PROMPTS = {"a": [5, 9, 17, 33, 65, 129, 7, 3, 2], "b": [11, 12, 11, 12], "c": [42] * 13}


def run_groups(core, n: int) -> dict[str, list[int]]:
    """Every prompt as one client request of ``n`` seeded, penalised choices."""
    outputs: dict[str, list[int]] = {}
    for group, prompt in PROMPTS.items():
        params = SamplingParams(
            max_tokens=14, temperature=0.8, seed=7, n=n, ignore_eos=True, **PENALTIES
        )
        requests = [
            Request(f"{group}-{i}", list(prompt), params, group_id=group, index=i) for i in range(n)
        ]
        core.add_request(requests)
        outputs.update({r.request_id: [] for r in requests})
    while core.has_unfinished():
        for delta in core.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
        core.scheduler.check_integrity()
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_outputs_equal_the_rebuild_under_preemption_with_n_choices(model, mode, monkeypatch):
    roomy = make_core(model, CacheConfig(num_device_blocks=256, block_size=2))
    expected = run_groups(roomy, n=3)
    roomy.step()  # an idle step hands the last finished ids to the runner
    assert len(roomy.runner.sampler._penalties) == 0  # every finished request forgotten

    scheduler = SchedulerConfig(max_model_len=64, preemption_mode=mode, swap_min_tokens=1)
    tight = CacheConfig(num_device_blocks=20, block_size=2, num_host_blocks=64, watermark=0.0)
    core = make_core(model, tight, scheduler)
    assert run_groups(core, n=3) == expected
    assert sum(core.stats().preemptions_total.values()) > 0

    monkeypatch.setattr("engine.sampler.PenaltyState", RebuildingPenalties)
    rebuilt = run_groups(make_core(model, tight, scheduler), n=3)
    assert rebuilt == expected
    assert len({tuple(v) for v in expected.values()}) > 3  # choices really differ
