"""Pooling requests (embeddings, reranker scores) in a real EngineCore: the vectors equal
transformers' final hidden states pooled the same way (fp32), whether the prompt is
computed in one step or in chunks, beside greedy generation, and after preemption; no
block is left behind."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.model.loader import model_from_reference
from engine.request import PoolingParams, Request, SamplingParams
from engine.sched.preemption import requeue_for_recompute
from tests.model.engine_helpers import greedy, make_core, reference_greedy

# fp32 on both sides; the paged attention sums in another order than transformers' SDPA.
ATOL = 1e-4

PROMPTS = {
    "short": [5, 6, 7],
    "mid": [11, 200, 3, 17, 99, 4, 5, 8, 9, 10, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    "long": list(range(30, 30 + 53)),
}


def reference_pooled(reference, ids: list[int], pooling: PoolingParams) -> torch.Tensor:
    with torch.no_grad():
        out = reference(torch.tensor([ids]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0].float()  # after the final norm
    if pooling.token_ids:
        return out.logits[0, -1].float()[list(pooling.token_ids)]
    if pooling.kind == "mean":
        return hidden.mean(dim=0)
    if pooling.kind == "cls":
        return hidden[0]
    return hidden[-1]


def embed(pooling: PoolingParams) -> SamplingParams:
    return SamplingParams(max_tokens=0, pooling=pooling)


POOLINGS = {
    "last": PoolingParams("last"),
    "mean": PoolingParams("mean"),
    "cls": PoolingParams("cls"),
    "yes_no": PoolingParams("last", token_ids=(42, 7)),
}


def run(core, requests: list[Request]) -> dict[str, object]:
    results: dict[str, object] = {r.request_id: [] for r in requests}
    for request in requests:
        core.add_request([request])
    for _ in range(10_000):
        if not core.has_unfinished():
            break
        for delta in core.step():
            if delta.pooled is not None:
                results[delta.request_id] = delta.pooled
            else:
                results[delta.request_id].extend(delta.new_token_ids)  # type: ignore[union-attr]
        core.scheduler.check_integrity()
    assert not core.has_unfinished()
    assert core.stats().device_blocks.used == 0
    return results


@pytest.mark.parametrize("budget", [2048, 16])  # one step, or chunks of 16 tokens
def test_pooled_vectors_match_transformers_beside_generation(tiny_llama_factory, budget):
    _, reference = tiny_llama_factory(num_kv_heads=2)
    model = model_from_reference(reference)
    core = make_core(
        model,
        CacheConfig(num_device_blocks=256, block_size=4),
        SchedulerConfig(max_num_batched_tokens=budget, min_prefill_tokens=1),
    )
    requests = [
        Request(f"{name}-{kind}", list(prompt), embed(pooling))
        for name, prompt in PROMPTS.items()
        for kind, pooling in POOLINGS.items()
    ]
    chat = Request("chat", [1, 2, 3, 4, 5, 6], greedy(8))
    results = run(core, [chat, *requests])
    assert results["chat"] == reference_greedy(reference, [1, 2, 3, 4, 5, 6], 8)
    for request in requests:
        name, kind = request.request_id.split("-")
        expected = reference_pooled(reference, PROMPTS[name], POOLINGS[kind])
        got = torch.tensor(results[request.request_id])
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_pooling_survives_preemption_mid_prompt(tiny_llama_factory):
    """A "mean" request preempted (recompute) after some of its chunks starts its
    vector afresh and still equals the reference; nothing is left behind."""
    _, reference = tiny_llama_factory(num_kv_heads=2)
    model = model_from_reference(reference)
    core = make_core(
        model,
        CacheConfig(num_device_blocks=64, block_size=4),
        SchedulerConfig(max_num_batched_tokens=8, min_prefill_tokens=1),
    )
    prompt = list(range(40, 70))
    request = Request("p", prompt, embed(POOLINGS["mean"]))
    core.add_request([request])
    vector = None
    preempted = False
    while core.has_unfinished():
        for delta in core.step():
            vector = delta.pooled
        if not preempted and request.num_computed_tokens >= 16:
            scheduler = core.scheduler
            scheduler.running.remove(request)
            requeue_for_recompute(scheduler, request)  # what a recompute preemption does
            preempted = True
        core.scheduler.check_integrity()
    assert preempted and vector is not None
    assert core.stats().device_blocks.used == 0
    expected = reference_pooled(reference, prompt, POOLINGS["mean"])
    torch.testing.assert_close(torch.tensor(vector), expected, atol=ATOL, rtol=0)


def test_pooling_needs_prefill_only():
    with pytest.raises(ValueError, match="max_tokens 0"):
        SamplingParams(max_tokens=1, pooling=PoolingParams())
    with pytest.raises(ValueError, match="last position"):
        PoolingParams("mean", token_ids=(1, 2))
