"""The Responses API's store: responses created with `store: true`, kept in memory so that a
later request can continue the conversation with `previous_response_id` (or fetch one with
GET /v1/responses/{id}).

Bounded twice, as a cache: at most `max_entries` responses (the oldest go first) and each
for at most `ttl_seconds` after it was stored. A response that has gone is a 404 to the
client, as OpenAI answers an unknown id. What is kept per response: the response object as
sent, and the conversation it ended (its input, without its `instructions`, which OpenAI
does not carry over, then its output), as chat messages.

Pure: no asyncio. `now` is injectable for tests.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    response: dict                 # the response object as the client got it
    conversation: tuple            # prompt_inputs.ChatMessage: input then output
    expires: float


class ResponseStore:
    def __init__(self, max_entries: int, ttl_seconds: float,
                 now: Callable[[], float] = time.monotonic):
        self.max_entries = max_entries
        self.ttl_seconds = ttl_seconds
        self._now = now
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def put(self, response_id: str, response: dict, conversation: list) -> None:
        if not self.enabled:
            return
        self._expire()
        self._entries[response_id] = StoredResponse(response, tuple(conversation),
                                                    self._now() + self.ttl_seconds)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        # Stored in time order with one TTL: the expired ones are the oldest.
        now = self._now()
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.expires > now:
                break
            self._entries.popitem(last=False)
