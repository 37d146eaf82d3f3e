"""The per-request trace: when each step of a request's life happened, so a slow request can
be explained by mechanism (queued? waiting for KV? preempted? stalled between tokens?).

Events are (name, monotonic seconds). Decode iterations are not stored one by one (a long
generation would grow the trace without bound); their count and gap statistics are. The
scheduler owns one RequestTrace per request and keeps the finished ones in a bounded
history (`TraceHistory`) for `GET /v1/requests/{id}/trace` and `tokenloom admin trace`.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import msgspec

from tokenloom.actors.messages import RequestMeta

# The events, in the order they normally happen. `preempted` / `resumed` may repeat.
EVENTS = ("request_received", "tokenized", "routed", "kv_tier_lookup", "kv_tier_ready",
          "prefix_cache_lookup_done", "admitted",
          "prefill_started", "prefill_finished", "first_token", "preempted", "resumed",
          "final_token", "kv_blocks_released")


class RequestTrace:
    __slots__ = ("request_id", "events", "num_decode_iterations", "_last_token", "max_gap",
                 "sum_gaps", "preemptions", "plan", "finish_reason", "meta",
                 "prefill_chunks", "speculation", "kv_refusals", "tiers")

    def __init__(self, request_id: str, received: float, routed: float | None = None,
                 meta: RequestMeta = RequestMeta(), tokenized: float | None = None):
        self.request_id = request_id
        self.events: list[tuple[str, float]] = [("request_received", received)]
        if tokenized is not None:
            self.events.append(("tokenized", tokenized))
        if routed is not None:
            self.events.append(("routed", routed))
        self.num_decode_iterations = 0
        self.prefill_chunks = 0             # iterations that computed part of its prompt
        self._last_token: float | None = None
        self.max_gap = 0.0
        self.sum_gaps = 0.0
        self.preemptions: list[dict] = []   # one record per preemption (see scheduler)
        self.plan: dict | None = None       # the KV plan of the latest admission
        self.kv_refusals = 0                # steps it waited first in line, KV plan refused
        self.finish_reason: str | None = None
        self.meta = meta
        # (method, SpecState) when the request may speculate (see actors/speculation/controller.py)
        self.speculation = None
        # KV tiers: the restore plan (tier per block range, predicted times), what the
        # fetch and the admission got, and the outcome (actual times, regret).
        self.tiers: dict | None = None

    def mark(self, event: str, t: float | None = None) -> None:
        self.events.append((event, time.monotonic() if t is None else t))

    def has(self, event: str) -> bool:
        return any(name == event for name, _ in self.events)

    def token(self, t: float) -> None:
        """A token was produced at `t`: the first one is an event, later ones decode gaps."""
        if self._last_token is None:
            self.mark("first_token", t)
        else:
            gap = t - self._last_token
            self.num_decode_iterations += 1
            self.sum_gaps += gap
            if gap > self.max_gap:
                self.max_gap = gap
        self._last_token = t

    def as_dict(self, wall_offset: float | None = None) -> dict:
        """JSON-ready. Times are seconds since request_received; `received_at` is the Unix
        time of request_received (monotonic clocks have no meaning outside the process)."""
        if wall_offset is None:
            wall_offset = time.time() - time.monotonic()
        t0 = self.events[0][1]
        n = self.num_decode_iterations
        return {
            "request_id": self.request_id,
            "received_at": round(t0 + wall_offset, 6),
            "priority": self.meta.priority,
            "tenant": self.meta.tenant,
            "meta": msgspec.structs.asdict(self.meta),
            "events": [{"event": name, "t": round(t - t0, 6)} for name, t in self.events],
            "prefill_chunks": self.prefill_chunks,
            "decode": {"iterations": n,
                       "mean_gap_s": round(self.sum_gaps / n, 6) if n else None,
                       "max_gap_s": round(self.max_gap, 6) if n else None},
            "preemptions": list(self.preemptions),
            "kv_plan": self.plan,
            "kv_refusals": self.kv_refusals,
            "finish_reason": self.finish_reason,
            "speculation": (self.speculation[1].as_dict(self.speculation[0])
                            if self.speculation is not None else None),
            "kv_tiers": self.tiers,
        }


class TraceHistory:
    """Traces of the most recent `capacity` requests (live and finished), oldest evicted."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._traces: OrderedDict[str, RequestTrace] = OrderedDict()

    def add(self, trace: RequestTrace) -> None:
        if self.capacity <= 0:
            return
        self._traces[trace.request_id] = trace
        self._traces.move_to_end(trace.request_id)
        while len(self._traces) > self.capacity:
            self._traces.popitem(last=False)

    def get(self, request_id: str) -> RequestTrace | None:
        return self._traces.get(request_id)

    def find(self, request_id: str) -> list[RequestTrace]:
        """The trace of `request_id`, or of its choices (`{id}-0`, `{id}-1`, ...) when the
        client-visible id stands for several engine requests (n > 1, several prompts)."""
        exact = self._traces.get(request_id)
        if exact is not None:
            return [exact]
        prefix = request_id + "-"
        return [t for rid, t in self._traces.items()
                if rid.startswith(prefix) and rid[len(prefix):].isdigit()]

    def __len__(self) -> int:
        return len(self._traces)
