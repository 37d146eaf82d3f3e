"""The admin socket against an in-process server (tiny model): every command, the socket's
defences (malformed, unknown, oversize, silent and refused peers), the `tokenloom admin`
CLI, admin drain/resume, and /health plus watchdog pings with a wedged engine.

Engine timing is made deterministic with a gate on the model runner: while it is closed the
next model step blocks (a wedged runner), so a request is known to be running."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from structlog.testing import capture_logs

from notify_listener import NotifyListener
from servers import TOKENLOOM, wait_for
from client import read_events
from tokenloom.config.schema import AdminConfig
from tokenloom.daemon import logs
from tokenloom.daemon.admin import cli as admin_cli
from tokenloom.daemon.admin import protocol as P
from tokenloom.daemon.admin.server import AdminServer
from tokenloom.daemon.state import STATE

GREEDY = dict(temperature=0, ignore_eos=True)


class Gate:
    """Wraps ModelRunner.launch: while closed, the next step blocks until reopened.
    `close(after=k)` lets k more steps through first, so a test can know a request is still
    running however fast the engine is (its step k+1 waits at the gate)."""

    def __init__(self, model_runner):
        self.opened = threading.Event()
        self.opened.set()
        self.blocked = threading.Event()   # a step is waiting at the gate
        self._lock = threading.Lock()
        self._allowed = 0
        inner = model_runner.launch

        def launch(batch, prev=None):
            with self._lock:
                wait = not self.opened.is_set() and self._allowed == 0
                self._allowed = max(0, self._allowed - 1)
            if wait:
                self.blocked.set()
                self.opened.wait()
            return inner(batch, prev)

        model_runner.launch = launch

    def close(self, after: int = 0) -> None:
        with self._lock:
            if not self.opened.is_set():
                return  # already closed: a step may be waiting at it
            self.blocked.clear()
            self._allowed = after
            self.opened.clear()

    def open(self) -> None:
        self.opened.set()


@pytest.fixture(scope="module")
def admin_server(tiny_model_dir, tmp_path_factory):
    from servers import ServerThread, tiny_config

    tmp = tmp_path_factory.mktemp("admin")
    cfg = tiny_config(tiny_model_dir, tmp_path_factory.mktemp("cache"),
                      **{"admin.socket_path": str(tmp / "admin.sock"),
                         "server.health_stall_seconds": 0.5,
                         "server.retry_after_seconds": 7})
    s = ServerThread(cfg)
    s.socket_path = cfg.admin.socket_path
    s.gate = Gate(s.engine.runner.model_runner)
    s.state = s.app[STATE]
    yield s
    s.gate.open()
    s.close()


@pytest.fixture
def server(admin_server):
    """The module's server, checked back to normal after each test."""
    yield admin_server
    admin_server.gate.open()
    send(admin_server, P.Resume())
    logs.set_level("info")
    admin_server.wait_idle()


def send(server, cmd, path=None):
    return admin_cli.send(path or server.socket_path, cmd, timeout=30)


async def asend(server, cmd, path=None):
    return await asyncio.to_thread(send, server, cmd, path)


async def until(predicate, timeout: float = 30.0) -> None:
    """Poll `predicate` with a deadline (no fixed sleeps: a loaded 2-core box is slow)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached within the deadline"
        await asyncio.sleep(0.01)


def raw_exchange(path: str, payload: bytes, timeout: float = 10.0) -> list[dict]:
    """Send raw bytes (or nothing), then read reply lines until the daemon closes or stays
    quiet for `timeout` seconds."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        if payload:
            try:
                s.sendall(payload)
            except (BrokenPipeError, ConnectionResetError):
                pass  # a refused peer may be answered and hung up on before it writes
        buf = b""
        try:
            while chunk := s.recv(65536):
                buf += chunk
        except socket.timeout:
            pass
    return [json.loads(line) for line in buf.splitlines() if line]


def extra_admin(server, tmp_path, **cfg) -> str:
    """A second admin socket on the same daemon, with its own AdminConfig."""
    path = str(tmp_path / "extra.sock")
    admin = AdminServer(server.state, AdminConfig(socket_path=path, **cfg))
    assert server.call(admin.start())
    server.extra = admin
    return path


@pytest.fixture
def extra(server):
    yield
    admin = getattr(server, "extra", None)
    if admin is not None:
        server.call(admin.close())
        server.extra = None


async def start_stream(server, session, model_name, max_tokens=400, **body):
    """Start a stream and read its first event; the gate then holds the engine's next
    step, so the stream is certainly still running (open the gate to let it go on)."""
    server.gate.close(after=1)
    resp = await session.post(server.url + "/v1/completions", json=dict(
        model=model_name, prompt="w5 w6 w7 w8", max_tokens=max_tokens, stream=True,
        **GREEDY, **body))
    assert resp.status == 200
    first = (await read_events(resp, limit=1))[0]
    return resp, first["id"]


# -- commands -------------------------------------------------------------------------------
def test_socket_mode_is_0660(server):
    assert os.stat(server.socket_path).st_mode & 0o777 == 0o660


async def test_stats(server, model_name):
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + "/v1/completions", json=dict(
                model=model_name, prompt="w5 w6 w7 w8 w9 w10 w11 w12 w13", max_tokens=4,
                **GREEDY)) as r:
            assert r.status == 200
    reply = await asend(server, P.Stats())
    assert isinstance(reply, P.StatsReply) and reply.ok
    assert reply.model == model_name and reply.ready and reply.log_level == "info"
    kv, graphs = reply.engine.kv, reply.engine.graphs
    assert kv.num_blocks == 1024
    assert kv.used + kv.free == kv.num_blocks
    assert kv.cached_blocks >= 1 and reply.engine.scheduler.num_steps >= 1
    assert kv.prefix_cache.queried_tokens > 0 and 0.0 <= kv.prefix_cache.hit_rate <= 1.0
    assert reply.drain.draining is False and reply.in_flight == 0
    # the graph dispatcher's counters (CPU: every step eager, with that reason)
    assert graphs.graphs is False and graphs.graph_steps == 0
    assert set(graphs.eager_reasons) <= {"graphs.cpu_compile is off"}
    from tokenloom.actors.messages import GraphStats
    from tokenloom.daemon.admin.cli import _graphs_row
    assert "graph" in _graphs_row(graphs) and _graphs_row(GraphStats()) == "no data yet"
    assert "piecewise" not in _graphs_row(graphs)   # CPU: no piecewise graphs
    row = _graphs_row(GraphStats(graph_steps=5, piecewise=True, piecewise_steps=3,
                                 piecewise_padding_waste_fraction=0.25, eager_steps=1,
                                 eager_reasons={"more tokens than the largest token bucket": 1}))
    assert row.startswith("5 graph, 3 piecewise (padding 25.0%), 1 eager (1 more tokens")


async def test_flush_cache_refuses_while_a_request_runs_unless_forced(server, model_name):
    async with aiohttp.ClientSession() as session:
        # Cache some blocks: a finished 17-token prompt leaves 2 full blocks of 8 cached.
        async with session.post(server.url + "/v1/completions", json=dict(
                model=model_name, prompt=" ".join(f"w{i}" for i in range(40, 57)),
                max_tokens=2, **GREEDY)) as r:
            assert r.status == 200
        resp, rid = await start_stream(server, session, model_name)
        server.gate.close()  # the stream is now certainly running
        refused = await asend(server, P.FlushCache())
        assert isinstance(refused, P.ErrorReply) and refused.code == "refused"
        assert "running" in refused.error
        forced = await asend(server, P.FlushCache(force=True))
        assert isinstance(forced, P.FlushCacheReply) and forced.freed >= 2
        server.gate.open()
        events = await read_events(resp)
        resp.release()
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    idle = await asyncio.to_thread(server.wait_idle)
    assert idle["used"] == 0
    reply = await asend(server, P.FlushCache())  # idle: allowed
    assert isinstance(reply, P.FlushCacheReply)
    assert (await asend(server, P.Stats())).engine.kv.cached_blocks == 0


@pytest.mark.parametrize("n", [1, 2])
async def test_cancel_ends_a_running_stream_with_an_error_and_frees_its_kv(server, model_name,
                                                                          n):
    async with aiohttp.ClientSession() as session:
        resp, rid = await start_stream(server, session, model_name, n=n)
        server.gate.close()
        assert (await asend(server, P.Stats())).engine.kv.used > 0
        reply = await asend(server, P.Cancel(request_id=rid))
        assert isinstance(reply, P.CancelReply), reply
        assert reply.cancelled == ([rid] if n == 1 else [f"{rid}-0", f"{rid}-1"])
        events = await read_events(resp)  # ends without the engine taking another step
        resp.release()
        server.gate.open()
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "cancelled by the operator"
    idle = await asyncio.to_thread(server.wait_idle)
    assert idle["used"] == 0 and idle["running"] == 0 and idle["streams"] == 0
    again = await asend(server, P.Cancel(request_id=rid))
    assert isinstance(again, P.ErrorReply) and again.code == "not_found"


async def test_cancel_a_non_streaming_request(server, model_name):
    async with aiohttp.ClientSession() as session:
        server.gate.close()
        post = asyncio.ensure_future(session.post(server.url + "/v1/completions", json=dict(
            model=model_name, prompt="w5 w6", max_tokens=50, **GREEDY)))
        assert await asyncio.to_thread(server.gate.blocked.wait, 30)
        (rid,) = server.state.inflight.ids()
        reply = await asend(server, P.Cancel(request_id=rid))
        assert isinstance(reply, P.CancelReply)
        resp = await post
        body = await resp.json()
        server.gate.open()
    assert resp.status == 503 and body["error"]["message"] == "cancelled by the operator"


async def test_trace(server, model_name):
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + "/v1/completions", json=dict(
                model=model_name, prompt="w5 w6", max_tokens=3, n=2, **GREEDY)) as r:
            rid = (await r.json())["id"]
    reply = await asend(server, P.Trace(request_id=rid))
    assert isinstance(reply, P.TraceReply), reply
    assert reply.request_id == rid and reply.trace["request_id"] == rid
    assert len(reply.trace["choices"]) == 2
    missing = await asend(server, P.Trace(request_id="cmpl-unknown"))
    assert isinstance(missing, P.ErrorReply) and missing.code == "not_found"


async def test_log_level(server):
    reply = await asend(server, P.SetLogLevel(level="debug"))
    assert reply == P.LogLevelReply(level="debug", previous="info")
    assert logs.current_level() == "debug"
    assert (await asend(server, P.Stats())).log_level == "debug"


# -- drain and resume -------------------------------------------------------------------------
async def _status(server, path, body=None):
    async with aiohttp.ClientSession() as session:
        if body is None:
            async with session.get(server.url + path) as r:
                return r.status, r.headers.copy(), await r.read()
        async with session.post(server.url + path, json=body) as r:
            return r.status, r.headers.copy(), await r.json()


async def test_drain_and_resume_toggle_ready(server, model_name):
    body = dict(model=model_name, prompt="w5", max_tokens=2)
    assert (await _status(server, "/ready"))[0] == 200
    reply = await asend(server, P.Drain())
    assert isinstance(reply, P.DrainReply) and reply.progress.draining
    assert reply.progress.drained and not reply.progress.exiting
    assert (await _status(server, "/ready"))[0] == 503
    status, headers, err = await _status(server, "/v1/completions", body)
    assert status == 503 and headers["Retry-After"] == "7" and "draining" in err["error"]["message"]
    assert (await _status(server, "/health"))[0] == 200  # draining is not unhealthy
    assert (await asend(server, P.Resume())) == P.ResumeReply(was_draining=True)
    assert (await _status(server, "/ready"))[0] == 200
    assert (await _status(server, "/v1/completions", body))[0] == 200
    assert (await asend(server, P.Resume())) == P.ResumeReply(was_draining=False)


async def test_drain_waits_for_in_flight_requests(server, model_name):
    """1. a stream runs (runner gated); 2. drain: progress shows it in flight; 3. a `drain
    --wait` waits; 4. the gate opens, the stream completes in full; 5. the wait returns
    drained."""
    async with aiohttp.ClientSession() as session:
        resp, rid = await start_stream(server, session, model_name, max_tokens=30)
        server.gate.close()
        reply = await asend(server, P.Drain())
        assert reply.progress.in_flight == 1 and not reply.progress.drained
        waiter = asyncio.ensure_future(asend(server, P.Drain(wait=True)))
        await until(lambda: server.state.drain.num_waiting == 1)  # the waiter is inside wait()
        assert not waiter.done()
        server.gate.open()
        events = await read_events(resp)
        resp.release()
        done = await waiter
    assert done.progress.drained and done.progress.in_flight == 0 and not done.progress.timed_out
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert len(text.split()) == 30 - 1  # start_stream read the first token's event


async def test_drain_timeout_ends_running_requests_with_an_error(server, model_name):
    async with aiohttp.ClientSession() as session:
        resp, rid = await start_stream(server, session, model_name)
        server.gate.close()
        reply = await asend(server, P.Drain(timeout=0.2, wait=True))
        events = await read_events(resp)
        resp.release()
        server.gate.open()
    assert reply.progress.timed_out and reply.progress.drained
    assert events[-1] == "[DONE]" and "drain timeout" in events[-2]["error"]["message"]
    idle = await asyncio.to_thread(server.wait_idle)
    assert idle["used"] == 0 and idle["running"] == 0
    assert (await _status(server, "/ready"))[0] == 503  # still draining until resumed
    assert (await asend(server, P.Resume())).was_draining


async def test_resume_wakes_a_waiting_drain(server, model_name):
    async with aiohttp.ClientSession() as session:
        resp, rid = await start_stream(server, session, model_name, max_tokens=20)
        server.gate.close()
        waiter = asyncio.ensure_future(asend(server, P.Drain(wait=True)))
        await until(lambda: server.state.drain.num_waiting == 1)
        assert (await asend(server, P.Resume())).was_draining
        done = await waiter
        server.gate.open()
        events = await read_events(resp)
        resp.release()
    assert not done.progress.draining
    assert events[-2]["choices"][0]["finish_reason"] == "length"


# -- the socket's defences --------------------------------------------------------------------
def test_malformed_and_unknown_commands_get_error_replies(server):
    replies = raw_exchange(server.socket_path, b'{bad json\n{"cmd": "reboot"}\n\n'
                           b'{"cmd": "flush-cache", "force": "yes"}\n{"cmd": "stats"}\n',
                           timeout=1.0)
    assert [r["reply"] for r in replies] == ["error", "error", "error", "stats"]
    assert [r.get("code") for r in replies[:3]] == ["bad_request", "unknown_command",
                                                     "bad_request"]
    assert replies[3]["ok"] is True  # the connection survived the bad lines


def test_oversize_line_gets_an_error_and_the_daemon_keeps_serving(server, extra, tmp_path):
    path = extra_admin(server, tmp_path, max_line_bytes=256)
    (reply,) = raw_exchange(path, b'{"cmd": "cancel", "request_id": "' + b"x" * 5000 + b'"}\n')
    assert reply["code"] == "line_too_long"
    (reply,) = raw_exchange(path, b"y" * 100_000)  # no newline at all
    assert reply["code"] == "line_too_long"
    assert isinstance(send(server, P.Stats(), path), P.StatsReply)


def test_silent_peer_times_out(server, extra, tmp_path):
    path = extra_admin(server, tmp_path, read_timeout_seconds=0.3)
    t0 = time.monotonic()
    (reply,) = raw_exchange(path, b"", timeout=20)
    assert reply["code"] == "timeout" and time.monotonic() - t0 < 15
    (reply,) = raw_exchange(path, b'{"cmd": "sta', timeout=20)  # half a line, then silence
    assert reply["code"] == "timeout"
    assert isinstance(send(server, P.Stats()), P.StatsReply)


def test_a_peer_hanging_up_mid_line_is_harmless(server):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(server.socket_path)
        s.sendall(b'{"cmd": "st')
    assert isinstance(send(server, P.Stats()), P.StatsReply)


def test_refused_peer_gets_an_error_and_is_logged(server, extra, tmp_path):
    path = extra_admin(server, tmp_path, allowed_uids=[65534], allowed_gids=[65534])
    assert os.getuid() != 65534 and os.getgid() != 65534
    with capture_logs() as lines:
        (reply,) = raw_exchange(path, b'{"cmd": "drain"}\n')
    assert reply["code"] == "forbidden" and f"uid {os.getuid()}" in reply["error"]
    assert not server.state.draining  # the command was never run
    (refused,) = [x for x in lines if x["event"] == "admin peer refused"]
    assert refused["uid"] == os.getuid() and refused["pid"] == os.getpid()


# -- the CLI --------------------------------------------------------------------------------
def _cli(server, *args, socket_path=None):
    return subprocess.run([TOKENLOOM, "admin", "--socket", socket_path or server.socket_path,
                           *args], capture_output=True, text=True, timeout=60)


def test_cli_prints_human_readable_output_and_json(server):
    p = _cli(server, "stats")
    assert p.returncode == 0, p.stderr
    assert "KV blocks: used / free / total" in p.stdout and "not draining" in p.stdout
    p = _cli(server, "--json", "stats")
    assert p.returncode == 0 and json.loads(p.stdout)["reply"] == "stats"
    graphs = json.loads(p.stdout)["engine"]["graphs"]
    p = _cli(server, "graph-histogram")   # the file graphs.histogram_path reads
    assert p.returncode == 0 and json.loads(p.stdout) == graphs["decode_batch_size_histogram"]
    from tokenloom.graphs.setup import read_histogram
    saved = Path(server.socket_path).with_name("hist.json")
    saved.write_text(p.stdout)
    assert read_histogram(saved) == {int(k): v for k, v in json.loads(p.stdout).items()}
    p = _cli(server, "drain")
    assert p.returncode == 0 and p.stdout.startswith("drained: 0 request(s) in flight")
    p = _cli(server, "resume")
    assert p.returncode == 0 and p.stdout.strip() == "resumed: admitting requests"


def test_cli_exit_status_reflects_failure(server, tmp_path):
    p = _cli(server, "cancel", "cmpl-nope")
    assert p.returncode == 1 and "error (not_found)" in p.stderr
    p = _cli(server, "--json", "trace", "cmpl-nope")
    assert p.returncode == 1 and json.loads(p.stdout)["code"] == "not_found"
    p = _cli(server, "stats", socket_path=str(tmp_path / "absent.sock"))
    assert p.returncode == 3 and "cannot talk to the daemon" in p.stderr
    p = _cli(server, "log-level", "loud")
    assert p.returncode == 2


# -- health with a wedged engine ------------------------------------------------------------
async def test_health_fails_and_watchdog_stops_when_the_engine_wedges(server, model_name,
                                                                      tmp_path, monkeypatch):
    """1. watchdog pings flow (the lifecycle's loop, 0.05 s, to a real datagram socket);
    2. a stream runs and the runner wedges (the gate); 3. within health_stall_seconds (0.5 s)
    /health turns 503 and the pings stop, while the event loop still answers; 4. the runner
    recovers: /health 200, pings resume, the stream completes."""
    from tokenloom.daemon.lifecycle import watchdog_loop
    from tokenloom.daemon.sdnotify import Notifier

    from tokenloom.daemon import app as app_module

    listener = NotifyListener(str(tmp_path / "notify.sock"))
    notifier = Notifier(listener.address, watchdog_seconds=0.05)
    ticks = []   # the watchdog loop's health checks that found a problem (after /health 503)
    check = app_module.engine_problem

    def counting(state):
        problem = check(state)
        if problem is not None:
            ticks.append(problem)
        return problem

    monkeypatch.setattr(app_module, "engine_problem", counting)
    task = asyncio.run_coroutine_threadsafe(watchdog_loop(server.state, notifier), server.loop)
    try:
        assert await asyncio.to_thread(wait_for, lambda: listener.count("WATCHDOG=1") >= 2)
        assert (await _status(server, "/health"))[0] == 200
        async with aiohttp.ClientSession() as session:
            resp, rid = await start_stream(server, session, model_name, max_tokens=50)
            server.gate.close()
            t0 = time.monotonic()
            while (await _status(server, "/health"))[0] == 200:
                assert time.monotonic() - t0 < 30, "/health never failed"
                await asyncio.sleep(0.05)
            status, _, body = await _status(server, "/health")
            assert status == 503 and b"no step" in body
            # Ticks are counted instead of sleeping: ten checks that withheld their ping.
            seen = len(ticks)
            await until(lambda: len(ticks) >= seen + 2)
            listener.clear()
            seen = len(ticks)
            await until(lambda: len(ticks) >= seen + 10)
            assert listener.count("WATCHDOG=1") == 0
            server.gate.open()
            assert await asyncio.to_thread(wait_for, lambda: listener.count("WATCHDOG=1") >= 2)
            events = await read_events(resp)
            resp.release()
        assert (await _status(server, "/health"))[0] == 200
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    finally:
        server.gate.open()
        task.cancel()
        listener.close()



# -- the per-user fallback path (issue 17: `make serve` on a laptop) --------------------------
def _fallback_admin(server, monkeypatch, tmp_path):
    """An AdminServer at the default socket_path whose primary directory cannot be used."""
    from tokenloom.daemon.admin import paths as admin_paths

    monkeypatch.setattr(admin_paths, "PRIMARY", str(tmp_path / "no-such-dir" / "admin.sock"))
    admin = AdminServer(server.state, AdminConfig())
    ok = server.call(admin.start())
    server.extra = admin
    return ok, admin


def test_default_path_falls_back_to_xdg_runtime_dir(server, extra, monkeypatch, tmp_path):
    """1. /run/tokenloom is unusable (here: a missing directory); 2. the socket binds at
    $XDG_RUNTIME_DIR/tokenloom/admin.sock in a 0700 directory; 3. `tokenloom admin stats`
    without --socket finds it there."""
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    ok, admin = _fallback_admin(server, monkeypatch, tmp_path)
    assert ok and admin.path == str(runtime / "tokenloom" / "admin.sock")
    assert os.stat(runtime / "tokenloom").st_mode & 0o777 == 0o700
    p = subprocess.run([TOKENLOOM, "admin", "--json", "stats"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["reply"] == "stats"


def test_default_path_falls_back_to_a_per_user_tmp_dir(server, extra, monkeypatch, tmp_path):
    import tempfile

    from tokenloom.daemon.admin import paths as admin_paths

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ok, admin = _fallback_admin(server, monkeypatch, tmp_path)
    expected = tmp_path / f"tokenloom-{os.getuid()}" / "admin.sock"
    assert ok and admin.path == str(expected)
    assert admin_paths.find_socket(AdminConfig().socket_path) == str(expected)
    assert isinstance(send(server, P.Stats(), admin.path), P.StatsReply)


def test_a_planted_fallback_dir_is_refused(server, extra, monkeypatch, tmp_path):
    """A fallback directory that is not private (someone else's, or world-writable) is not
    used: the daemon runs without the socket and says why."""
    runtime = tmp_path / "xdg"
    (runtime / "tokenloom").mkdir(parents=True)
    os.chmod(runtime / "tokenloom", 0o777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    with capture_logs() as lines:
        ok, _ = _fallback_admin(server, monkeypatch, tmp_path)
    assert not ok
    (warning,) = [x for x in lines if x["event"].startswith("admin socket disabled")]
    assert any("mode 0700" in e for e in warning["errors"])
