"""The stream registry: request id -> the queue its outputs are delivered to.

The scheduler emits RequestOutputs here; whoever opened the stream (the offline API or an
HTTP handler) consumes them. Outputs for a stream nobody holds any more are dropped.
"""

from __future__ import annotations

import asyncio

from tokenloom.actors.messages import RequestOutput


class StreamRegistry:
    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}

    def open(self, request_id: str,
             queue: asyncio.Queue[RequestOutput] | None = None) -> asyncio.Queue[RequestOutput]:
        """Deliver request_id's outputs to `queue` (a new one if None; several requests may
        share one, e.g. the n choices of one HTTP request)."""
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already streaming")
        q: asyncio.Queue[RequestOutput] = asyncio.Queue() if queue is None else queue
        self._queues[request_id] = q
        return q

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def emit(self, out: RequestOutput) -> None:
        q = self._queues.get(out.request_id)
        if q is not None:
            q.put_nowait(out)
        if out.finished:
            self._queues.pop(out.request_id, None)

    def fail_all(self, error: str, error_kind: str) -> int:
        """End every open stream with an error output (the engine stopped under them)."""
        ids = list(self._queues)
        for rid in ids:
            self.emit(RequestOutput(request_id=rid, new_token_ids=[], finished=True,
                                    finish_reason="error", error=error, error_kind=error_kind))
        return len(ids)

    def __len__(self) -> int:
        return len(self._queues)
