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

    def fail(self, request_id: str, error: str, error_kind: str,
             finish_reason: str = "error") -> bool:
        """End one open stream with an error output; False if it is not open. The engine
        request itself is not touched: abort it too unless the engine is gone. finish_reason
        "abort" (with the error) tells the HTTP layer it was ended from outside (503)."""
        if request_id not in self._queues:
            return False
        self.emit(RequestOutput(request_id=request_id, new_token_ids=[], finished=True,
                                finish_reason=finish_reason, error=error, error_kind=error_kind))
        return True

    def fail_all(self, error: str, error_kind: str, finish_reason: str = "error") -> int:
        """End every open stream with an error output (the engine stopped under them)."""
        ids = list(self._queues)
        for rid in ids:
            self.fail(rid, error, error_kind, finish_reason)
        return len(ids)

    def ids(self) -> list[str]:
        return list(self._queues)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queues

    def __len__(self) -> int:
        return len(self._queues)
