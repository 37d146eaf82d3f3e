"""The admin channel: a UNIX socket on the daemon's event loop, apart from the public API.

- Bound at `admin.socket_path` with mode 0660 (the directory — systemd's
  RuntimeDirectory — keeps everyone else out too).
- Every peer's credentials (SO_PEERCRED) are checked against `admin.allowed_uids` /
  `admin.allowed_gids` (default: the daemon's own uid and root); a refused peer gets an
  error reply, a warning is logged, and the connection is closed.
- Newline-delimited JSON (see `admin_protocol`): any number of commands per connection, one
  reply each. A malformed or unknown command gets an error reply; a line over
  `admin.max_line_bytes` or no complete line within `admin.read_timeout_seconds` gets an
  error reply and the connection is closed. Nothing a peer sends can stop the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import struct
import time
from pathlib import Path

import structlog

from tokenloom.config.schema import DEFAULT_ADMIN_SOCKET, AdminConfig
from tokenloom.daemon import logs
from tokenloom.daemon.admin import paths as admin_paths
from tokenloom.daemon.admin import protocol as P
from tokenloom.daemon.debug import record

log = structlog.get_logger("tokenloom.admin")

QUERY_TIMEOUT = 10.0  # seconds an actor query may take before the command fails


def peer_credentials(sock) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected AF_UNIX socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def supplementary_groups(pid: int) -> set[int]:
    """The peer's supplementary groups from /proc (best effort: empty if unreadable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def allowed(cfg: AdminConfig, uid: int, gid: int, groups: set[int] = frozenset(),
            own_uid: int | None = None) -> bool:
    """Whether a peer may send commands (see AdminConfig.allowed_uids/allowed_gids)."""
    if cfg.allowed_uids:
        uids = set(cfg.allowed_uids)
    else:
        uids = {0, os.getuid() if own_uid is None else own_uid}
    return uid in uids or bool(set(cfg.allowed_gids) & ({gid} | set(groups)))


class AdminServer:
    def __init__(self, state, cfg: AdminConfig):
        self.state = state
        self.cfg = cfg
        self.path = cfg.socket_path
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    # -- lifetime ------------------------------------------------------------------------
    async def start(self) -> bool:
        """Bind the socket. At the default path, when /run/tokenloom is missing or not
        writable (an unprivileged `make serve`), fall back to the per-user directory of
        `admin_paths`; False (with a warning) when that fails too. A configured path that
        cannot be bound raises."""
        paths = admin_paths.candidates(self.cfg.socket_path)
        errors = []
        for i, path in enumerate(paths):
            try:
                if i > 0:
                    admin_paths.ensure_private_dir(path)
                await self._bind(path)
            except OSError as e:
                errors.append(f"{path}: {e.strerror or e}")
                continue
            self.path = path
            if i > 0:
                log.warning("admin socket at the per-user fallback path: cannot bind the "
                            "default path", path=path, default=paths[0], error=errors[0])
            else:
                log.info("admin socket listening", path=path)
            return True
        if self.cfg.socket_path != DEFAULT_ADMIN_SOCKET:
            raise OSError(f"cannot bind the admin socket admin.socket_path="
                          f"{self.cfg.socket_path}: {errors[0]}")
        log.warning("admin socket disabled: cannot bind the default path or the per-user "
                    "fallback (run under systemd, or set admin.socket_path)", errors=errors)
        return False

    async def _bind(self, path: str) -> None:
        _remove_stale(path)
        old_umask = os.umask(0o117)  # the socket is born 0660: no window with wider access
        try:
            self._server = await asyncio.start_unix_server(
                self._client, path=path, limit=self.cfg.max_line_bytes)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o660)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for w in list(self._writers):
            w.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        self._server = None

    # -- one connection ------------------------------------------------------------------
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            if await self._check_peer(writer):
                await self._serve(reader, writer)
        except ConnectionError:
            pass  # the peer went away
        except Exception as e:  # a bug: end this connection only
            log.exception("admin connection failed", error=repr(e))
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _check_peer(self, writer: asyncio.StreamWriter) -> bool:
        try:
            pid, uid, gid = peer_credentials(writer.get_extra_info("socket"))
        except OSError as e:
            log.warning("admin peer refused: no credentials", error=str(e))
            await self._send(writer, P.ErrorReply(code="forbidden", error="no peer credentials"))
            return False
        if allowed(self.cfg, uid, gid, supplementary_groups(pid) if self.cfg.allowed_gids
                   else set()):
            return True
        log.warning("admin peer refused", pid=pid, uid=uid, gid=gid)
        await self._send(writer, P.ErrorReply(
            code="forbidden", error=f"permission denied: uid {uid} gid {gid} is not allowed "
                                    f"(admin.allowed_uids / admin.allowed_gids)"))
        return False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        timeout = self.cfg.read_timeout_seconds
        while True:
            try:
                line = await asyncio.wait_for(reader.readuntil(b"\n"), timeout)
            except asyncio.TimeoutError:
                await self._send(writer, P.ErrorReply(
                    code="timeout", error=f"no complete command within {timeout:g} s"))
                return
            except asyncio.LimitOverrunError:
                await self._send(writer, P.ErrorReply(
                    code="line_too_long",
                    error=f"command line longer than {self.cfg.max_line_bytes} bytes"))
                return
            except asyncio.IncompleteReadError as e:
                if e.partial.strip():
                    await self._send(writer, P.ErrorReply(
                        code="bad_request", error="the command line must end with a newline"))
                return  # the peer closed
            if not line.strip():
                continue
            try:
                reply = await self.handle(P.decode_command(line))
            except P.ProtocolError as e:
                reply = e.reply
            await self._send(writer, reply)

    async def _send(self, writer: asyncio.StreamWriter, reply) -> None:
        writer.write(P.encode(reply))
        await writer.drain()

    # -- commands ------------------------------------------------------------------------
    async def handle(self, cmd: P.Command):
        """One command -> its reply; every failure is an ErrorReply."""
        log.info("admin command", command=cmd.__struct_config__.tag,
                 args={f: getattr(cmd, f) for f in cmd.__struct_fields__})
        try:
            match cmd:
                case P.Stats():
                    return await self.stats()
                case P.FlushCache(force=force):
                    return await self.flush_cache(force)
                case P.Drain(timeout=timeout, wait=wait):
                    drain = self.state.drain
                    progress = drain.begin(timeout, reason="admin")
                    if wait:
                        progress = await drain.wait()
                    return P.DrainReply(progress=progress)
                case P.Resume():
                    return P.ResumeReply(was_draining=self.state.drain.resume())
                case P.Cancel(request_id=rid):
                    return self.cancel(rid)
                case P.Trace(request_id=rid):
                    return await self.trace(rid)
                case P.SetLogLevel(level=level):
                    return P.LogLevelReply(level=level, previous=logs.set_level(level))
                case P.RecordStart(path=path, content=content, max_bytes=max_bytes):
                    self._engine()
                    try:
                        rec = record.start(self.state, path, content, max_bytes)
                    except OSError as e:
                        raise _Refused("refused", f"cannot write the capture: {e}") from None
                    return P.RecordReply(recording=True, **rec.stats())
                case P.RecordStop():
                    return P.RecordReply(recording=False, **record.stop(self.state))
        except _Refused as e:
            return P.ErrorReply(code=e.code, error=str(e))
        except RuntimeError as e:
            return P.ErrorReply(code="refused", error=str(e))
        except asyncio.TimeoutError:
            return P.ErrorReply(code="unavailable",
                                error=f"the engine did not answer within {QUERY_TIMEOUT:g} s")
        except Exception as e:
            log.exception("admin command failed", error=repr(e))
            return P.ErrorReply(code="internal", error=f"internal error: {e!r}")
        return P.ErrorReply(code="unknown_command", error="unhandled command")

    def _engine(self):
        engine = self.state.engine
        task = self.state.engine_task
        if engine is None or task is None or task.done():
            raise _Refused("unavailable", "the engine is not running")
        return engine

    async def stats(self) -> P.StatsReply:
        engine = self._engine()
        return P.StatsReply(
            model=self.state.model_name, ready=self.state.ready,
            uptime_seconds=round(time.time() - self.state.started, 3),
            log_level=logs.current_level(), in_flight=len(self.state.inflight),
            engine_stalled_seconds=round(engine.stalled_seconds(), 3),
            drain=self.state.drain.progress(),
            engine=await asyncio.wait_for(engine.stats(), QUERY_TIMEOUT),
            process=self.process_stats(), workers=await self.worker_infos(engine),
            disaggregation=await self.disaggregation(engine))

    async def disaggregation(self, engine) -> dict | None:
        """The worker pool's prefill/decode handoffs, or this daemon's KV transfers with
        other daemons ([kv_transfer]); None when neither is configured."""
        stats = await asyncio.wait_for(engine.worker_stats(), QUERY_TIMEOUT)
        if stats is not None and stats.routing.disaggregation is not None:
            return stats.routing.disaggregation
        kv = self.state.kv_transfer
        return {"mode": "kv_transfer", **kv.stats()} if kv is not None else None

    async def worker_infos(self, engine) -> list[P.WorkerInfo]:
        """Per worker process (none with the in-process engine)."""
        stats = await asyncio.wait_for(engine.worker_stats(), QUERY_TIMEOUT)
        if stats is None:
            return []
        routing, out = stats.routing, []
        for st in stats.statuses:
            w = st.worker
            mine = stats.engines.get(w)
            out.append(P.WorkerInfo(
                worker=w, up=st.up, pid=st.pid, restarts=st.restarts,
                last_exit_code=st.last_exit_code, draining=st.draining,
                in_flight=routing.in_flight[w], routed=routing.routed[w],
                expected_hit_blocks=routing.expected_hit_blocks[w],
                kv_usage=routing.kv_usage[w],
                prefix_cache_hit_rate=round(mine.kv.prefix_cache.hit_rate, 6) if mine else 0.0,
                role=st.role))
        return out

    def process_stats(self) -> P.ProcessStats:
        """Read from /proc and the event loop: cheap, and meaningful for leak checks."""
        import threading

        rss = 0
        with contextlib.suppress(OSError, ValueError, IndexError):
            rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        try:
            fds = len(os.listdir("/proc/self/fd"))
        except OSError:
            fds = 0
        c = self.state.connections
        engine = self.state.engine
        return P.ProcessStats(
            rss_bytes=rss, open_fds=fds, asyncio_tasks=len(asyncio.all_tasks()),
            threads=threading.active_count(),
            connections_open=c.open if c is not None else 0,
            connections_refused=c.refused if c is not None else 0,
            header_timeouts=c.header_timeouts if c is not None else 0,
            slow_readers_cut=c.slow_readers_cut if c is not None else 0,
            streams_open=len(engine.streams) if engine is not None else 0)

    async def flush_cache(self, force: bool) -> P.FlushCacheReply:
        r = await asyncio.wait_for(self._engine().flush_prefix_cache(force), QUERY_TIMEOUT)
        if r.refused_reason:
            raise _Refused("refused", f"cache flush refused: {r.refused_reason}")
        log.info("prefix cache flushed", freed_blocks=r.freed, force=force)
        return P.FlushCacheReply(freed=r.freed)

    def cancel(self, request_id: str) -> P.CancelReply:
        """End a running request: its client gets an error (a stream's last event, or a 503)
        and the engine aborts it, freeing its KV blocks within one iteration. Takes the id
        the client sees (all its choices) or one engine request id."""
        from tokenloom.actors.messages import ERROR_INTERNAL

        engine = self._engine()
        rids = self.state.inflight.engine_ids(request_id)
        if not rids and request_id in engine.streams:
            rids = [request_id]  # an engine request outside the HTTP layer
        if not rids:
            raise _Refused("not_found", f"no running request {request_id!r}")
        for rid in rids:
            engine.streams.fail(rid, "cancelled by the operator", ERROR_INTERNAL,
                                finish_reason="abort")
            engine.abort(rid)
        log.warning("request cancelled by the operator", request_id=request_id,
                    engine_request_ids=rids)
        return P.CancelReply(request_id=request_id, cancelled=rids)

    async def trace(self, request_id: str) -> P.TraceReply:
        """The engine's trace of a recent request, by the id the client saw (all its
        choices) or one engine request id."""
        engine = self._engine()
        trace = await asyncio.wait_for(engine.trace(request_id), QUERY_TIMEOUT)
        if trace is None:
            raise _Refused("not_found", f"no trace for request {request_id!r} (unknown, or "
                                        f"no longer among the recent requests)")
        return P.TraceReply(request_id=request_id, trace=trace)


class _Refused(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def _remove_stale(path: str) -> None:
    """Remove a socket file left by a daemon that died; refuse to steal a live one."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(17, f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    except OSError:
        return  # let bind report it
    finally:
        probe.close()
    raise OSError(98, f"another daemon is listening on {path}")


async def admin_ctx(app):
    """cleanup_ctx (after the engine's): serve the admin socket while the app runs."""
    from tokenloom.daemon.state import STATE

    state = app[STATE]
    server = AdminServer(state, state.config.admin) if state.config.admin.enabled else None
    if server is not None and not await server.start():
        server = None
    try:
        yield
    finally:
        if server is not None:
            await server.close()
