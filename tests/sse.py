"""A raw SSE reader for tests: checks the framing as it parses."""

from __future__ import annotations

import json


def parse_sse(raw: bytes) -> list:
    """Events of a complete OpenAI stream: JSON objects, then "[DONE]" (asserted last).
    Every frame must be `data: ...` ending with a blank line."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), "the stream must end with a blank line"
    events = []
    for frame in text[:-2].split("\n\n"):
        assert frame.startswith("data: ") and "\n" not in frame, f"bad frame {frame!r}"
        data = frame[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events and events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events


async def read_events(resp, limit: int | None = None) -> list:
    """Read SSE events from an aiohttp response as they arrive (up to `limit` JSON events)."""
    events, buf = [], b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            frame, buf = buf.split(b"\n\n", 1)
            data = frame.decode()[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if limit is not None and len(events) >= limit:
                return events
    return events
