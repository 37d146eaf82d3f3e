"""The stream registry: request id -> the queue its outputs are delivered to.

The scheduler emits RequestOutputs here; whoever opened the stream (the offline API or an
HTTP handler) consumes them. Outputs for a stream nobody holds any more are dropped.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Protocol

from tokenloom.actors.messages import ERROR_INTERNAL, RequestOutput


class OutputQueue(Protocol):
    """Where a stream's outputs go: an asyncio.Queue of its owner's (put from the loop)."""

    def put_nowait(self, item: RequestOutput) -> None: ...


class StreamRegistry:
    def open(self, request_id: str, queue: OutputQueue) -> OutputQueue:
        """Deliver request_id's outputs to `queue` (several requests may share one, e.g. the
        n choices of one HTTP request)."""
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already streaming")
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def __init__(self) -> None:
        self._queues: dict[str, OutputQueue] = {}
        # Called with the request id when delivering to its stream failed (the engine
        # aborts it); None: nobody to tell.
        self.on_delivery_failure: Callable[[str], None] | None = None

    def emit(self, out: RequestOutput) -> None:
        """Deliver `out` to its stream. A delivery that raises ends only that stream: it is
        closed with an error output (best effort), its request is reported through
        `on_delivery_failure`, and the caller (the scheduler's loop) never sees the error."""
        q = self._queues.get(out.request_id)
        if q is not None:
            try:
                self._deliver(q, out)
            except Exception as e:  # noqa: BLE001 - one stream's failure is its own
                self._queues.pop(out.request_id, None)
                error = RequestOutput(request_id=out.request_id, new_token_ids=[],
                                      finished=True, finish_reason="error",
                                      error=f"delivering the request's output failed: {e!r}",
                                      error_kind=ERROR_INTERNAL)
                with contextlib.suppress(Exception):
                    q.put_nowait(error)
                if not out.finished and self.on_delivery_failure is not None:
                    self.on_delivery_failure(out.request_id)
                return
        if out.finished:
            self._queues.pop(out.request_id, None)

    def deliver(self, out) -> None:
        """Put an output that does not end its stream (messages.PooledOutput, from the
        runner) on its request's queue, ahead of the finished output that follows it; one
        for a stream nobody holds any more is dropped."""
        q = self._queues.get(out.request_id)
        if q is not None:
            with contextlib.suppress(Exception):   # (its finished output still ends it)
                q.put_nowait(out)

    @staticmethod
    def _deliver(queue: OutputQueue, out: RequestOutput) -> None:
        queue.put_nowait(out)

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
