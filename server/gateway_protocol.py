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
    # A labeled metric's value: 1 (an info gauge), or with ``timestamped`` the time of the
    # snapshot in unix seconds, by which the EPP picks the latest of several samples.
    timestamped: bool = False


# Every metric of the table is a gauge (labeled ones: value 1, the LoRA one a timestamp).
PROTOCOL_TYPE = "gauge"

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
    # The protocol's "LoRA Adapter Serving" section: one gauge, vLLM's
    # `vllm:lora_requests_info`, whose labels fill the EPP's MaxActiveModels, ActiveModels
    # and WaitingModels (its lora-affinity scorer's inputs). Exported with LoRA off too
    # (max_lora 0, no adapters), so the scrape stays on for every kvserve pod: see
    # EngineStatsCollector._lora_families in server/metrics.py.
    ProtocolMetric(
        "MaxActiveModels",
        "kvserve_lora_requests_info",
        "max_lora",
        "loraSpec",
        "lora-info-metric",
        False,
        "adapters one step can run (--max-loras; 0 with LoRA off)",
        timestamped=True,
    ),
    ProtocolMetric(
        "ActiveModels",
        "kvserve_lora_requests_info",
        "running_lora_adapters",
        "loraSpec",
        "lora-info-metric",
        False,
        "adapters of the running requests, comma-separated",
        timestamped=True,
    ),
    ProtocolMetric(
        "WaitingModels",
        "kvserve_lora_requests_info",
        "waiting_lora_adapters",
        "loraSpec",
        "lora-info-metric",
        False,
        "adapters of the queued requests, comma-separated",
        timestamped=True,
    ),
)

ENGINE_NAME = "kvserve"  # the engineConfigs entry, and the pods' engine-type label value
# The pods' label keys naming their engine: llm-d's router reads the first, and the
# Inference Extension's picker (and llm-d, as a deprecated fallback) the second.
ENGINE_LABEL_KEYS = ("llm-d.ai/engine-type", "inference.networking.k8s.io/engine-type")


def epp_engine_config() -> dict[str, str]:
    """kvserve's entry of the EPP's ``core-metrics-extractor`` ``engineConfigs`` list:
    every spec set (an omitted or empty one turns that scrape off)."""
    specs = {row.engine_config_key: row.metric for row in PROTOCOL_METRICS}
    return {"name": ENGINE_NAME, **specs}
