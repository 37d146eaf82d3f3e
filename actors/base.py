"""The actor shell: one inbox, one run loop, state owned by nobody else.

Messages are put with `send` from the actor's own event loop. Queries (tests, admin,
metrics) are typed messages carrying a reply future (see messages.py, "control").
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog


class Actor:
    name = "actor"

    def __init__(self, inbox: asyncio.Queue | None = None) -> None:
        # Given when another actor must know it before this one exists (a cycle: the
        # scheduler sends to the KV manager, which tells the scheduler of tier fetches).
        self.inbox: asyncio.Queue = inbox if inbox is not None else asyncio.Queue()
        # Every line names its actor; lines about a request also carry request_id.
        self.log = structlog.get_logger(f"tokenloom.{self.name}").bind(actor=self.name)

    def send(self, msg: Any) -> None:
        self.inbox.put_nowait(msg)

    async def run(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


def resolve(reply: asyncio.Future, value: Any) -> None:
    if not reply.done():
        reply.set_result(value)
