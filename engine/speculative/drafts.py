"""Which decodes speculate this step, and how many tokens each proposes.

The scheduler's one question -- "draft tokens for this decode?" -- answered under every
limit at once: the method's ``num_speculative_tokens``, the request's ``max_tokens`` and the
model's context (a draft is never a token the request could not emit), the step's token
budget, and the batch size past which speculation is off. Requests whose sampling a
verification cannot reproduce exactly do not speculate: penalties (their counts would need
every draft position's history) and structured outputs (a grammar would have to accept and
roll back each draft). Pure Python.
"""

from __future__ import annotations

from engine.config import SpeculativeConfig
from engine.request import Request, SamplingParams
from engine.speculative.ngram import NgramProposer


def can_speculate(params: SamplingParams) -> bool:
    """A request whose tokens a verification samples exactly as plain decoding would."""
    return not (params.needs_penalties or params.structured_outputs or params.prefill_only)


class Speculator:
    """Draft tokens for decoding requests (``NgramProposer`` for ``method="ngram"``)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config)

    def drafts(
        self, request: Request, num_running: int, token_budget: int, max_model_len: int
    ) -> list[int]:
        """Tokens to verify after ``request``'s next decode token; empty: decode plainly.

        ``token_budget`` counts the decode token itself. The request must be decoding
        (one uncomputed token, an output already sampled).
        """
        if num_running > self.config.disable_by_batch_size:
            return []
        if not can_speculate(request.sampling_params):
            return []
        params = request.sampling_params
        room = min(
            token_budget - 1,
            # The verification emits up to drafts + 1 tokens.
            params.max_tokens - request.num_output_tokens - 1,
            # Draft positions end at num_tokens - 1 + drafts < max_model_len.
            max_model_len - request.num_tokens,
        )
        if room <= 0:
            return []
        return self.proposer.propose(request.request_id, request.all_token_ids, room)

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
