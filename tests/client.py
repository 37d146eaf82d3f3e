"""The tests' one HTTP client, for a server from tests/servers.py (or any URL).

- blocking, on urllib (a test that is not async, a helper thread): `get`, `post`, `metrics`;
- async, on aiohttp (a test that streams, or runs requests side by side): `aget`, `apost`,
  `ametric`, `read_events`;
- SSE as the OpenAI API frames it: `parse_sse` checks the framing of a whole stream,
  `read_events` parses events as they arrive;
- Prometheus text: `metric` sums the samples of one metric (optionally by label);
- the admin UNIX socket: `admin` sends one JSON command and returns the JSON reply.

Each call takes the server (anything with a `.url`, e.g. a ServerThread) or a base URL, and a
path. Bodies come back parsed: JSON when the server says it is JSON, else text (blocking) or
bytes (async: an SSE stream for `parse_sse`; `aget` always bytes). HTTP errors are answers,
not exceptions: every call returns the status with the body.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request


def _decode(raw: bytes, content_type: str):
    if content_type.startswith("application/json"):
        return json.loads(raw) if raw else None
    return raw.decode("utf-8")


def url_of(server, path: str = "") -> str:
    return (server if isinstance(server, str) else server.url) + path


def get(server, path: str = "", timeout: float = 60) -> tuple[int, object]:
    """(status, body) of GET `path`."""
    url = url_of(server, path)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, _decode(r.read(), r.headers.get("Content-Type", ""))
    except urllib.error.HTTPError as e:
        return e.code, _decode(e.read(), e.headers.get("Content-Type", ""))


def post(server, path: str, body: dict, headers: dict | None = None,
         timeout: float = 60) -> tuple[int, object]:
    """(status, body) of POST `path` with the JSON `body`."""
    req = urllib.request.Request(url_of(server, path), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, _decode(r.read(), r.headers.get("Content-Type", ""))
    except urllib.error.HTTPError as e:
        return e.code, _decode(e.read(), e.headers.get("Content-Type", ""))


def metrics(server) -> str:
    """The Prometheus text of the server's /metrics (asserted 200)."""
    status, text = get(server, "/metrics", timeout=30)
    assert status == 200, text
    return text


def metric(text: str, name: str, **labels) -> float:
    """The sum of the samples of `name` in Prometheus `text` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def apost(server, path: str, body: dict, session=None,
                **kw) -> tuple[int, object, dict]:
    """(status, body, headers) of POST `path` with the JSON `body` (aiohttp; `kw` goes to
    `session.post`). A non-JSON body (an SSE stream) comes back as bytes."""
    async with _Session(session) as s:
        async with s.post(url_of(server, path), json=body, **kw) as r:
            raw = await r.read()
            ctype = r.headers.get("Content-Type", "")
            data = json.loads(raw) if ctype.startswith("application/json") else raw
            return r.status, data, r.headers.copy()


async def aget(server, path: str = "", session=None, **kw) -> tuple[int, bytes, dict]:
    """(status, raw body, headers) of GET `path` (aiohttp)."""
    async with _Session(session) as s:
        async with s.get(url_of(server, path), **kw) as r:
            return r.status, await r.read(), r.headers.copy()


async def ametric(server, name: str, **labels) -> float:
    """`metric` of the server's /metrics, scraped without blocking the event loop."""
    status, raw, _ = await aget(server, "/metrics")
    assert status == 200, raw
    return metric(raw.decode(), name, **labels)


class _Session:
    """The caller's aiohttp session, or a new one closed on exit."""

    def __init__(self, session):
        self.given, self.own = session, None

    async def __aenter__(self):
        if self.given is not None:
            return self.given
        import aiohttp
        self.own = aiohttp.ClientSession()
        return self.own

    async def __aexit__(self, *exc):
        if self.own is not None:
            await self.own.close()


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


def admin(socket_path: str, command: dict, timeout: float = 30) -> dict:
    """One command on the admin UNIX socket (one JSON line each way)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        s.sendall(json.dumps(command).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf)
