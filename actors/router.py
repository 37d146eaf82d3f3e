"""The router actor: between the tokenizer and the scheduler.

It keeps request ids unique among the requests in flight, applies the admission gate,
forwards, and acknowledges each admitted request on its stream (an empty RequestOutput), so
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

from tokenloom.actors.base import Actor, Control, resolve
from tokenloom.actors.messages import (ERROR_INVALID, ERROR_OVERLOADED, AbortRequest, AddRequest,
                                       RequestFinished, RequestOutput, Shutdown)


class AdmissionGate:
    """Pure bookkeeping of requests in flight (forwarded, not yet finished)."""

    def __init__(self, max_running: int, max_waiting: int):
        self.capacity = max_running + max_waiting
        self.max_waiting = max_waiting
        self.in_flight: set[str] = set()
        self.num_rejected = 0

    def admit(self, request_id: str) -> str | None:
        """Record `request_id` as in flight, or return why it may not enter."""
        if request_id in self.in_flight:
            return "duplicate"
        if len(self.in_flight) >= self.capacity:
            self.num_rejected += 1
            return "overloaded"
        self.in_flight.add(request_id)
        return None

    def done(self, request_id: str) -> None:
        self.in_flight.discard(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.in_flight


class RouterActor(Actor):
    name = "router"

    def __init__(self, max_running: int, max_waiting: int,
                 emit: Callable[[RequestOutput], None]):
        super().__init__()
        self.gate = AdmissionGate(max_running, max_waiting)
        self.emit = emit
        self.next_inbox: asyncio.Queue | None = None  # the scheduler; wired by the engine

    def _add(self, msg: AddRequest) -> None:
        refusal = self.gate.admit(msg.request_id)
        if refusal is None:
            msg.routed_time = time.monotonic()
            self.next_inbox.put_nowait(msg)
            # The acknowledgement: an empty output telling the stream's owner that the request
            # is admitted (an HTTP handler can start its 200 stream) and how long its prompt is.
            self.emit(RequestOutput(request_id=msg.request_id, new_token_ids=[],
                                    num_prompt_tokens=len(msg.prompt_token_ids)))
            return
        if refusal == "duplicate":
            error, kind = f"request id {msg.request_id!r} is already in flight", ERROR_INVALID
        else:
            error = (f"the server is overloaded: {self.gate.max_waiting} requests are already "
                     f"waiting; retry later")
            kind = ERROR_OVERLOADED
        self.log.warning("request refused", request_id=msg.request_id, reason=refusal)
        self.emit(RequestOutput(request_id=msg.request_id, new_token_ids=[], finished=True,
                                finish_reason="error", error=error, error_kind=kind))

    def _abort(self, msg: AbortRequest) -> None:
        # Only requests that went through; behind their AddRequest in the scheduler's inbox.
        if msg.request_id in self.gate:
            self.next_inbox.put_nowait(msg)

    async def run(self) -> None:
        while True:
            msg = await self.inbox.get()
            match msg:
                case AddRequest():
                    self._add(msg)
                case AbortRequest():
                    self._abort(msg)
                case RequestFinished(request_id=rid):
                    self.gate.done(rid)
                case Control(op="stats", reply=reply):
                    resolve(reply, {"in_flight": len(self.gate.in_flight),
                                    "capacity": self.gate.capacity,
                                    "num_rejected": self.gate.num_rejected})
                case Shutdown():
                    return
                case _:
                    self.next_inbox.put_nowait(msg)
