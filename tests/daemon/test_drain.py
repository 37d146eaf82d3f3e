"""SIGTERM against a real `tokenloom serve` process (tiny model) with streams in flight:
a graceful drain completes them in full; past the drain timeout they end with an error
event; either way the process exits 0 and systemd was told STOPPING=1.

The admin socket tells when the streams are running (no sleeps); each stream asks for
1,500 tokens, seconds of work, so they are still running when SIGTERM arrives."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from notify_listener import NotifyListener
from servers import ServerProcess, wait_for
from client import read_events
from tokenloom.daemon.admin import cli as admin_cli
from tokenloom.daemon.admin import protocol as P

MAX_TOKENS = 1500


def start_server(tiny_model_dir, tmp_path, listener, drain_timeout: float) -> ServerProcess:
    return ServerProcess(
        "--model", str(tiny_model_dir), "--set", "model.device=cpu",
        "--set", f'model.cache_dir="{tmp_path}"', "--set", "cache.block_size=8",
        "--set", "cache.num_blocks=2048", "--set", "model.num_threads=1",
        "--set", f"server.drain_timeout_seconds={drain_timeout}",
        "--set", "server.retry_after_seconds=5",
        "--set", f'admin.socket_path="{tmp_path / "admin.sock"}"',
        env=listener.env())


async def open_streams(server, session, model_name, count: int) -> list:
    async def one(i):
        resp = await session.post(server.url + "/v1/completions", json=dict(
            model=model_name, prompt=f"w{10 + i} w20 w30", max_tokens=MAX_TOKENS,
            temperature=0, ignore_eos=True, stream=True,
            stream_options={"include_usage": True}))
        assert resp.status == 200
        await read_events(resp, limit=1)  # the first token: it is running
        return resp
    return await asyncio.gather(*(one(i) for i in range(count)))


async def running(socket_path: str) -> int:
    reply = await asyncio.to_thread(admin_cli.send, socket_path, P.Stats())
    return reply.engine.scheduler.running


@pytest.fixture
def listener():
    lst = NotifyListener()  # an abstract socket, as systemd often passes
    yield lst
    lst.close()


async def test_sigterm_drains_streams_to_completion(tiny_model_dir, tmp_path, model_name,
                                                    listener):
    """1. 8 streams are running;
    2. SIGTERM;
    3. /ready and a new request get 503 (with Retry-After) at once;
    4. all 8 streams complete with their full token counts;
    5. the process exits with status 0;
    6. STOPPING=1 was notified (after READY=1)."""
    server = start_server(tiny_model_dir, tmp_path, listener, drain_timeout=120)
    try:
        async with aiohttp.ClientSession() as session:
            streams = await open_streams(server, session, model_name, 8)          # 1
            assert await running(str(tmp_path / "admin.sock")) == 8
            server.proc.send_signal(signal.SIGTERM)                               # 2
            assert await asyncio.to_thread(
                wait_for, lambda: "STOPPING=1" in listener.lines(), 30)
            async with session.get(server.url + "/ready") as r:                   # 3
                assert r.status == 503
            async with session.post(server.url + "/v1/completions", json=dict(
                    model=model_name, prompt="w5", max_tokens=2)) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "5"
                assert "draining" in (await r.json())["error"]["message"]
            results = await asyncio.gather(*(read_events(s) for s in streams))    # 4
            for s in streams:
                s.release()
        for events in results:
            assert events[-1] == "[DONE]"
            usage = events[-2]["usage"]
            assert usage["completion_tokens"] == MAX_TOKENS, usage
            finishes = [c["finish_reason"] for e in events[:-1] for c in e.get("choices", [])]
            assert finishes[-1] == "length" and not any("error" in e for e in events[:-1])
        code = await asyncio.to_thread(server.proc.wait, 60)                      # 5
        assert code == 0, "\n".join(server.lines[-20:])
    finally:
        server.stop()
    lines = listener.lines()                                                      # 6
    assert lines.index("READY=1") < lines.index("STOPPING=1")
    log = server.json_lines()
    assert any(x.get("event") == "drained" and x.get("timed_out") is False for x in log)
    assert any(x.get("event") == "stopped" for x in log)


async def test_sigterm_past_the_drain_timeout_ends_streams_with_an_error(
        tiny_model_dir, tmp_path, model_name, listener):
    """1. 3 streams and 1 non-streamed request are running; 2. SIGTERM with
    server.drain_timeout_seconds = 0; 3. each stream ends with an error event, then [DONE]
    (never cut silently), having fewer than its tokens; 4. the non-streamed request gets a
    503 JSON error; 5. the process exits 0, after STOPPING=1."""
    server = start_server(tiny_model_dir, tmp_path, listener, drain_timeout=0)
    try:
        async with aiohttp.ClientSession() as session:
            streams = await open_streams(server, session, model_name, 3)          # 1
            plain = asyncio.ensure_future(session.post(server.url + "/v1/completions", json=dict(
                model=model_name, prompt="w7 w8", max_tokens=MAX_TOKENS, temperature=0,
                ignore_eos=True)))
            assert await asyncio.to_thread(
                wait_for, lambda: asyncio.run(running(str(tmp_path / "admin.sock"))) == 4, 30)
            server.proc.send_signal(signal.SIGTERM)                               # 2
            results = await asyncio.gather(*(read_events(s) for s in streams))    # 3
            for s in streams:
                s.release()
            resp = await plain                                                    # 4
            body = await resp.json()
        for events in results:
            assert events[-1] == "[DONE]"
            assert "drain timeout" in events[-2]["error"]["message"]
            tokens = sum(len(c["text"].split()) for e in events[:-2]
                         for c in e.get("choices", []))
            assert tokens < MAX_TOKENS
        assert resp.status == 503 and "drain timeout" in body["error"]["message"]
        code = await asyncio.to_thread(server.proc.wait, 60)                      # 5
        assert code == 0, "\n".join(server.lines[-20:])
    finally:
        server.stop()
    assert "STOPPING=1" in listener.lines()
    assert any(x.get("event") == "drained" and x.get("timed_out") is True
               for x in server.json_lines())


async def test_a_second_signal_forces_an_immediate_stop(tiny_model_dir, tmp_path, model_name,
                                                       listener):
    """1. 2 streams are running; 2. SIGTERM: the drain begins (STOPPING=1); 3. SIGINT: the
    process exits at once with 128 + SIGINT, without waiting for the streams."""
    server = start_server(tiny_model_dir, tmp_path, listener, drain_timeout=600)
    try:
        async with aiohttp.ClientSession() as session:
            streams = await open_streams(server, session, model_name, 2)          # 1
            assert await running(str(tmp_path / "admin.sock")) == 2
            server.proc.send_signal(signal.SIGTERM)                               # 2
            assert await asyncio.to_thread(
                wait_for, lambda: "STOPPING=1" in listener.lines(), 30)
            server.proc.send_signal(signal.SIGINT)                                # 3
            code = await asyncio.to_thread(server.proc.wait, 30)
            for s in streams:
                s.close()
    finally:
        server.stop()
    assert code == 128 + signal.SIGINT
    assert any(x.get("event") == "second signal: exiting now" for x in server.json_lines())
