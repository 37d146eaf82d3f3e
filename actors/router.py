"""The router actor: between the tokenizer and the scheduler.

It applies the admission gate, forwards (aborts keep their order behind their request),
and acknowledges each admitted request on its stream (an empty RequestOutput), so
that the front end knows the request passed validation before its first token exists. The gate bounds memory under overload: at most `max_num_seqs` requests can run, and
at most `max_waiting` more may queue behind them; a request beyond that ends at once with an
"overloaded" error (HTTP 429 with Retry-After) instead of growing the queue without bound.

Everything in and out is a msgspec Struct, so the seam can later route across several
engine workers or processes: only `forward` would change.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from tokenloom.actors.base import Actor, resolve
from tokenloom.actors.messages import (ERROR_OVERLOADED, AddRequest,
                                       GetRouterStats, RequestFinished, RequestOutput,
                                       RouterStats, Shutdown)


class AdmissionGate:
    """Pure count of requests in flight (forwarded, not yet finished). A count, not a
    registry of ids: request ids are unique by the time they get here (the stream registry
    refuses a second stream with the same id), and the scheduler is the one registry of
    live requests on the engine side."""

    def __init__(self, max_running: int, max_waiting: int):
        self.capacity = max_running + max_waiting
        self.max_waiting = max_waiting
        self.in_flight = 0
        self.num_rejected = 0

    def admit(self) -> bool:
        """Count one more request in flight, or refuse it (False) when the queue is full."""
        if self.in_flight >= self.capacity:
            self.num_rejected += 1
            return False
        self.in_flight += 1
        return True

    def done(self) -> None:
        """A forwarded request has finished (its RequestFinished)."""
        assert self.in_flight > 0, "a request finished that the router never forwarded"
        self.in_flight -= 1


class RouterActor(Actor):
    name = "router"

    def __init__(self, max_running: int, max_waiting: int,
                 emit: Callable[[RequestOutput], None]):
        super().__init__()
        self.gate = AdmissionGate(max_running, max_waiting)
        self.emit = emit
        self.next_inbox: asyncio.Queue | None = None  # the scheduler; wired by the engine

    def _add(self, msg: AddRequest) -> None:
        if self.gate.admit():
            msg.routed_time = time.monotonic()
            self.next_inbox.put_nowait(msg)
            # The acknowledgement: an empty output telling the stream's owner that the request
            # is admitted (an HTTP handler can start its 200 stream) and how long its prompt is.
            self.emit(RequestOutput(request_id=msg.request_id, new_token_ids=[],
                                    num_prompt_tokens=len(msg.prompt_token_ids)))
            return
        error = (f"the server is overloaded: {self.gate.max_waiting} requests are already "
                 f"waiting; retry later")
        self.log.warning("request refused", request_id=msg.request_id, reason="overloaded")
        self.emit(RequestOutput(request_id=msg.request_id, new_token_ids=[], finished=True,
                                finish_reason="error", error=error, error_kind=ERROR_OVERLOADED))

    async def run(self) -> None:
        while True:
            msg = await self.inbox.get()
            match msg:
                case AddRequest():
                    self._add(msg)
                case RequestFinished():
                    self.gate.done()
                case GetRouterStats(reply=reply):
                    resolve(reply, RouterStats(in_flight=self.gate.in_flight,
                                               capacity=self.gate.capacity,
                                               num_rejected=self.gate.num_rejected))
                case Shutdown():
                    return
                case _:
                    self.next_inbox.put_nowait(msg)
