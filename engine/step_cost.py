"""What a step costs, measured, and the prefill budget that keeps steps near a target time.

The core times each step around the runner and feeds ``StepCostMeter.observe`` the step's
prefill and decode token counts; the meter keeps an exponentially weighted moving average
of seconds per token for each kind. Decode-only steps measure the decode cost; a step with
prefill attributes what the decodes do not explain to its prefill tokens. The scheduler
receives the estimate as plain numbers (``StepCost``) and asks ``prefill_token_budget``
how many prefill tokens fit next to its decodes. Pure Python: no torch, no clock here.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the newest observation in the moving averages.
EWMA_ALPHA = 0.2


@dataclass(frozen=True)
class StepCost:
    """Seconds per token of prefill and of decode; 0.0 = not measured yet."""

    prefill_s_per_token: float = 0.0
    decode_s_per_token: float = 0.0


class StepCostMeter:
    """EWMA of the measured seconds per prefill and per decode token."""

    def __init__(self, alpha: float = EWMA_ALPHA) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.cost = StepCost()

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> StepCost:
        """Fold one step's measurement into the estimate and return it."""
        cost = self.cost
        if prefill_tokens == 0 and decode_tokens > 0:
            decode = self._average(cost.decode_s_per_token, seconds / decode_tokens)
            self.cost = StepCost(cost.prefill_s_per_token, decode)
        elif prefill_tokens > 0:
            explained = decode_tokens * cost.decode_s_per_token
            per_token = max(0.0, seconds - explained) / prefill_tokens
            self.cost = StepCost(
                self._average(cost.prefill_s_per_token, per_token), cost.decode_s_per_token
            )
        return self.cost

    def _average(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self.alpha * (new - old)


def prefill_token_budget(
    cost: StepCost, max_step_time_s: float, num_decodes: int, min_tokens: int
) -> int:
    """Prefill tokens that fit in ``max_step_time_s`` next to ``num_decodes`` decodes at
    the measured cost, never below ``min_tokens`` (prefills always advance). Unmeasured
    prefill cost: no time bound yet (a large number; the token budget still applies)."""
    if cost.prefill_s_per_token <= 0.0:
        return 1 << 30
    left = max_step_time_s - num_decodes * cost.decode_s_per_token
    return max(min_tokens, int(left / cost.prefill_s_per_token))
