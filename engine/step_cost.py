"""What a step costs, measured, and the prefill budget that keeps steps near a target time.

The core times each step around the runner and feeds ``StepCostMeter.observe`` the step's
prefill and decode token counts. The meter fits ``seconds = fixed + decodes * d +
prefill * p`` by least squares over the recent steps (exponentially forgotten): a step
pays a fixed part (weights streamed once, host work) whatever its batch, so seconds per
token alone would call a one-row step 30x cheaper than it is. The scheduler receives the
fit as plain numbers (``StepCost``) and asks ``prefill_token_budget`` how many prefill
tokens fit next to its decodes: under the absolute bound, and under ``ratio`` times what
the decodes alone would take, so the longest inter-token gap stays a fixed multiple of
the typical one on a slow CPU and a fast one alike. Pure Python: no torch, no clock here.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight kept by the older steps at each new one: the fit spans ~20 recent steps.
FORGET = 0.95
# Ridge on the normal equations, relative to each feature's own scale: keeps the fit
# defined while features have not varied apart (every step with 32 decodes, say: the
# time is then split about evenly between the fixed part and the per-decode part).
RIDGE = 1e-3
_NUM_FEATURES = 3  # 1 (the fixed part), decode tokens, prefill tokens


@dataclass(frozen=True)
class StepCost:
    """A step's seconds as ``fixed_s + decodes * decode_s_per_token + prefill tokens *
    prefill_s_per_token``; ``prefill_s_per_token`` 0.0 = not measured yet."""

    prefill_s_per_token: float = 0.0
    decode_s_per_token: float = 0.0
    fixed_s: float = 0.0

    def decode_seconds(self, num_decodes: int) -> float:
        """A step of ``num_decodes`` decodes and no prefill."""
        return self.fixed_s + num_decodes * self.decode_s_per_token


class StepCostMeter:
    """Least-squares fit of step seconds on (1, decode tokens, prefill tokens), with
    older steps forgotten geometrically; coefficients are never negative."""

    def __init__(self, forget: float = FORGET) -> None:
        if not 0.0 < forget <= 1.0:
            raise ValueError("forget must be in (0, 1]")
        self.forget = forget
        self.cost = StepCost()
        n = _NUM_FEATURES
        self._xtx = [[0.0] * n for _ in range(n)]
        self._xty = [0.0] * n
        self._seen_prefill = False

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> StepCost:
        """Fold one step's measurement into the fit and return the new estimate."""
        if prefill_tokens == 0 and decode_tokens == 0:
            return self.cost
        x = (1.0, float(decode_tokens), float(prefill_tokens))
        for i in range(_NUM_FEATURES):
            self._xty[i] = self.forget * self._xty[i] + x[i] * seconds
            for j in range(_NUM_FEATURES):
                self._xtx[i][j] = self.forget * self._xtx[i][j] + x[i] * x[j]
        self._seen_prefill = self._seen_prefill or prefill_tokens > 0
        fixed, decode, prefill = _nonnegative_least_squares(self._xtx, self._xty)
        self.cost = StepCost(
            prefill_s_per_token=prefill if self._seen_prefill else 0.0,
            decode_s_per_token=decode,
            fixed_s=fixed,
        )
        return self.cost


def prefill_token_budget(
    cost: StepCost,
    max_step_time_s: float,
    num_decodes: int,
    min_tokens: int,
    ratio: float = 0.0,
) -> int:
    """Prefill tokens that fit next to ``num_decodes`` decodes in ``max_step_time_s`` and,
    when ``ratio`` > 0 and something decodes, in ``ratio`` times the decodes' own step;
    never below ``min_tokens`` (prefills always advance). Unmeasured prefill cost: no time
    bound yet (a large number; the token budget still applies)."""
    if cost.prefill_s_per_token <= 0.0:
        return 1 << 30
    decode_s = cost.decode_seconds(num_decodes)
    limit = max_step_time_s
    if ratio > 0.0 and num_decodes > 0:
        limit = min(limit, ratio * decode_s)
    # (+1e-9: 0.1 / 0.001 is 99.99... in floats)
    return max(min_tokens, int((limit - decode_s) / cost.prefill_s_per_token + 1e-9))


def _nonnegative_least_squares(xtx: list[list[float]], xty: list[float]) -> list[float]:
    """Solve the (ridged) normal equations; a negative coefficient is pinned to zero and
    the rest refitted (three features: at most three rounds)."""
    active = list(range(len(xty)))
    while active:
        solution = _solve([[xtx[i][j] for j in active] for i in active], [xty[i] for i in active])
        if all(value >= 0.0 for value in solution):
            coefficients = [0.0] * len(xty)
            for index, value in zip(active, solution, strict=True):
                coefficients[index] = value
            return coefficients
        worst = min(range(len(active)), key=solution.__getitem__)
        del active[worst]
    return [0.0] * len(xty)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting on a small ridged system."""
    n = len(b)
    m = [[*a[i], b[i]] for i in range(n)]
    for i in range(n):
        m[i][i] += RIDGE * a[i][i] or RIDGE
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0.0:
            return [0.0] * n
        for row in range(col + 1, n):
            factor = m[row][col] / m[col][col]
            for k in range(col, n + 1):
                m[row][k] -= factor * m[col][k]
    x = [0.0] * n
    for row in range(n - 1, -1, -1):
        rest = sum(m[row][k] * x[k] for k in range(row + 1, n))
        x[row] = (m[row][n] - rest) / m[row][row]
    return x
