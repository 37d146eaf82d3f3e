"""Slow and abusive clients are bounded by configuration, not by memory or by patience.

- a reader that takes no data: its stream's writes stall, and after
  server.write_timeout_seconds the connection is cut and its engine requests aborted (the
  KV pool returns to idle while the client still has not read a byte);
- headers or a body that trickle in: the connection is closed (headers) or answered 408
  (body) after server.header_timeout_seconds / server.body_timeout_seconds;
- connections over server.max_connections: a 503 before anything is read;
- 1M max_tokens, n=128, logprobs=20: 400s naming the field and the configured bound.
Every wait is a poll with a deadline; no assertion is about how long something took.
"""

from __future__ import annotations

import json
import socket

import aiohttp
import pytest

from servers import wait_for


@pytest.fixture(scope="module")
def slow_server(tiny_model_dir, tmp_path_factory):
    from servers import ServerThread, tiny_config

    s = ServerThread(tiny_config(tiny_model_dir, tmp_path_factory.mktemp("cache"), **{
        "server.header_timeout_seconds": 0.5, "server.body_timeout_seconds": 0.5,
        "server.write_timeout_seconds": 0.5, "server.max_tokens": 1800,
        "server.max_logprobs": 20, "admin.enabled": False}))
    yield s
    s.close()


@pytest.fixture(scope="module")
def capped_server(tiny_model_dir, tmp_path_factory):
    from servers import ServerThread, tiny_config

    s = ServerThread(tiny_config(tiny_model_dir, tmp_path_factory.mktemp("cache"), **{
        "server.max_connections": 3, "server.header_timeout_seconds": 60.0,
        "server.max_tokens": 256, "server.max_logprobs": 5, "admin.enabled": False}))
    yield s
    s.close()


def raw_connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: sticks
    s.settimeout(30)
    s.connect(("127.0.0.1", port))
    return s


def post_bytes(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def read_until_closed(s: socket.socket) -> bytes:
    buf = b""
    try:
        while chunk := s.recv(65536):
            buf += chunk
    except ConnectionResetError:
        pass
    return buf


def test_a_reader_that_takes_nothing_is_cut_off_and_frees_its_slot(slow_server, model_name):
    """1. a stream with big frames (n=4, 20 logprobs, 1,800 tokens: ~10 MB of SSE, more than
    the socket buffers hold) from a client that never reads; 2. the writes stall, and the
    write timeout cuts the connection and aborts the 4 engine requests; 3. the engine is
    idle and the KV pool empty, long before 1,800 tokens could have been read; 4. the
    server goes on serving."""
    from tokenloom.daemon.state import STATE

    state = slow_server.app[STATE]
    cut_before, aborted_before = state.connections.slow_readers_cut, _aborted(state)
    client = raw_connect(slow_server.port, rcvbuf=4096)
    try:
        client.sendall(post_bytes("/v1/completions", dict(
            model=model_name, prompt="w5 w6", max_tokens=1800, n=4, logprobs=20,
            stream=True, ignore_eos=True, temperature=1.0, seed=1)))
        assert wait_for(lambda: state.connections.slow_readers_cut == cut_before + 1,
                        timeout=120), "the stalled stream was never cut off"
        idle = slow_server.wait_idle(timeout=30)
        assert idle["used"] == 0 and idle["running"] == 0 and idle["streams"] == 0
        assert _aborted(state) == aborted_before + 1   # aborted before its 4 x 1,800 tokens
    finally:
        client.close()
    assert _complete(slow_server, model_name)["usage"]["completion_tokens"] == 4


def _aborted(state) -> float:
    """tokenloom:requests_aborted_total: requests that ended because the client went away."""
    return state.metrics.aborted._value.get()


def _complete(server, model_name) -> dict:
    s = raw_connect(server.port)
    with s:
        s.sendall(post_bytes("/v1/completions", dict(model=model_name, prompt="w5",
                                                     max_tokens=4, ignore_eos=True))
                  .replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n", 1))
        raw = read_until_closed(s)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), raw[:500]
    return json.loads(body)


def test_headers_that_trickle_in_are_cut_off(slow_server):
    s = raw_connect(slow_server.port)
    with s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")   # ... and nothing more
        assert read_until_closed(s) == b""     # closed by the server, no response


def test_a_silent_connection_is_cut_off(slow_server):
    s = raw_connect(slow_server.port)
    with s:
        assert read_until_closed(s) == b""


def test_a_body_that_trickles_in_gets_408(slow_server, model_name):
    s = raw_connect(slow_server.port)
    with s:
        full = post_bytes("/v1/completions", dict(model=model_name, prompt="w5"))
        s.sendall(full[:-5])                    # headers and most of the body, then silence
        raw = read_until_closed(s)
    assert raw.startswith(b"HTTP/1.1 408"), raw[:300]
    assert b"server.body_timeout_seconds" in raw


def test_connections_over_the_cap_get_503(capped_server):
    held = [raw_connect(capped_server.port) for _ in range(3)]
    try:
        # The guard counts a connection once the event loop has accepted it: poll.
        def refused() -> bool:
            s = raw_connect(capped_server.port)
            with s:
                s.settimeout(2)
                try:
                    return s.recv(200).startswith(b"HTTP/1.1 503")
                except socket.timeout:
                    return False
        assert wait_for(refused, timeout=30)
    finally:
        held.pop().close()

    def served() -> bool:
        s = raw_connect(capped_server.port)
        with s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return read_until_closed(s).startswith(b"HTTP/1.1 200")
    try:
        assert wait_for(served, timeout=30)   # a slot was freed: served again
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("body,param,message", [
    (dict(max_tokens=1_000_000), "max_tokens", "at most 256 (server.max_tokens)"),
    (dict(n=128, logprobs=20), "n", "must be in [1, 16]"),
    (dict(logprobs=20), "logprobs", "must be in [0, 5]"),
])
async def test_huge_asks_are_bounded_by_config(capped_server, model_name, body, param,
                                               message):
    async with aiohttp.ClientSession() as session:
        async with session.post(capped_server.url + "/v1/completions",
                                json=dict(model=model_name, prompt="w5", **body)) as r:
            assert r.status == 400
            err = (await r.json())["error"]
    assert err["param"] == param and message in err["message"]


async def test_chat_without_max_tokens_is_capped_by_server_max_tokens(capped_server,
                                                                      model_name):
    async with aiohttp.ClientSession() as session:
        async with session.post(capped_server.url + "/v1/chat/completions", json=dict(
                model=model_name, messages=[{"role": "user", "content": "hi"}],
                ignore_eos=True)) as r:
            assert r.status == 200
            usage = (await r.json())["usage"]
    assert usage["completion_tokens"] == 256


def test_the_bounds_are_config_errors_naming_field_and_range():
    from tokenloom.config.load import load_config
    from tokenloom.config.schema import ConfigError

    for key, value, expected in [
            ("server.max_logprobs", 21, "server.max_logprobs must be >= 0 and <= 20, got 21"),
            ("server.max_connections", 0, "server.max_connections must be >= 1"),
            ("server.write_timeout_seconds", 0, "server.write_timeout_seconds must be > 0.0"),
            ("server.max_tokens", -1, "server.max_tokens must be >= 0 and <= 10000000")]:
        with pytest.raises(ConfigError, match=expected.replace(".", r"\.").replace("(", r"\(")):
            load_config(overrides={key: value}, env=None)
