"""Cross-encoders as decoder ``*ForSequenceClassification`` checkpoints in a real
EngineCore: a tiny random Llama and Qwen3 classifier saved with ``save_pretrained`` load
through kvserve's loader with their ``score`` head, and classification pooling gives
transformers' ``model(input_ids).logits`` for several (query, document) sequences in one
step, in chunks shorter than a prompt, beside greedy generation, and again from the
prefix cache; nothing is left behind. Every other family with a transformers classifier
class loads and pools its head the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.model.loader import ModelSource, load_model
from engine.request import PoolingParams, Request, SamplingParams
from tests.model import family_models
from tests.model.engine_helpers import greedy, make_core, reference_greedy

# fp32 on both sides; the paged attention sums in another order than transformers' SDPA.
ATOL = 1e-4
CLASSIFY = SamplingParams(max_tokens=0, pooling=PoolingParams("last", classify=True))
# Token ids of (query, document) pairs as a tokenizer joins them; "long" is longer than
# the chunked budget below (16 tokens), so it is pooled from its last chunk.
PAIRS = {
    "short": [1, 17, 40, 9, 2, 88, 91],
    "mid": [1, 5, 6, 7, 8, 2, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40],
    "long": [1, *range(100, 112), 2, *range(150, 190)],
    "again": [1, 17, 40, 9, 2, 60, 61, 62],  # shares "short"'s query
}
# No LM head in the checkpoint: generation reads the embedding, as kvserve does.
SIZES: dict[str, Any] = family_models.base(tie_word_embeddings=True)


def llama_classifier(num_labels: int) -> Any:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    return LlamaForSequenceClassification(LlamaConfig(**SIZES, num_labels=num_labels))


def qwen3_classifier(num_labels: int) -> Any:
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    config = Qwen3Config(**SIZES, head_dim=16, num_labels=num_labels)
    return Qwen3ForSequenceClassification(config)


FAMILIES = {"llama": llama_classifier, "qwen3": qwen3_classifier}


def save_classifier(path: Path, family: str, num_labels: int = 1) -> Any:
    """A random fp32 classifier (weights scaled up so the logits spread) saved to ``path``;
    returns the reference model."""
    torch.manual_seed(7)
    model = FAMILIES[family](num_labels).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    return model


def reference_logits(reference: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].float()


def run(core: Any, requests: list[Request]) -> dict[str, list[Any]]:
    results: dict[str, list[Any]] = {r.request_id: [] for r in requests}
    for request in requests:
        core.add_request([request])
    while core.has_unfinished():
        for delta in core.step():
            if delta.pooled is not None:
                results[delta.request_id] = delta.pooled
            else:
                results[delta.request_id].extend(delta.new_token_ids)
        core.scheduler.check_integrity()
    assert core.stats().device_blocks.used == 0
    return results


def engine(path: Path, budget: int) -> Any:
    model = load_model(ModelSource.from_path(path), torch.float32, torch.device("cpu"), 512)
    return make_core(
        model,
        CacheConfig(num_device_blocks=128, block_size=4),
        SchedulerConfig(max_num_batched_tokens=budget, min_prefill_tokens=1),
    )


@pytest.mark.parametrize("budget", [2048, 16])  # one step, or chunks of 16 tokens
@pytest.mark.parametrize("family", list(FAMILIES))
def test_classifier_logits_match_transformers(tmp_path, family, budget):
    reference = save_classifier(tmp_path, family)
    core = engine(tmp_path, budget)
    assert core.runner.model.spec.num_labels == 1
    requests = [Request(name, list(ids), CLASSIFY) for name, ids in PAIRS.items()]
    chat = Request("chat", [3, 4, 5, 6, 7], greedy(6))
    results = run(core, [chat, *requests])
    for name, ids in PAIRS.items():
        got = torch.tensor(results[name])
        torch.testing.assert_close(got, reference_logits(reference, ids), atol=ATOL, rtol=0)
    # The checkpoint has no LM head; a causal LM from the same directory ties it to the
    # embedding, which is what kvserve generates with (the server refuses generation on
    # a classifier, the engine just runs the rows it is given).
    from transformers import AutoModelForCausalLM

    causal = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert results["chat"] == reference_greedy(causal, [3, 4, 5, 6, 7], 6)
    # The same pairs again: their prompts come from the prefix cache, their last
    # position is recomputed, the logits are the same.
    hits = core.stats().prefix_cache_hits_total
    again = run(core, [Request(f"{n}-2", list(ids), CLASSIFY) for n, ids in PAIRS.items()])
    assert core.stats().prefix_cache_hits_total > hits
    for name in PAIRS:
        torch.testing.assert_close(
            torch.tensor(again[f"{name}-2"]), torch.tensor(results[name]), atol=ATOL, rtol=0
        )


def test_every_label_of_a_multi_label_head(tmp_path):
    reference = save_classifier(tmp_path, "llama", num_labels=3)
    core = engine(tmp_path, 16)
    results = run(core, [Request(name, list(ids), CLASSIFY) for name, ids in PAIRS.items()])
    for name, ids in PAIRS.items():
        got = torch.tensor(results[name])
        assert got.shape == (3,)
        torch.testing.assert_close(got, reference_logits(reference, ids), atol=ATOL, rtol=0)


# Every family of tests/model/family_models.py whose transformers class has a
# *ForSequenceClassification (granite has none).
CLASSIFIER_CLASSES = {
    "llama": "LlamaForSequenceClassification",
    "mistral": "MistralForSequenceClassification",
    "ministral": "MinistralForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
    "phi3": "Phi3ForSequenceClassification",
    "olmo2": "Olmo2ForSequenceClassification",
    "mixtral": "MixtralForSequenceClassification",
    "qwen3_moe": "Qwen3MoeForSequenceClassification",
    "gpt_oss": "GptOssForSequenceClassification",
    "gemma2": "Gemma2ForSequenceClassification",
    "gemma3_text": "Gemma3TextForSequenceClassification",
    "gemma3": "Gemma3ForSequenceClassification",  # the multimodal checkpoint's text model
}


@pytest.mark.parametrize("family", list(CLASSIFIER_CLASSES))
def test_every_family_with_a_classifier_class_loads_its_head(tmp_path, family):
    """The family tests' tiny random models (tests/model/family_models.py), as
    classifiers: saved, loaded and pooled in 20-token chunks, their logits equal
    transformers'. The served context is LongRoPE's short one (phi3), as transformers
    picks it for prompts this short."""
    import transformers

    build, block_size = family_models.FAMILIES[family]
    config = build().config
    config.num_labels = 1
    config.pad_token_id = None  # transformers then reads the last position, as kvserve does
    cls = getattr(transformers, CLASSIFIER_CLASSES[family])
    reference = family_models.random_reference(lambda: cls(config)).float()
    reference.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(ModelSource.from_path(tmp_path), torch.float32, torch.device("cpu"), 512, 64)
    core = make_core(
        model,
        CacheConfig(num_device_blocks=128, block_size=block_size),
        SchedulerConfig(max_num_batched_tokens=family_models.CHUNK, min_prefill_tokens=1),
    )
    prompts = {str(i): list(ids) for i, ids in enumerate(family_models.PROMPTS)}
    results = run(core, [Request(name, ids, CLASSIFY) for name, ids in prompts.items()])
    for name, ids in prompts.items():
        got = torch.tensor(results[name])
        torch.testing.assert_close(got, reference_logits(reference, ids), atol=ATOL, rtol=0)


def test_classify_is_read_at_the_last_position_only():
    with pytest.raises(ValueError, match="last position"):
        PoolingParams("mean", classify=True)
    with pytest.raises(ValueError, match="two poolings"):
        PoolingParams("last", token_ids=(1,), classify=True)
