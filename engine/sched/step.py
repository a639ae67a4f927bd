"""The step being built: its token and prefill budgets and each request's share of it.

``max_num_batched_tokens`` bounds every token of the step. Prefill tokens (chunks of
running prompts, admissions) are bounded as well by the step's prefill budget
(``prefill_budget``): the token budget less one token per decode, and, when the core has
measured what a token costs (``engine/step_cost.py``), what ``max_step_time_s`` and
``max_step_time_ratio`` allow -- so a step that re-admits long histories cannot stall every
decode for seconds. Decode tokens are never cut by it, and a step without decodes is not
bounded in time (no stream waits on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv.manager import KVCacheManager
from engine.outputs import ScheduledRequest, SchedulerOutput
from engine.request import Request
from engine.step_cost import StepCost, prefill_token_budget


@dataclass
class Step:
    """The step being built: remaining token budgets and what is scheduled so far.
    ``prefill_budget`` bounds the tokens of requests that are not decoding."""

    out: SchedulerOutput
    budget: int
    prefill_budget: int
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    preempted: bool = False
    # Reserve policy: blocks live requests may still allocate, summed once per step
    # (engine/sched/reserve.py).
    outstanding: int | None = None

    def chunk(self, remaining: int) -> int:
        """Tokens a request with ``remaining`` uncomputed tokens may compute this step:
        a decode (one token) only needs the token budget."""
        if remaining <= 1:
            return min(remaining, self.budget)
        return min(remaining, self.budget, self.prefill_budget)

    def charge(self, num_new: int, num_drafts: int = 0) -> None:
        """A decode verifying drafts spends token budget only: it is still one decode."""
        self.budget -= num_new
        if num_new - num_drafts > 1:
            self.prefill_budget -= num_new

    def add(
        self,
        request: Request,
        num_new: int,
        kv: KVCacheManager,
        drafts: list[int] | None = None,
    ) -> None:
        """Schedule ``num_new`` tokens of ``request`` (slots already allocated), plus the
        draft tokens a speculative decode verifies, and charge them to the budgets."""
        start = request.num_computed_tokens
        end = start + num_new
        token_ids = request.all_token_ids[start:end]
        if drafts:
            token_ids += drafts
        self.scheduled[request.request_id] = ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            num_computed_tokens=start,
            block_tables=kv.block_tables(request.request_id),
            sample=end == len(request.all_token_ids) and not request.sampling_params.prefill_only,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            seed=request.seed,
            num_draft_tokens=len(drafts) if drafts else 0,
            lora=request.lora,
        )
        self.charge(len(token_ids), len(drafts) if drafts else 0)

    def undo(self, request_id: str) -> None:
        """Take a preempted request's share back out and refund its tokens."""
        undone = self.scheduled.pop(request_id, None)
        if undone is not None:
            self.budget += undone.num_new_tokens


def prefill_budget(config: SchedulerConfig, running: list[Request], cost: StepCost) -> int:
    """Prefill tokens this step may compute: the token budget less one token per decode,
    further bounded by ``max_step_time_s`` and ``max_step_time_ratio`` at the measured step
    cost (``max_step_time_s`` 0 turns both off). A step without decodes is not
    time-bounded: no stream waits on it for a token, and queued prompts wait for the
    running prefills to finish whatever their chunk, so the bound would only cut a lone
    long prompt into more, slower steps."""
    decodes = sum(1 for r in running if r.num_tokens - r.num_computed_tokens <= 1)
    room = max(0, config.max_num_batched_tokens - decodes)
    if config.max_step_time_s <= 0 or decodes == 0:
        return room
    timed = prefill_token_budget(
        cost, config.max_step_time_s, decodes, config.min_prefill_tokens, config.max_step_time_ratio
    )
    return min(room, timed)
