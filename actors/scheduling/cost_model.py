"""A step-time cost model fitted online, and the prefill chunk size it implies. Pure (numpy).

    step_seconds ~= c0 + c1 * tokens + c2 * attention pairs + c3 * keys read + c4 * rows

`rows` are the positions that get logits and a sampled token: one per decode, one per
finished prompt, k + 1 per speculative decode verifying k drafts. Each costs an LM-head
row (vocab x hidden multiply-adds: for a small model with a large vocabulary, more than
the rest of the token) and its share of sampling, which a prefill token never pays; priced
per token, speculation's extra rows looked ~2x cheaper than they were measured to be.

`tokens` is every token computed in the iteration (decodes + prefill chunks). Attention
costs two ways, so it is two features (`attention_work` returns both; they add up over a
batch):
- pairs: sum over sequences of the (query, key) pairs their new tokens attend to, causal
  (new_tokens * start + new_tokens^2 / 2), in millions, the compute. It grows with the
  square of a chunk and with the depth of the prompt it continues. (Counting the whole
  rectangle new_tokens * context charged a fresh chunk twice what its causal kernel does:
  fitted on measured steps, the decode-only error halved when pairs became causal.)
- keys read: sum over sequences of the context they attend to, in millions, the memory
  traffic. Every sequence reads its whole context (K and V of every layer) once per step
  whatever its new tokens: a decode reads 1024 keys for 1024 pairs, a 512-token chunk after
  them 1536 keys for ~656k pairs. Measured (benchmarks/mixed_step.py, SmolLM2-135M fp32 on
  2 cores) a key read costs 2-3x a pair (6x before the decode kernel used both cores and
  prefetched), so with pairs alone one coefficient cannot price both a decode batch
  (memory-bound) and a prefill chunk (compute-bound): the fit folds the decodes' reads into
  the per-step constant, which overcharges small decode batches and small deep chunks.
For a decode the two features are equal; prefill iterations tell them apart.

The coefficients are a least-squares fit over the last measured iterations — half of the
window keeps iterations with prefill, half decode-only ones, so a long decode-only stretch
does not erase what prefill costs — with a light ridge on the slopes and negative slopes
dropped (more work never makes a step faster), refitted every few observations.

SLO-driven chunking asks: given this iteration's decodes, how many prefill tokens fit in
the target inter-token latency? The answer is found by bisection on the model and clamped
to [min_chunk, static budget], so long prompts always progress.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionWork:
    """Attention cost units of some sequences' new tokens, in millions: query-key pairs
    (compute) and keys read (memory). Adds up (also onto 0, so `sum()` works) and scales
    by a number."""
    pairs: float = 0.0
    reads: float = 0.0

    def __add__(self, other):
        if isinstance(other, AttentionWork):
            return AttentionWork(self.pairs + other.pairs, self.reads + other.reads)
        if isinstance(other, (int, float)) and other == 0:
            return self
        return NotImplemented

    __radd__ = __add__

    def __mul__(self, k):
        if isinstance(k, (int, float)):
            return AttentionWork(self.pairs * k, self.reads * k)
        return NotImplemented

    __rmul__ = __mul__


def attention_work(num_new: int, start: int) -> AttentionWork:
    """Attention cost units of computing `num_new` tokens after `start` cached ones: the
    causal query-key pairs (each new token sees the cached ones and the new ones up to
    itself) and the keys read."""
    pairs = num_new * start + num_new * (num_new + 1) // 2
    return AttentionWork(pairs / 1e6, (start + num_new) / 1e6)


def _work(attn) -> tuple[float, float]:
    """(pairs, reads) of an AttentionWork, or of a bare number (pairs alone)."""
    if isinstance(attn, AttentionWork):
        return float(attn.pairs), float(attn.reads)
    return float(attn), 0.0


class StepCostModel:
    def __init__(self, window: int = 256, min_samples: int = 16, refit_every: int = 8):
        self.window = window
        self.min_samples = min_samples
        self.refit_every = refit_every
        # Two memories: iterations with prefill chunks and decode-only ones. A long stretch
        # of decode-only iterations (the same token count over and over) must not push out
        # the samples that tell what a prefill token costs.
        half = max(1, window // 2)
        self._mixed: deque[tuple[float, ...]] = deque(maxlen=half)
        self._pure: deque[tuple[float, ...]] = deque(maxlen=half)
        self._since_fit = 0
        self.coef: np.ndarray | None = None   # (c0, c1, c2, c3, c4) once fitted

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

    def observe(self, num_tokens: int, attn_work: AttentionWork | float, seconds: float,
                prefill_tokens: int = 0, rows: int | None = None) -> None:
        """One iteration: its tokens, the sum of its sequences' attention_work (a bare
        number counts as pairs with no keys read), its forward's seconds and its sampled
        rows (default: one per token that is not a prefill token)."""
        if seconds <= 0 or num_tokens <= 0:
            return
        if rows is None:
            rows = num_tokens - prefill_tokens
        (self._mixed if prefill_tokens else self._pure).append(
            (1.0, float(num_tokens), *_work(attn_work), float(rows), seconds))
        self._since_fit += 1
        if self.num_samples >= self.min_samples and (self.coef is None
                                                     or self._since_fit >= self.refit_every):
            self._fit()

    def _fit(self) -> None:
        """Least squares with a light ridge on the slopes (features scaled to ~1 first), so
        that a feature that barely varies in the window (e.g. attention work while only
        decodes run, where pairs and keys read are equal) cannot take an absurd
        coefficient; negative slopes are dropped."""
        self._since_fit = 0
        data = np.asarray(list(self._mixed) + list(self._pure))
        x, y = data[:, :5], data[:, 5]
        scale = np.maximum(np.abs(x).mean(axis=0), 1e-12)
        xs = x / scale
        active = [0, 1, 2, 3, 4]
        coef = np.zeros(5)
        ridge = 1e-3 * len(y)
        while active:
            a = xs[:, active]
            penalty = np.diag([0.0 if i == 0 else ridge for i in active])
            sol = np.linalg.solve(a.T @ a + penalty + 1e-12 * np.eye(len(active)), a.T @ y)
            if (sol[1:] >= 0).all() or len(active) == 1:
                coef[active] = sol / scale[active]
                break
            # A negative slope: tokens and attention work are correlated in prefill chunks,
            # so drop an attention feature first, the most negative one (the per-token cost
            # is what chunk sizing needs), then whatever is still negative.
            negative = [(sol[j], i) for j, i in enumerate(active) if i and sol[j] < 0]
            attn = [(v, i) for v, i in negative if i >= 2]
            active.remove(min(attn or negative)[1])
        coef = np.maximum(coef, 0.0)
        self.coef = coef

    def predict(self, num_tokens: int, attn_work: AttentionWork | float,
                rows: int | None = None) -> float:
        """Seconds of a step; `rows` sampled positions (default: every token, i.e. a step
        of decodes)."""
        c0, c1, c2, c3, c4 = self.coef if self.coef is not None else (0.0,) * 5
        pairs, reads = _work(attn_work)
        rows = num_tokens if rows is None else rows
        return float(c0 + c1 * num_tokens + c2 * pairs + c3 * reads + c4 * rows)

    def prefill_seconds(self, num_tokens: int) -> float:
        """Marginal cost of recomputing a `num_tokens` prompt (for preemption choices)."""
        if self.coef is None:
            return float("inf")
        return self.predict(num_tokens, attention_work(num_tokens, 0), rows=0) \
            - float(self.coef[0])

    def max_prefill_tokens(self, target_seconds: float, decode_tokens: int,
                           decode_attn: AttentionWork | float, prefill_start: int, lo: int,
                           hi: int) -> int:
        """The most prefill tokens (continuing a prompt at `prefill_start`) whose iteration,
        with `decode_tokens` decodes of `decode_attn` work, stays within `target_seconds`;
        at least `lo` (progress), at most `hi` (the static budget)."""
        if hi <= lo:
            return hi

        def fits(p: int) -> bool:
            return self.predict(decode_tokens + p, decode_attn + attention_work(p, prefill_start),
                                rows=decode_tokens) <= target_seconds

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
