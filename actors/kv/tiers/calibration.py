"""Online models of how long things take, for the restore planner. Pure (numpy).

``TransferModel``: one tier's read time, ``seconds = latency + bytes / bandwidth``, a least-
squares line through the last completed transfers (bytes, seconds), anchored by a prior
(two pseudo-observations from the configured latency and bandwidth) so that it predicts
something sensible before the first transfer and a few noisy points cannot drag it to an
infinite bandwidth; the prior weighs less with each measurement and nothing after eight.
Transfers of one size only cannot separate latency from bandwidth: the prior's slope holds
then, and the intercept moves.

``PredictionLog``: predicted vs actual seconds of one kind of operation, to report the
median relative error (the calibration the docs and the benchmark quote).
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np


class TransferModel:
    def __init__(self, prior_latency_s: float, prior_bandwidth: float, *, window: int = 64,
                 prior_weight: float = 2.0, reference_bytes: int = 1 << 20) -> None:
        if prior_latency_s < 0 or prior_bandwidth <= 0:
            raise ValueError("a transfer prior needs latency >= 0 and bandwidth > 0")
        self._prior = (prior_latency_s, prior_bandwidth)
        self._ref = float(reference_bytes)
        self._weight = prior_weight
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.latency_s, self.bandwidth = prior_latency_s, prior_bandwidth
        self.num_observed = 0

    def predict(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth

    def observe(self, nbytes: int, seconds: float) -> None:
        """One completed transfer of ``nbytes`` that took ``seconds`` (wall clock)."""
        if nbytes <= 0 or seconds < 0:
            return
        with self._lock:
            self._samples.append((float(nbytes), float(seconds)))
            self.num_observed += 1
            self._fit()

    def _fit(self) -> None:
        lat0, bw0 = self._prior
        sizes = [b for b, _ in self._samples]
        secs = [t for _, t in self._samples]
        if len(set(sizes)) < 2:
            # One transfer size cannot separate latency from bandwidth: keep the prior's
            # bandwidth, and move the latency to what was measured.
            self.bandwidth = bw0
            self.latency_s = max(0.0, float(np.mean([t - b / bw0 for b, t in self._samples])))
            return
        # The prior as two points on its own line (at 1x and 4x a reference size), weighing
        # less with every measurement and nothing after eight.
        w_prior = self._weight * max(0.0, 1.0 - len(sizes) / 8)
        xs = [self._ref, 4 * self._ref] + sizes
        ys = [lat0 + self._ref / bw0, lat0 + 4 * self._ref / bw0] + secs
        w = np.asarray([w_prior, w_prior] + [1.0] * len(sizes))
        x = np.asarray(xs) / self._ref
        a = np.stack([np.ones_like(x), x], axis=1) * np.sqrt(w)[:, None]
        y = np.asarray(ys) * np.sqrt(w)
        (lat, slope), *_ = np.linalg.lstsq(a, y, rcond=None)
        slope = slope / self._ref
        if slope <= 0:   # a line through noise: keep the prior's bandwidth, move the latency
            slope = 1.0 / bw0
            lat = float(np.mean([t - b * slope for b, t in self._samples]))
        self.latency_s = max(0.0, float(lat))
        self.bandwidth = float(1.0 / slope)

    def as_dict(self) -> dict:
        return {"latency_ms": round(float(self.latency_s) * 1e3, 3),
                "bandwidth_mb_s": round(float(self.bandwidth) / 1e6, 1),
                "observed": self.num_observed}


class PredictionLog:
    """Relative errors |predicted - actual| / actual of the last ``window`` operations."""

    def __init__(self, window: int = 256) -> None:
        self._errors: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.count = 0

    def add(self, predicted: float, actual: float) -> None:
        if actual <= 0:
            return
        with self._lock:
            self._errors.append(abs(predicted - actual) / actual)
            self.count += 1

    def median(self) -> float | None:
        with self._lock:
            return float(np.median(self._errors)) if self._errors else None
