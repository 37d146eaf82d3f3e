"""Connection-level defences the HTTP framework does not have: a cap on open connections
and a deadline for a request's headers (slow-loris clients).

`GuardedTCPSite` is aiohttp's TCPSite whose protocol factory wraps each connection's
RequestHandler in a `_Guard`:
- over `server.max_connections` open connections, a new one is answered with a 503 JSON
  error and closed before anything is read (it never reaches the application);
- from a connection's first byte of a request (or from its opening), the request's headers
  must be complete within `server.header_timeout_seconds`, else the connection is closed.
  Idle keep-alive connections are closed by aiohttp's keep-alive timeout; a body that
  trickles in is the handler's read timeout (openai_api.read_body); a reader that takes no
  data is the stream's write timeout (openai_api._Writer).
"""

from __future__ import annotations

import asyncio
import dataclasses

import structlog
from aiohttp import web

log = structlog.get_logger("tokenloom.http")

_BUSY_BODY = (b'{"error": {"message": "too many open connections (server.max_connections)", '
              b'"type": "server_error", "param": null, "code": "service_unavailable"}}')
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
        + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


@dataclasses.dataclass
class ConnectionStats:
    max_connections: int
    header_timeout: float
    open: int = 0
    refused: int = 0              # over the cap
    header_timeouts: int = 0      # closed for slow headers
    slow_readers_cut: int = 0     # streams cut off by server.write_timeout_seconds


class _Guard(asyncio.Protocol):
    """Delegates to aiohttp's RequestHandler; adds the cap and the header deadline.
    `_request_count` is aiohttp's count of requests whose headers were parsed."""

    def __init__(self, stats: ConnectionStats, handler: web.RequestHandler):
        self.stats = stats
        self.handler = handler
        self.transport: asyncio.Transport | None = None
        self._admitted = False
        self._timer: asyncio.TimerHandle | None = None
        self._parsed = 0

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.stats.open >= self.stats.max_connections:
            self.stats.refused += 1
            transport.write(BUSY)
            transport.close()
            return
        self._admitted = True
        self.stats.open += 1
        self.handler.connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._parsed = self.handler._request_count
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.stats.header_timeout, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self.handler._request_count == self._parsed and self.transport is not None:
            self.stats.header_timeouts += 1
            log.info("connection closed: request headers not received in time",
                     seconds=self.stats.header_timeout)
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        self.handler.data_received(data)
        if self.handler._request_count != self._parsed:   # headers complete
            self._parsed = self.handler._request_count
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        elif self._timer is None and not self.handler._request_in_progress:
            self._arm()          # the first bytes of the next request on a kept-alive one

    def eof_received(self):
        if self._admitted:
            return self.handler.eof_received()
        return None

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._admitted:
            self._admitted = False
            self.stats.open -= 1
            self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._admitted:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self.handler.resume_writing()


class GuardedTCPSite(web.TCPSite):
    def __init__(self, runner: web.BaseRunner, host: str, port: int, stats: ConnectionStats):
        super().__init__(runner, host, port)
        self.stats = stats

    async def start(self) -> None:
        await web.BaseSite.start(self)   # registers the site with the runner
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        self._server = await loop.create_server(
            lambda: _Guard(self.stats, server()), self._host, self._port,
            backlog=self._backlog, reuse_address=self._reuse_address,
            reuse_port=self._reuse_port)


def bind_problem(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound right now (one line naming it and the fix), or None.

    `tokenloom serve` asks before it loads the model, so an occupied port costs a second, not
    a model load followed by the event loop's traceback. The probe binds the way the site will
    (SO_REUSEADDR, every address `host` resolves to) and closes at once; port 0 always binds.
    """
    import errno
    import socket

    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot bind {host}:{port}: {e.strerror} (check --host)"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return (f"{host}:{port} is already in use (another server is listening "
                            f"there); stop it or choose another port with --port")
                if e.errno == errno.EACCES:
                    return (f"cannot bind {host}:{port}: permission denied (ports below 1024 "
                            f"need privileges); choose another port with --port")
                return f"cannot bind {host}:{port}: {e.strerror} (check --host and --port)"
    return None
