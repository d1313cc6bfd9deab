"""What a step costs, measured as the engine runs: a fixed part plus a part per token.

A step reads every weight once whatever its size (the fixed part) and computes for each of its
tokens (the part per token). On a CPU a decode step of one token costs about its weight reads, and
a step of ~10-20 tokens costs twice that; on a GPU hundreds of tokens ride on the weight reads.
free_tokens() is that ratio, fixed / per_token: the tokens a step can add before it costs twice
its fixed part. The scheduler lets a request of several sequences add at most that many tokens
beyond the rest of a step it shares (pagedllm.core.shares' token share), so such a request at most
about doubles another client's time between tokens, on any machine, without a constant per device.

The fit: least squares of step seconds on step tokens, each older step's weight decaying by
DECAY per step, so the estimate follows the machine (a shared host slows down; a model warms up).
Until steps of different sizes have been seen there is no estimate (None: nothing is capped on a
guess); a fit with no positive fixed part or slope keeps the last good estimate. A configured
value (EngineConfig.step_share_tokens) replaces the measurement.
"""

from __future__ import annotations

DECAY = 0.98  # ~50 steps of memory: a few seconds of serving
MIN_SPREAD = 4.0  # tokens: a fit over steps whose sizes barely differ says nothing of the slope


class StepCost:
    def __init__(self, max_tokens: int, fixed_free_tokens: int | None = None) -> None:
        """max_tokens: the most free_tokens can be (the step budget); fixed_free_tokens: a
        configured value, which no measurement changes."""
        self.max_tokens = max_tokens
        self._fixed = fixed_free_tokens
        self._free: int | None = None
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step's tokens and the seconds it took."""
        if num_tokens <= 0 or not seconds > 0:
            return
        d = DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + num_tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + num_tokens * num_tokens
        self._xy = d * self._xy + num_tokens * seconds
        self._refit()

    def _refit(self) -> None:
        w = self._w
        var_x = self._xx / w - (self._x / w) ** 2
        if var_x < MIN_SPREAD ** 2:
            return
        slope = (self._xy / w - (self._x / w) * (self._y / w)) / var_x
        fixed = self._y / w - slope * self._x / w
        if slope > 0 and fixed > 0:
            self._free = max(1, min(self.max_tokens, round(fixed / slope)))

    def free_tokens(self) -> int | None:
        """Tokens whose compute costs what a step's fixed part costs; None while unmeasured.
        A configured value wins (0: no token share)."""
        return self._fixed if self._fixed is not None else self._free
