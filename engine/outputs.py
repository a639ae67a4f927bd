"""The contracts between the engine's layers, as plain dataclasses.

    Scheduler --SchedulerOutput--> Runner --RunnerOutput--> Scheduler.update() --> deltas

The scheduler never touches tensors and the runner never decides; this module is all
they share. ``EngineStats`` is the snapshot the metrics and ``/health`` read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# TokenLogprob and PromptLogprobChunk live in engine.logprobs (a leaf, so engine.request
# can name them too) and stay importable from here.
from engine.logprobs import PromptLogprobChunk, TokenLogprob
from engine.request import FinishReason, LoRARequest, SamplingParams

# A block-table entry that holds no block: a sliding-window group's blocks wholly before
# its window (released). Kernels never read a block before a layer's window.
NULL_BLOCK = -1


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    The runner computes K/V for ``token_ids`` at positions
    ``[num_computed_tokens, num_computed_tokens + len(token_ids))`` into the slots given by
    ``block_tables`` (the request's whole block table per KV group, shared by reference:
    read-only; a sliding group's table holds ``NULL_BLOCK`` before its window), and
    samples one token from the last position when ``sample`` is true (the step completes
    the prompt or is a decode step). ``output_token_ids`` and ``prompt_token_ids`` are
    references for penalties; the runner must not mutate them.

    ``lora`` names the LoRA adapter the request's rows run with (None: the base); a step
    holds at most ``LoRAConfig.max_loras`` distinct adapters.

    A speculative decode ends ``token_ids`` with ``num_draft_tokens`` proposed tokens
    (engine/speculative/): the runner scores every position, keeps the drafts the model
    agrees with and samples one token after them (``RunnerOutput.spec_token_ids``).
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_tables: list[list[int]]
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int | None = None
    num_draft_tokens: int = 0
    lora: LoRARequest | None = None  # the adapter every row of this request runs with

    @property
    def block_ids(self) -> list[int]:
        """The first group's table: every layer's, for a model of one KV group."""
        return self.block_tables[0]

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens attended to by the last new token (cached + new)."""
        return self.num_computed_tokens + len(self.token_ids)


@dataclass(frozen=True)
class TierOp:
    """One block moved between prefix-cache tiers ("device", "host", "disk").

    Stores copy an evicted block down (device -> host, device -> disk, host -> disk);
    loads copy a prefix block back up (host -> device, disk -> device) for the loading
    request ``request_id``. ``*_block`` is a block id in that tier's pool (-1 for disk,
    whose entries are named by ``block_hash``). The runner applies a step's ops in list
    order, before any other block move: an op may read a block a later op overwrites.
    """

    source: str
    source_block: int
    target: str
    target_block: int
    block_hash: bytes
    request_id: str | None = None

    @property
    def is_load(self) -> bool:
        return self.target == "device"


@dataclass
class SchedulerOutput:
    """Everything the runner executes for one step, in order: swap_out, swap_in, copies,
    then the forward over ``scheduled``."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (device src, device dst)
    # Requests that left the engine since the last step: the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)
    num_preempted: int = 0
    # Prefix-cache tier moves, applied first and in order (engine/model/tier_io.py).
    tier_ops: list[TierOp] = field(default_factory=list)
    # Tier copies that run beside the forward (engine/kv/tiers.py write_ahead), on a
    # writer thread; done before the step returns. They touch no block the step uses.
    tier_writes_ahead: list[TierOp] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.swap_out or self.swap_in or self.copies or self.tier_ops)


@dataclass(frozen=True)
class PooledChunk:
    """A pooling request's share of one step (engine/pooling.py): prompt positions
    ``[start, end)`` were computed and ``values`` is what they add to its vector -- the
    sum of their final hidden rows ("mean"), the row of position 0 ("cls"), the last
    prompt position's row ("last"; only from the step that reaches it), or the logits
    of the requested tokens there."""

    start: int
    end: int
    values: list[float]


@dataclass
class RunnerOutput:
    """Sampled tokens for the scheduled requests whose ``sample`` flag was set.

    A request scheduled with draft tokens appears in ``spec_token_ids`` instead of
    ``sampled_token_ids``: every token it emits this step, in order (the accepted drafts,
    then the one sampled after them: 1 .. num_draft_tokens + 1 tokens), with their
    logprobs in ``spec_logprobs`` when it asked for logprobs.
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # Constrained requests whose grammar is complete with this step's token: they finish
    # with STOP (whatever ignore_eos and min_tokens say).
    grammar_completed: set[str] = field(default_factory=set)
    # Requests whose sampling_params.prompt_logprobs is set and whose scheduled tokens
    # covered prompt positions: the scored pieces (several when a step was split).
    prompt_logprobs: dict[str, list[PromptLogprobChunk]] = field(default_factory=dict)
    # Requests whose sampling_params.pooling is set: what this step's rows pooled.
    pooled: dict[str, PooledChunk] = field(default_factory=dict)


@dataclass
class RequestDelta:
    """What one step produced for one sequence (one choice of a client request)."""

    request_id: str
    group_id: str
    index: int
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    # On the first delta of a sequence that asked for them: prompt tokens 1.. (the first
    # prompt token has no logprob).
    prompt_logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    # Filled on the finishing delta only.
    num_blocks: int = 0  # device KV blocks the sequence held when it finished
    queue_time: float | None = None  # seconds from arrival to first schedule
    # Set when the request failed inside the engine (the server answers 500).
    error: str | None = None
    # A stable label for ``error``: "engine_fault" (its batch failed: 500) or
    # "queue_timeout" (it waited too long to be scheduled: retryable, 503).
    error_code: str | None = None
    # On a STOP finish: whether the last new token is the EOS / stop token id that ended
    # the sequence (the server leaves it out of the text unless include_stop_str_in_output).
    # False when a completed grammar ended it on an ordinary token.
    ended_on_stop_token: bool = False
    # On the finishing delta of a pooling request: its vector (the mean already taken),
    # unnormalised.
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class PoolStats:
    """Occupancy of one block pool. used + free + cached == total, where ``cached``
    counts free blocks that still hold reusable prefix-cache contents."""

    total: int
    used: int
    free: int
    cached: int


@dataclass(frozen=True)
class GroupStats:
    """One KV group of a hybrid model (engine/kv/groups.py): its device blocks and bytes.
    ``payload_bytes`` counts only what the group's attention still reads (a sliding group:
    at most its window per sequence); ``allocated_bytes`` its used blocks' share of the
    pool (a block is a page of ``page_layers`` layers, whatever the group's own count)."""

    label: str  # "full" | "sliding_<W>"
    window: int | None
    num_layers: int
    used_blocks: int
    cached_blocks: int
    payload_bytes: int
    allocated_bytes: int


@dataclass(frozen=True)
class TierStats:
    """One prefix-cache tier below the device pool. Hits and misses count blocks looked
    up at admission; bytes count blocks moved into (stored) and out of (loaded) the tier."""

    name: str
    capacity_blocks: int
    used_blocks: int
    used_bytes: int
    capacity_bytes: int
    hits_total: int = 0
    misses_total: int = 0
    stored_bytes_total: int = 0
    loaded_bytes_total: int = 0
    load_seconds_total: float = 0.0
    dropped_writes_total: int = 0
    failed_loads_total: int = 0
    in_step_stores_total: int = 0  # blocks stored inside a step, not written ahead
    # Disk tier only: entries rejected by reason (engine/kv/disk_store.py REJECT_REASONS),
    # and temporary files of crashed writes removed at start-up.
    rejected_entries_total: tuple[tuple[str, int], ...] = ()
    removed_temp_files_total: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A cheap, immutable snapshot of the engine for metrics and health checks.

    Gauges describe the moment of the snapshot; ``*_total`` fields are monotonic counters.
    Byte figures come from engine/kv/accounting.py.
    """

    device_blocks: PoolStats
    host_blocks: PoolStats
    block_size: int
    num_running: int
    num_waiting: int
    num_swapped: int
    # Sum over live requests of their tokens with K/V in device blocks (a shared prefix
    # counts once per sequence: this is the logical demand).
    live_tokens: int
    payload_bytes: int  # accounting.payload_bytes(live_tokens)
    allocated_bytes: int  # used device blocks * bytes_per_block
    shared_bytes: int  # sum over used blocks of (ref_count - 1) * bytes_per_block
    preemptions_total: dict[str, int] = field(default_factory=dict)  # mode -> count
    blocks_swapped_out_total: int = 0
    blocks_swapped_in_total: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up
    prefix_cache_hits_total: int = 0  # prompt tokens served from cache
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    steps_total: int = 0
    # Speculative decoding: verifications run, draft tokens proposed, drafts accepted,
    # and tokens emitted by verifications (accepted drafts plus one sampled each).
    spec_drafts_total: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_emitted_tokens_total: int = 0
    # Prefix-cache tiers below the device (host, disk), top down; empty when off.
    tiers: tuple[TierStats, ...] = ()
    # Requests whose prefix is being loaded back from a tier (not computing).
    num_loading: int = 0
    # Per KV group, for a hybrid model (more than one group, or a sliding one); empty
    # otherwise (the pool totals above are the one group's).
    groups: tuple[GroupStats, ...] = ()
    # LoRA (the Gateway API Inference Extension's ``lora_requests_info``): the adapters
    # of the running requests and of the queued ones, by name, sorted; empty when off.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()

    @property
    def usage_ratio(self) -> float:
        total = self.device_blocks.total
        return self.device_blocks.used / total if total else 0.0

    @property
    def padding_bytes(self) -> int:
        return max(0, self.allocated_bytes + self.shared_bytes - self.payload_bytes)
