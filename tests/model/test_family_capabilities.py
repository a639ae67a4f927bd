"""The full-attention families through the real engine on every path that moves or drops
a block: prefix hits, chunked prefill, recompute and swap preemption, and speculative
decoding. Greedy tokens must equal transformers' for the torch and native kernels, as
test_hybrid_engine.py asks of the sliding-window families (whose scenarios these are)."""

from __future__ import annotations

from typing import Any

import pytest

from engine.model.loader import model_from_reference
from tests.model.engine_helpers import reference_greedy
from tests.model.family_models import FAMILIES, base, random_reference
from tests.model.test_hybrid_engine import MAX_TOKENS, PROMPTS, SCENARIOS, check_scenario

FULL_ATTENTION = ("qwen3", "phi3", "olmo2", "granite", "mixtral", "qwen3_moe")
# Blocks of 4 tokens that admit "b" (15) and "c" (11) together but not their growth by
# MAX_TOKENS each (20 + 16): the second scenario part preempts.
TIGHT_POOL = 28


def phi3_without_longrope() -> Any:
    """Phi-3's fused projections and partial rotary with plain RoPE. With LongRoPE,
    transformers re-rotates the whole sequence with the long factors once it passes the
    original context, which no KV cache can do; kvserve fixes the factors by the served
    context, checked in test_model_families.py's LongRoPE test."""
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    return Phi3ForCausalLM(Phi3Config(**base(), rope_parameters=rope, pad_token_id=0))


BUILDERS = {name: FAMILIES[name][0] for name in FULL_ATTENTION} | {"phi3": phi3_without_longrope}


@pytest.fixture(scope="module", params=FULL_ATTENTION)
def family(request: pytest.FixtureRequest) -> tuple[str, Any, dict[str, list[int]]]:
    reference = random_reference(BUILDERS[request.param])
    expected = {rid: reference_greedy(reference, p, MAX_TOKENS) for rid, p in PROMPTS.items()}
    return request.param, reference, expected


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_tokens_equal_transformers_on_every_block_path(
    family, kernels, scenario: str
) -> None:
    _, reference, expected = family
    model = model_from_reference(reference).replace(kernels=kernels)
    assert not model.spec.kv_shape("float32").is_hybrid
    check_scenario(model, scenario, expected, tight_pool=TIGHT_POOL)
