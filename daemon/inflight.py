"""The HTTP generation requests in flight, by the id the client sees (`cmpl-…`).

One HTTP request may run as several engine requests (prompts × n: `<id>-<index>`), so the
admin `cancel <id>` finds them here, and drain counts what this holds: a request is in flight
from before its engine requests are submitted until its handler returns (for a stream,
after the last byte; aiohttp's shutdown still waits for a non-streamed body to be written).
"""

from __future__ import annotations

from typing import Protocol


class _Generation(Protocol):
    choices: dict  # engine request id -> choice


class InFlight:
    def __init__(self) -> None:
        self._active: dict[str, _Generation] = {}

    def add(self, request_id: str, generation: _Generation) -> None:
        self._active[request_id] = generation

    def remove(self, request_id: str) -> None:
        self._active.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._active)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._active

    def ids(self) -> list[str]:
        return list(self._active)

    def engine_ids(self, request_id: str) -> list[str]:
        """The engine request ids behind a client id (all its choices), or [request_id] if
        it names one engine request of a request in flight; [] if unknown."""
        gen = self._active.get(request_id)
        if gen is not None:
            return list(gen.choices)
        if any(request_id in g.choices for g in self._active.values()):
            return [request_id]
        return []
