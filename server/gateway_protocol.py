"""The model server protocol of the Kubernetes Gateway API Inference Extension, in kvserve.

The extension's Endpoint Picker (EPP) scrapes each model server's ``/metrics`` and routes a
request to the replica with the shortest queue, the emptiest KV cache or the best prefix
match. Its protocol (docs/proposals/003-model-server-protocol in
kubernetes-sigs/gateway-api-inference-extension) fixes each metric's type and meaning but
lets names differ when the picker is told them. Since EPP v1.5 that is an ``engineConfigs``
entry of its ``core-metrics-extractor`` plugin (one key per metric; the per-metric flags of
earlier releases are deprecated). This table is the one place that says which kvserve
series answers which protocol metric; the EPP config in deploy/gateway/, docs/reference/metrics.md
and the conformance test all read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProtocolMetric:
    """One row of the protocol's metrics table and the kvserve series that serves it."""

    protocol_name: str  # the name in the protocol's table
    metric: str  # kvserve's metric family
    label: str | None  # for a "labeled" metric: the label carrying the value
    engine_config_key: str  # its key in the EPP's engineConfigs entry
    epp_flag: str  # the EPP flag that named it before v1.5 (deprecated there)
    required: bool  # False: the protocol marks it [Optional]
    meaning: str


PROTOCOL_TYPE = "gauge"  # every metric of the table is a gauge (labeled ones: value 1)

PROTOCOL_METRICS: tuple[ProtocolMetric, ...] = (
    ProtocolMetric(
        "TotalQueuedRequests",
        "kvserve_num_requests_waiting",
        None,
        "queuedRequestsSpec",
        "total-queued-requests-metric",
        True,
        "requests waiting for admission to the running batch",
    ),
    ProtocolMetric(
        "TotalRunningRequests",
        "kvserve_num_requests_running",
        None,
        "runningRequestsSpec",
        "total-running-requests-metric",
        True,
        "requests in the running batch",
    ),
    ProtocolMetric(
        "KVCacheUtilization",
        "kvserve_kv_cache_usage_ratio",
        None,
        "kvUsageSpec",
        "kv-cache-usage-percentage-metric",
        True,
        "used / total device KV blocks, 0..1 (the EPP reads a fraction)",
    ),
    ProtocolMetric(
        "BlockSize",
        "kvserve_cache_config_info",
        "block_size",
        "cacheInfoSpec",
        "cache-info-metric",
        False,
        "tokens per KV block, for the prefix-cache scorer",
    ),
    ProtocolMetric(
        "NumGPUBlocks",
        "kvserve_cache_config_info",
        "num_gpu_blocks",
        "cacheInfoSpec",
        "cache-info-metric",
        False,
        "blocks in the device KV pool, for the prefix-cache scorer",
    ),
)

ENGINE_NAME = "kvserve"  # the engineConfigs entry, and the pods' engine-type label value
# The pods' label keys naming their engine: llm-d's router reads the first, and the
# Inference Extension's picker (and llm-d, as a deprecated fallback) the second.
ENGINE_LABEL_KEYS = ("llm-d.ai/engine-type", "inference.networking.k8s.io/engine-type")

# kvserve serves no LoRA adapters. An empty spec turns the EPP's LoRA scrape off; left
# unset, EPP v1.5 looks for vLLM's `vllm:lora_requests_info`, fails to find it and marks
# the pod unhealthy.
DISABLED_SPECS: dict[str, str] = {"loraSpec": ""}


def epp_engine_config() -> dict[str, str]:
    """kvserve's entry of the EPP's ``core-metrics-extractor`` ``engineConfigs`` list."""
    specs = {row.engine_config_key: row.metric for row in PROTOCOL_METRICS}
    return {"name": ENGINE_NAME, **specs, **DISABLED_SPECS}
