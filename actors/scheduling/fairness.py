"""Who is admitted next: priority classes, per-tenant fair share, and aging. Pure.

Order of the waiting queue, most urgent first:
  1. effective priority: the request's priority (lower runs first, vLLM's convention) minus
     one class per `aging_seconds` waited, so a low class cannot starve forever;
  2. preempted requests before fresh ones (they already waited and hold work in flight);
  3. the tenant's normalised service (tokens computed for it / its weight): start-time fair
     queueing, so a tenant that floods the queue is served no more than its share while a
     quiet tenant's request goes to the front of its class;
  4. arrival order.

A tenant that becomes backlogged again starts at the least service among the tenants
already backlogged (or, when none is, at the most any tenant has had), never below its own,
so idling does not bank credit for a later burst.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

from tokenloom.actors.scheduling.request import Request

DEFAULT_TENANT = ""


class FairShare:
    def __init__(self, weights: Mapping[str, float] | None = None, aging_seconds: float = 0.0):
        self.weights = dict(weights or {})
        self.aging_seconds = aging_seconds
        self.service: dict[str, float] = {}   # tokens computed / weight, per tenant
        self._backlogged: set[str] = set()

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def effective_priority(self, req: Request, now: float) -> int:
        if self.aging_seconds <= 0:
            return req.priority
        waited = max(0.0, now - req.arrival_time)
        return req.priority - math.floor(waited / self.aging_seconds)

    def order(self, waiting: Iterable[Request], now: float) -> list[Request]:
        """The waiting requests in admission order (see the module docstring)."""
        reqs = list(waiting)
        tenants = {r.tenant or DEFAULT_TENANT for r in reqs}
        self._activate(tenants)
        service = self.service
        return sorted(reqs, key=lambda r: (self.effective_priority(r, now),
                                           0 if r.num_preemptions else 1,
                                           service.get(r.tenant or DEFAULT_TENANT, 0.0),
                                           r.arrival_seq))

    def charge(self, tenant: str | None, num_tokens: int) -> None:
        """`num_tokens` were computed for `tenant` this iteration."""
        t = tenant or DEFAULT_TENANT
        self.service[t] = self.service.get(t, 0.0) + num_tokens / self.weight(t)

    def _activate(self, tenants: set[str]) -> None:
        newly = tenants - self._backlogged
        if newly:
            still = self._backlogged & tenants
            floor = min((self.service.get(t, 0.0) for t in still), default=None)
            if floor is None:  # nobody was waiting: everyone starts level, at the frontier
                floor = max(self.service.values(), default=0.0)
            for t in newly:
                self.service[t] = max(self.service.get(t, 0.0), floor)
        self._backlogged = tenants
        if len(self.service) > 4 * max(1, len(tenants)) + 1024:
            # Forget tenants that are long gone (bounded memory); they restart at the floor.
            keep = {t: v for t, v in self.service.items() if t in tenants}
            self.service = keep


def victim_key(req: Request, admitted_index: int) -> tuple:
    """Preemption picks the smallest key: the least important class first, then the
    request preempted least often (so one request is not preempted over and over), then the
    cheapest to redo (fewest computed tokens), then the most recently admitted."""
    return (-req.priority, req.num_preemptions, req.num_computed_tokens, -admitted_index)
