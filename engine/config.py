"""Engine configuration: small frozen dataclasses, validated on construction.

The scheduler and the block manager are built from ``CacheConfig`` and
``SchedulerConfig`` alone (plain numbers), never from a model config, so they stay
importable and testable without torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Literal

PreemptionMode = Literal["recompute", "swap", "auto"]
AdmissionPolicy = Literal["optimistic", "reserve"]
SchedulingPolicy = Literal["fcfs", "priority"]

PREEMPTION_MODES: tuple[str, ...] = ("recompute", "swap", "auto")
ADMISSION_POLICIES: tuple[str, ...] = ("optimistic", "reserve")
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority")
# --max-step-time-ms when not given, by device: the absolute backstop under the relative
# bound below. A CPU step of a small model decoding 32 sequences takes ~30-250 ms
# (AVX-512 bf16 .. AVX2 float32), a GPU step tens of ms.
DEFAULT_MAX_STEP_TIME_MS = {"cpu": 800.0, "cuda": 100.0}
# --max-step-time-ratio when not given: a step with decodes may take this many times what
# its decodes alone take, so the longest inter-token gap stays a few typical ones wide.
DEFAULT_MAX_STEP_TIME_RATIO = 4.0


@dataclass(frozen=True)
class CacheConfig:
    """The KV block pools: how many blocks of how many tokens, on device and host."""

    num_device_blocks: int
    block_size: int = 16
    num_host_blocks: int = 0
    enable_prefix_caching: bool = True
    # Fraction of device blocks kept free when admitting new requests, so that running
    # requests can still grow by a few decode tokens without immediate preemption.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_device_blocks < 1:
            raise ValueError("num_device_blocks must be >= 1")
        if self.num_host_blocks < 0:
            raise ValueError("num_host_blocks must be >= 0")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError("watermark must be in [0, 1)")

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_device_blocks)


SPECULATIVE_METHODS: tuple[str, ...] = ("ngram",)


KV_EVENT_PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig``, field for field (``--kv-events-config`` JSON); the
    publisher is engine/kv/event_publisher.py."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"publisher must be one of {', '.join(KV_EVENT_PUBLISHERS)}")
        if self.buffer_steps < 0 or self.hwm < 0 or self.max_queue_size < 1:
            raise ValueError("buffer_steps and hwm must be >= 0, max_queue_size >= 1")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON; an unknown key is an error naming it."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}")
        return cls(**data)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculative/), in vLLM's ``--speculative-config`` shape.

    ``ngram``: a decoding request proposes up to ``num_speculative_tokens`` tokens that
    followed the most recent earlier occurrence of its last ``prompt_lookup_max`` ..
    ``prompt_lookup_min`` tokens (longest first) in its own prompt and output; one forward
    verifies them. Past ``disable_by_batch_size`` running requests nobody speculates: a
    batch that already fills the step gains nothing from extra rows.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int = 8

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.prompt_lookup_max > 64:
            raise ValueError("prompt_lookup_max must be <= 64")
        if self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse ``--speculative-config`` JSON; unknown keys and bad values raise
        ``ValueError`` naming them. A lone ``prompt_lookup_max`` or ``_min`` sets the
        other one too when the default would contradict it."""
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from exc
        if not isinstance(fields, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}"
            )
        for name, value in fields.items():
            expected = str if name == "method" else int
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ValueError(f"--speculative-config: {name} must be {expected.__name__}")
        low, high = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
        if low is not None and high is None:
            fields["prompt_lookup_max"] = max(low, cls.prompt_lookup_max)
        if high is not None and low is None:
            fields["prompt_lookup_min"] = min(high, cls.prompt_lookup_min)
        return cls(**fields)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (engine/lora/; vLLM's flag names).

    ``max_loras`` adapters fit in one step (each has a slot in the projections' stacked
    adapter weights); ``max_cpu_loras`` stay loaded in host memory (LRU), a slot is
    filled from there; every adapter's rank is at most ``max_lora_rank`` (the slots are
    that wide). ``modules`` are the ``(name, path)`` adapters served from the start.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        if self.max_lora_rank < 1:
            raise ValueError("max_lora_rank must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"LoRA module names must be unique; got {names}")

    @property
    def host_capacity(self) -> int:
        """Adapters kept loaded in host memory."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budgets and the admission/preemption policies."""

    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    preemption_mode: PreemptionMode = "auto"
    admission_policy: AdmissionPolicy = "optimistic"
    # In ``auto`` mode, swap a victim out (instead of recomputing it later) when it holds
    # at least this many computed tokens and the host pool has room.
    swap_min_tokens: int = 256
    # Waiting-queue bounds (0 = unbounded): requests beyond them are rejected at add().
    max_queued_requests: int = 0
    max_queued_tokens: int = 0
    # ``fcfs``: priorities are ignored (the server rejects non-zero ones); ``priority``:
    # lower value first, and last to be preempted.
    scheduling_policy: SchedulingPolicy = "fcfs"
    # How many requests behind a queued one that does not fit may be admitted before it
    # holds the line (no admission behind it until it fits): the bound on starving.
    max_num_bypasses: int = 8
    # Target step time (0 = none): prefill tokens per step are bounded by it at the
    # measured cost per token, never below ``min_prefill_tokens``; decodes are not cut.
    max_step_time_s: float = 0.0
    # And, in a step with decodes, by this multiple of the decodes' own step (0 = none).
    max_step_time_ratio: float = 0.0
    min_prefill_tokens: int = 32
    # Speculative decoding (None = off).
    speculative: SpeculativeConfig | None = None
    # Distinct LoRA adapters among the running requests (0: LoRA off, no bound).
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}")
        if self.admission_policy not in ADMISSION_POLICIES:
            raise ValueError(f"admission_policy must be one of {ADMISSION_POLICIES}")
        if self.max_queued_requests < 0 or self.max_queued_tokens < 0:
            raise ValueError("queue bounds must be >= 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}")
        if self.max_num_bypasses < 0:
            raise ValueError("max_num_bypasses must be >= 0")
        if self.max_step_time_s < 0 or self.min_prefill_tokens < 1:
            raise ValueError("max_step_time_s must be >= 0 and min_prefill_tokens >= 1")
        if self.max_step_time_ratio != 0 and self.max_step_time_ratio <= 1:
            raise ValueError("max_step_time_ratio must be 0 (off) or > 1")


@dataclass(frozen=True)
class EngineArgs:
    """Everything needed to build a serving engine; the CLI maps its flags onto this.

    ``model`` None means the embedded SmolLM2-135M-Instruct GGUF. Memory figures are GiB.
    """

    model: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    kv_cache_dtype: str = "auto"  # auto (accounting.resolve_kv_dtype) | a KV_DTYPE_BYTES key
    # Keep every block of every layer (one full-attention KV group), as a cache without
    # sliding-window groups would (engine/kv/groups.py); vLLM's flag name.
    disable_hybrid_kv_cache_manager: bool = False
    max_model_len: int | None = None  # None: min(model's context, 8192)
    block_size: int = 16
    kv_cache_memory_gib: float = 2.0  # CPU: the KV budget on top of weights/activations
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of total device memory
    num_kv_blocks: int | None = None  # overrides the measured block count
    swap_space_gib: float = 1.0  # host pool for offload
    # Tiered prefix cache (engine/kv/tiers.py): a host tier of its own (not the swap pool)
    # and an optional disk directory, size-bounded; evicted prefix blocks go there.
    kv_cache_host_gib: float = 0.0
    kv_cache_disk_dir: str | None = None
    kv_cache_disk_gib: float = 4.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    preemption_mode: PreemptionMode = "auto"
    admission_policy: AdmissionPolicy = "optimistic"
    enable_prefix_caching: bool = True
    max_queued_requests: int = 0
    max_queued_tokens: int = 0
    scheduling_policy: SchedulingPolicy = "fcfs"
    max_step_time_ms: float | None = None  # None: DEFAULT_MAX_STEP_TIME_MS of the device
    max_step_time_ratio: float = DEFAULT_MAX_STEP_TIME_RATIO
    seed: int = 0
    # Weight quantization of the projections and LM head: none | int8 | int4 (CPU only).
    quantization: str = "none"
    # Norm / rotary / activation / attention kernels: auto | native (fused CPU ops) | torch.
    kernels: str = "auto"
    # Every projection on its row-wise kernel at every row count: a request's numbers never
    # depend on the rest of its step (temperature 0 gives one answer), at a prefill cost.
    batch_invariant: bool = False
    # CUDA: run decode steps eagerly instead of replaying CUDA graphs (vLLM's flag name).
    enforce_eager: bool = False
    # Speculative decoding (None = off); the CLI's --speculative-config JSON.
    speculative_config: SpeculativeConfig | None = None
    # KV cache events for prefix-aware routers (engine/kv/event_publisher.py's
    # KVEventsConfig, the CLI's --kv-events-config JSON); None = off.
    kv_events_config: KVEventsConfig | None = None
    # LoRA adapters (engine/lora/; --enable-lora and its flags); None = off.
    lora: LoRAConfig | None = None
