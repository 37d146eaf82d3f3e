"""A step-time cost model fitted online, and the prefill chunk size it implies. Pure (numpy).

    step_seconds ~= c0 + c1 * tokens + c2 * attention_work

`tokens` is every token computed in the iteration (decodes + prefill chunks); attention_work
is sum over sequences of new_tokens * (context they attend to), in millions — it grows
with the square of a chunk and with the depth of the prompt it continues. The coefficients
are a least-squares fit over the last `window` measured iterations (negative ones are
dropped: more work never makes a step faster), refitted every few observations.

SLO-driven chunking asks: given this iteration's decodes, how many prefill tokens fit in
the target inter-token latency? The answer is found by bisection on the model and clamped
to [min_chunk, static budget], so long prompts always progress.
"""

from __future__ import annotations

from collections import deque

import numpy as np


def attention_work(num_new: int, start: int) -> float:
    """Attention cost units of computing `num_new` tokens after `start` cached ones."""
    return num_new * (start + num_new) / 1e6


class StepCostModel:
    def __init__(self, window: int = 256, min_samples: int = 16, refit_every: int = 8):
        self.window = window
        self.min_samples = min_samples
        self.refit_every = refit_every
        self._x: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self._since_fit = 0
        self.coef: np.ndarray | None = None   # (c0, c1, c2) once fitted

    @property
    def ready(self) -> bool:
        return self.coef is not None

    def observe(self, num_tokens: int, attn_work: float, seconds: float) -> None:
        if seconds <= 0 or num_tokens <= 0:
            return
        self._x.append((1.0, float(num_tokens), attn_work))
        self._y.append(seconds)
        self._since_fit += 1
        if len(self._y) >= self.min_samples and (self.coef is None
                                                 or self._since_fit >= self.refit_every):
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        x = np.asarray(self._x)
        y = np.asarray(self._y)
        active = [0, 1, 2]
        coef = np.zeros(3)
        while active:
            sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            if (sol[1:] >= 0).all() or len(active) == 1:
                coef[active] = sol
                break
            # drop the most negative non-intercept coefficient and refit
            worst = 1 + int(np.argmin(sol[1:]))
            active.pop(worst)
        coef[0] = max(coef[0], 0.0)
        coef[1:] = np.maximum(coef[1:], 0.0)
        self.coef = coef

    def predict(self, num_tokens: int, attn_work: float) -> float:
        c0, c1, c2 = self.coef if self.coef is not None else (0.0, 0.0, 0.0)
        return float(c0 + c1 * num_tokens + c2 * attn_work)

    def prefill_seconds(self, num_tokens: int) -> float:
        """Marginal cost of recomputing a `num_tokens` prompt (for preemption choices)."""
        if self.coef is None:
            return float("inf")
        return float(self.coef[1] * num_tokens + self.coef[2] * attention_work(num_tokens, 0))

    def max_prefill_tokens(self, target_seconds: float, decode_tokens: int,
                           decode_attn: float, prefill_start: int, lo: int, hi: int) -> int:
        """The most prefill tokens (continuing a prompt at `prefill_start`) whose iteration,
        with `decode_tokens` decodes of `decode_attn` work, stays within `target_seconds`;
        at least `lo` (progress), at most `hi` (the static budget)."""
        if hi <= lo:
            return hi

        def fits(p: int) -> bool:
            return self.predict(decode_tokens + p, decode_attn
                                + attention_work(p, prefill_start)) <= target_seconds

        if fits(hi):
            return hi
        if not fits(lo):
            return lo
        a, b = lo, hi          # fits(a), not fits(b)
        while b - a > 1:
            m = (a + b) // 2
            if fits(m):
                a = m
            else:
                b = m
        return a
