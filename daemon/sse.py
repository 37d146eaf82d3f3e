"""Server-sent events as OpenAI streams them: `data: <json>` frames, each ending with a blank
line, and `data: [DONE]` last."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode
encode = _encode  # JSON bytes of one value (for splicing into prepared frames)


def frame(payload: Any) -> bytes:
    """One event; `payload` is anything msgspec encodes (dicts, Structs)."""
    return b"data: " + _encode(payload) + b"\n\n"


async def open_stream(request: web.Request, headers: dict[str, str] | None = None
                      ) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",   # proxies must not hold frames back
        **(headers or {}),
    })
    await resp.prepare(request)
    return resp
