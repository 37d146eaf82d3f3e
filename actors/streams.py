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

    def open(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already streaming")
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
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

    def __len__(self) -> int:
        return len(self._queues)
