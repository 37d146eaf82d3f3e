"""What the scheduler learns from each step. Pure (no asyncio, no torch).

- the step-cost model (tokens, attention work -> forward seconds, for SLO chunk sizing);
- fair share: each tenant is charged the tokens computed for it;
- invariant 3's measurement: iterations in a row a running decode was left out;
- goodput: requests that finished within the TTFT and ITL objectives;
- where step time goes (forward vs host work, and how much host work the runner waited
  for), as means over a sliding window, for stats and the overlap benchmark.
"""

from __future__ import annotations

from collections import deque

import structlog

from tokenloom.actors.messages import ExecuteBatch, StepTimings
from tokenloom.actors.scheduling.cost_model import StepCostModel, attention_work
from tokenloom.actors.scheduling.fairness import FairShare
from tokenloom.actors.scheduling.policy import Decision
from tokenloom.actors.scheduling.request import FinishReason, Request
from tokenloom.config.schema import SchedulerConfig

log = structlog.get_logger("tokenloom.scheduler").bind(actor="scheduler")


class StepObserver:
    def __init__(self, config: SchedulerConfig, cost: StepCostModel, fair: FairShare,
                 window: int = 256):
        self.config = config
        self.cost = cost
        self.fair = fair
        self.max_decode_skip = 0          # most consecutive iterations a running decode missed
        self.num_slo_evaluated = 0
        self.num_slo_good = 0
        # (forward s, host s, exposed host s, kv round trip s, batch size) per step
        self._times: deque[tuple[float, float, float, float, int]] = deque(maxlen=window)
        self.prefill_s_per_token: float | None = None   # measured (see observe_step)

    def count_skips(self, d: Decision, running: list[Request]) -> None:
        ran = {w.request.request_id for w in d.decodes}
        ran.update(w.request.request_id for w in d.prefills)  # swapped back in: one token
        for req in running:
            if not req.is_decode:
                continue
            if req.request_id in ran:
                req.num_skipped = 0
                continue
            req.num_skipped += 1
            n = req.num_skipped
            if n > self.max_decode_skip:
                self.max_decode_skip = n
                if n > self.config.max_decode_skip:  # a broken promise: say so loudly
                    log.error("decode starved", request_id=req.request_id, skipped=n,
                              bound=self.config.max_decode_skip)

    def observe_step(self, d: Decision, batch: ExecuteBatch, forward_seconds: float) -> float:
        """Feed the cost model the forward's time and charge each tenant its tokens.
        Returns the time the model predicted for the step (0 before it was fitted)."""
        tokens, work = 0, 0.0
        for s in batch.sequences:
            n = len(s.token_ids)
            tokens += n
            work += attention_work(n, s.start_pos)
        rows = sum(1 + s.num_draft for s in batch.sequences if s.sample)
        # What the model said before it learns from this step (speculation calibrates on it).
        predicted = self.cost.predict(tokens, work, rows) if self.cost.ready else 0.0
        prefill = sum(w.num_tokens for w in d.prefills)
        self.cost.observe(tokens, work, forward_seconds, prefill_tokens=prefill, rows=rows)
        if prefill >= 16 and not d.decodes:
            # Seconds per prefill token, measured, for what needs a prefill's cost before the
            # cost model is fitted (the KV tiers' planner): an average that leans recent.
            per_token = forward_seconds / tokens
            self.prefill_s_per_token = (per_token if self.prefill_s_per_token is None
                                        else 0.7 * self.prefill_s_per_token + 0.3 * per_token)
        for w in d.decodes + d.prefills:
            self.fair.charge(w.request.tenant, w.num_tokens)
        return predicted

    def observe_times(self, forward: float, host: float, exposed_host: float,
                      kv_round_trip: float, batch_size: int) -> None:
        self._times.append((forward, host, exposed_host, kv_round_trip, batch_size))

    def timings(self) -> StepTimings:
        n = len(self._times)
        if not n:
            return StepTimings()
        sums = [sum(col) for col in zip(*self._times)]
        ms = [1000 * s / n for s in sums[:4]]
        return StepTimings(steps=n, forward_ms=round(ms[0], 3), host_ms=round(ms[1], 3),
                           exposed_host_ms=round(ms[2], 3), kv_round_trip_ms=round(ms[3], 3),
                           batch_size=round(sums[4] / n, 2))

    def observe_finished(self, req: Request, reason: FinishReason) -> None:
        """Goodput: a request that finished normally within the TTFT and ITL objectives."""
        if reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return
        cfg = self.config
        self.num_slo_evaluated += 1
        ok = True
        if cfg.slo_ttft_ms > 0 and req.first_token_time is not None:
            ok = (req.first_token_time - req.arrival_time) * 1000 <= cfg.slo_ttft_ms
        times = req.token_times
        if ok and cfg.slo_itl_ms > 0 and len(times) > 1:
            ok = (times[-1] - times[0]) / (len(times) - 1) * 1000 <= cfg.slo_itl_ms
        self.num_slo_good += ok
