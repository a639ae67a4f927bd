"""The LoRA metrics of an engine serving adapters: ``kvserve_lora_requests_info`` read as
the Gateway API Inference Extension's EPP reads it while adapters run and wait for a slot,
and the per-adapter counters of finished choices.

A tiny random Llama with three PEFT adapters, two slots (``max_loras=2``): requests on all
three adapters plus one on the base model, so the scheduler holds the third adapter's
request back (tests/unit/test_scheduler_lora.py tests that bound itself). The metrics come
from ``ServerMetrics`` over the engine's own stats snapshot, rendered and parsed as a
scrape; the live HTTP path (a request naming an adapter in ``model``) is the API's.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.builder import BuiltEngine, build_engine
from engine.config import EngineArgs, LoRAConfig
from engine.outputs import RequestDelta
from engine.request import Request, SamplingParams
from server.metrics import RequestRecord, ServerMetrics
from tests.model.family_models import llama
from tests.model.test_family_serving import saved_model
from tests.server.test_metrics_gateway_protocol import LoRAView, epp_lora_view

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
ADAPTERS = ("alpha", "beta", "gamma")
MAX_TOKENS = 6
PROMPT = list(range(10, 30))


@pytest.fixture(scope="module")
def built(smollm_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> BuiltEngine:
    """The tiny Llama serving three rank-4 adapters through two slots."""
    root = tmp_path_factory.mktemp("lora-metrics")
    base = saved_model(llama, smollm_tokenizer, root / "base")
    modules = []
    for name in ADAPTERS:
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        peft.get_peft_model(copy.deepcopy(base), config).save_pretrained(root / name)
        modules.append((name, str(root / name)))
    args = EngineArgs(
        model=str(root / "base"),
        device="cpu",
        dtype="float32",
        kv_cache_memory_gib=4 / 1024,
        max_model_len=128,
        max_num_seqs=8,
        swap_space_gib=0,
        lora=LoRAConfig(max_loras=2, max_lora_rank=8, modules=tuple(modules)),
    )
    return build_engine(args)


def scrape(metrics: ServerMetrics) -> dict[str, Any]:
    body, _ = metrics.render()
    return {family.name: family for family in text_string_to_metric_families(body.decode())}


def add(built: BuiltEngine, request_id: str, adapter: str | None) -> None:
    catalog = built.lora_catalog
    assert catalog is not None
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    lora = catalog.get(adapter)
    assert (lora is None) == (adapter is None)
    built.core.add_request([Request(request_id, list(PROMPT), params, lora=lora)])


def record(delta: RequestDelta, adapter: str | None) -> RequestRecord:
    """The server's record of a finished choice, from its finishing delta."""
    assert delta.finish_reason is not None
    return RequestRecord(
        finish_reason=delta.finish_reason.value,
        prompt_tokens=delta.num_prompt_tokens,
        generation_tokens=delta.num_output_tokens,
        cached_tokens=delta.num_cached_tokens,
        queue_time_s=delta.queue_time,
        ttft_s=None,
        e2e_s=0.1,
        itl_s=(),
        kv_blocks=delta.num_blocks,
        lora_name=adapter,
    )


def test_the_epp_sees_running_and_waiting_adapters_and_the_slots(built: BuiltEngine) -> None:
    core = built.core
    metrics = ServerMetrics(model_name=MODEL, stats_fn=core.stats, cache_info={}, max_loras=2)
    idle = scrape(metrics)
    assert epp_lora_view(idle) == LoRAView(2, frozenset(), frozenset())

    adapter_of = {"base": None, **{f"r-{name}": name for name in ADAPTERS}}
    for request_id, adapter in adapter_of.items():
        add(built, request_id, adapter)
    finishing: dict[str, RequestDelta] = {}

    def step() -> None:
        for delta in core.step():
            if delta.finish_reason is not None:
                finishing[delta.request_id] = delta

    step()
    before = time.time()
    busy = scrape(metrics)
    # Two slots: alpha and beta run beside the base request, gamma waits for a slot.
    assert epp_lora_view(busy) == LoRAView(2, frozenset({"alpha", "beta"}), frozenset({"gamma"}))
    (sample,) = busy["kvserve_lora_requests_info"].samples
    assert sample.labels["running_lora_adapters"] == "alpha,beta"  # sorted, no spaces
    assert sample.labels["model_name"] == MODEL
    assert before <= sample.value <= time.time()
    assert sample.value > idle["kvserve_lora_requests_info"].samples[0].value

    while core.has_unfinished():
        step()
    assert epp_lora_view(scrape(metrics)) == LoRAView(2, frozenset(), frozenset())

    for request_id, delta in finishing.items():
        metrics.observe_request(record(delta, adapter_of[request_id]))
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in scrape(metrics).values()
        for sample in family.samples
    }
    for name in ADAPTERS:
        labels = {"model_name": MODEL, "lora_name": name}
        finished = tuple(sorted({**labels, "finish_reason": "length"}.items()))
        assert samples[("kvserve_lora_requests_finished_total", finished)] == 1
        keyed = tuple(sorted(labels.items()))
        assert samples[("kvserve_lora_prompt_tokens_total", keyed)] == len(PROMPT)
        assert samples[("kvserve_lora_generation_tokens_total", keyed)] == MAX_TOKENS
    # The base model's choice counts server-wide only; the adapters' there too.
    all_finished = (("finish_reason", "length"), ("model_name", MODEL))
    assert samples[("kvserve_requests_finished_total", all_finished)] == 4
    counted = {
        dict(labels)["lora_name"]
        for name, labels in samples
        if name == "kvserve_lora_requests_finished_total"
    }
    assert counted == set(ADAPTERS)  # no series for the base model
