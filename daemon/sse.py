"""Server-sent events as OpenAI streams them: `data: <json>` frames, each ending with a blank
line, and `data: [DONE]` last."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

DONE = b"data: [DONE]\n\n"
_raw = msgspec.json.Encoder().encode
# JSON allows U+0085, U+2028 and U+2029 raw inside strings, but str.splitlines splits on them,
# and so does httpx's `aiter_lines`, which SSE clients such as guidellm read streams with: a
# token whose text holds one would cut its frame in two. Escaped, every frame stays one line.
# (UTF-8 is self-synchronising: these byte sequences are those characters, nothing else.)
_SEPARATORS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"),
               (b"\xe2\x80\xa9", b"\\u2029"))


def encode(value: Any) -> bytes:
    """JSON bytes of one value (for splicing into prepared frames), line separators escaped."""
    data = _raw(value)
    if b"\xc2\x85" in data or b"\xe2\x80" in data:
        for raw, escaped in _SEPARATORS:
            data = data.replace(raw, escaped)
    return data


_encode = encode


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
