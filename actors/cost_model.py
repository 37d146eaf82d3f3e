"""A step-time cost model fitted online, and the prefill chunk size it implies. Pure (numpy).

    step_seconds ~= c0 + c1 * tokens + c2 * attention_work

`tokens` is every token computed in the iteration (decodes + prefill chunks); attention_work
is sum over sequences of new_tokens * (context they attend to), in millions — it grows
with the square of a chunk and with the depth of the prompt it continues. The coefficients
are a least-squares fit over the last measured iterations — half of the window keeps
iterations with prefill, half decode-only ones, so a long decode-only stretch does not erase
what prefill costs — with a light ridge on the slopes and negative slopes dropped (more
work never makes a step faster), refitted every few observations.

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
        # Two memories: iterations with prefill chunks and decode-only ones. A long stretch
        # of decode-only iterations (the same token count over and over) must not push out
        # the samples that tell what a prefill token costs.
        half = max(1, window // 2)
        self._mixed: deque[tuple[float, float, float, float]] = deque(maxlen=half)
        self._pure: deque[tuple[float, float, float, float]] = deque(maxlen=half)
        self._since_fit = 0
        self.coef: np.ndarray | None = None   # (c0, c1, c2) once fitted

    @property
    def ready(self) -> bool:
        return self.coef is not None

    @property
    def knows_prefill(self) -> bool:
        """Fitted with a few iterations that computed prefill chunks, and a positive cost
        per token: only then does the model say anything about what a prefill token costs
        (noisy decode-only data can drive the token slope to 0, which would make every
        chunk look free)."""
        return self.coef is not None and len(self._mixed) >= 2 and self.coef[1] > 0

    @property
    def num_samples(self) -> int:
        return len(self._mixed) + len(self._pure)

    def observe(self, num_tokens: int, attn_work: float, seconds: float,
                prefill_tokens: int = 0) -> None:
        if seconds <= 0 or num_tokens <= 0:
            return
        (self._mixed if prefill_tokens else self._pure).append(
            (1.0, float(num_tokens), attn_work, seconds))
        self._since_fit += 1
        if self.num_samples >= self.min_samples and (self.coef is None
                                                     or self._since_fit >= self.refit_every):
            self._fit()

    def _fit(self) -> None:
        """Least squares with a light ridge on the slopes (features scaled to ~1 first), so
        that a feature that barely varies in the window (e.g. attention work while only
        decodes run) cannot take an absurd coefficient; negative slopes are dropped."""
        self._since_fit = 0
        data = np.asarray(list(self._mixed) + list(self._pure))
        x, y = data[:, :3], data[:, 3]
        scale = np.maximum(np.abs(x).mean(axis=0), 1e-12)
        xs = x / scale
        active = [0, 1, 2]
        coef = np.zeros(3)
        ridge = 1e-3 * len(y)
        while active:
            a = xs[:, active]
            penalty = np.diag([0.0 if i == 0 else ridge for i in active])
            sol = np.linalg.solve(a.T @ a + penalty + 1e-12 * np.eye(len(active)), a.T @ y)
            if (sol[1:] >= 0).all() or len(active) == 1:
                coef[active] = sol / scale[active]
                break
            # A negative slope: tokens and attention work are correlated in prefill chunks,
            # so drop attention first (the per-token cost is what chunk sizing needs), then
            # whatever is still negative.
            active.pop(active.index(2) if 2 in active else 1)
        coef = np.maximum(coef, 0.0)
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
