"""Requests as the engine sees them: token counters plus sampling parameters.

A request is not a phase machine. It is ``num_computed_tokens`` chasing ``num_tokens``:
prefill, chunked prefill, prefix-cache hits and recompute after preemption are all just
different values of that counter.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from engine.logprobs import TokenLogprob


class FinishReason(str, enum.Enum):
    """Why a request ended, in OpenAI's vocabulary."""

    STOP = "stop"  # EOS, a stop token id, or a stop string (reported by the server)
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # client went away, shutdown, or an engine-side rejection


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    LOADING = "loading"  # its prefix is being loaded back from a lower cache tier
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
STRUCTURED_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output text, compiled into a token grammar (engine/structured/).

    ``value`` by kind: ``json_schema``: the schema as JSON text; ``json_object``: "" (any
    JSON object); ``regex``: the pattern; ``choice``: a JSON-encoded list of the allowed
    strings; ``grammar``: EBNF/GBNF text (root rule ``root``) as xgrammar accepts it.
    Hashable, so compiled grammars are cached by it.

    ``after``: token ids that must appear in the output before the constraint applies (a
    thinking model's end of reasoning, ``</think>``); the grammar then governs the tokens
    that follow their first occurrence. Empty: from the first token.

    ``opener`` (with ``after``): a token the output may begin with instead of the
    grammar's first token (a thinking model's start tag, ``<think>``, when the model
    chooses whether to think). An output that begins with it waits for ``after``; any
    other is governed from its first token. None: ``after`` is always waited for.
    """

    kind: StructuredKind
    value: str = ""
    after: tuple[int, ...] = ()
    opener: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}")
        if self.opener is not None and not self.after:
            raise ValueError("an opener needs the 'after' tokens it waits for")

    @property
    def grammar_spec(self) -> StructuredOutputs:
        """The grammar alone (what compiles and is cached), without ``after``."""
        return dataclasses.replace(self, after=(), opener=None) if self.after else self

    def grammar_start(self, output_token_ids: Sequence[int]) -> int | None:
        """Where the grammar's tokens begin in the output: 0 without ``after`` (or, with an
        ``opener``, while the output is empty or begins otherwise), else just past the
        first occurrence of ``after``; None while it has not appeared."""
        marker = self.after
        if not marker:
            return 0
        if self.opener is not None and (not output_token_ids or output_token_ids[0] != self.opener):
            return 0
        width = len(marker)
        first = marker[0]
        for index, token in enumerate(output_token_ids):
            if token == first and tuple(output_token_ids[index : index + width]) == marker:
                return index + width
        return None

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutputs:
        """The constraint "exactly one of these strings"."""
        return cls("choice", json.dumps(list(options)))


PoolingKind = Literal["last", "mean", "cls"]
POOLING_KINDS: tuple[str, ...] = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """Pool the prompt's final hidden states (after the final norm) into one vector
    instead of sampling (engine/pooling.py). ``kind``: the last token's row, the mean of
    every row, or the first (CLS) row. ``token_ids``: instead of the hidden row, return
    the LM head's logits of these tokens at the last position (a causal reranker's
    yes/no score); only with ``last``. ``classify``: instead of the hidden row, return
    the classifier head's logits at the last position (a ``*ForSequenceClassification``
    model's, ``num_labels`` of them); only with ``last``, and only on a model that has
    one. The vector is raw: normalising or a sigmoid is the caller's."""

    kind: PoolingKind = "last"
    token_ids: tuple[int, ...] = ()
    classify: bool = False

    def __post_init__(self) -> None:
        if self.kind not in POOLING_KINDS:
            raise ValueError(f"pooling kind must be one of {POOLING_KINDS}")
        if (self.token_ids or self.classify) and self.kind != "last":
            raise ValueError("head logits are read at the last position only")
        if self.token_ids and self.classify:
            raise ValueError("token logits and classifier logits are two poolings, not one")

    @property
    def needs_every_position(self) -> bool:
        """Whether every prompt position must be computed (no prefix-cache hit)."""
        return self.kind != "last"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding controls. Validation of user input happens in the server;
    these checks only guard the engine's own invariants."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # Number of top alternatives to return per sampled token; None = no logprobs at all,
    # 0 = only the sampled token's logprob.
    logprobs: int | None = None
    # Constrained decoding: the output must match this grammar; the request finishes
    # (STOP) when the grammar is complete. See engine/structured/.
    structured_outputs: StructuredOutputs | None = None
    # The same for every prompt token after the first, scored from the prefill's logits
    # (engine/prompt_logprobs.py); such a request skips the prefix cache.
    prompt_logprobs: int | None = None
    # Pool the prompt's hidden states instead of sampling (embeddings, scores); needs
    # max_tokens 0. The finishing delta carries the vector (RequestDelta.pooled).
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.max_tokens == 0 and self.n != 1:
            raise ValueError("max_tokens 0 (prefill only) needs n == 1")
        if self.n < 1:
            raise ValueError("n must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.pooling is not None and self.max_tokens != 0:
            raise ValueError("pooling is prefill only: it needs max_tokens 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def prefill_only(self) -> bool:
        """Score the prompt and finish without sampling a token (max_tokens 0)."""
        return self.max_tokens == 0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass(frozen=True)
class LoRARequest:
    """The LoRA adapter a request runs with (engine/lora/): ``name`` is what clients put in
    ``model``; ``id`` is unique for the life of the server (never reused after an unload,
    so the runner's adapter caches cannot confuse two loads of one name); ``fingerprint``
    digests the adapter's weights and keys its prefix-cache blocks, so no adapter ever
    reuses another's KV (two loads of the same files share theirs)."""

    name: str
    id: int
    path: str
    fingerprint: str


@dataclass(eq=False)
class Request:
    """One sequence being generated. For ``n > 1`` a client request becomes ``n`` of these
    sharing a ``group_id``; choice ``index`` 0 is the parent, the rest are forked from it.

    ``eos_token_ids`` come from the tokenizer; ``cache_salt`` isolates prefix-cache
    sharing between tenants (it is mixed into the first block's hash), and so does the
    LoRA adapter ``lora`` the request runs with (None: the base model).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    group_id: str = ""
    index: int = 0
    priority: int = 0  # lower value = more important (as vLLM)
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    lora: LoRARequest | None = None

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admit)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    # Scheduler bookkeeping: add order (tie-break of equal arrival times) and how often
    # requests behind this one were admitted while it did not fit (bounded: no starving).
    arrival_seq: int = 0
    num_bypasses: int = 0
    # Logprobs of prompt tokens 1.. scored so far (when sampling_params.prompt_logprobs).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Pooling (sampling_params.pooling): the running vector (a sum for "mean") and the
    # prompt position its rows reach; engine/sched/results.py add_pooled.
    pooled: list[float] | None = None
    pooled_until: int = 0

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = self.request_id
        # all_token_ids grows in place; prompt and output views are kept in sync by
        # append_output_token() so hot paths never concatenate lists.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def prefix_key(self) -> str | None:
        """The extra key of the first block's hash: the cache salt and the adapter."""
        if self.lora is None:
            return self.cache_salt
        adapter = f"lora:{self.lora.fingerprint}"
        return adapter if self.cache_salt is None else f"{self.cache_salt}\x00{adapter}"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def seed(self) -> int | None:
        """Per-choice seed: choices of one seeded request differ but are reproducible."""
        base = self.sampling_params.seed
        return None if base is None else base + self.index

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
