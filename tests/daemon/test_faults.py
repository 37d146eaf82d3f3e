"""Injected faults over HTTP (tests/faults.py): each fails only the requests it touches.

For every fault point, the victim is a stream marked by its tenant (`user`), so the fault is
armed before the request exists (no race with a fast engine):
1. the victim and bystanders run (a stream and a non-streamed request);
2. the fault fires mid-stream: the victim gets some text, then an error event, then
   `[DONE]`;
3. the bystanders complete in full (finish_reason "length", every token);
4. `/health` stays 200, the KV pool returns to idle and passes its integrity check.
Step faults (forward, sampler) fail the requests of that step, so their server runs one
sequence at a time and the bystander waits behind the victim. An actor that dies is the
one fault the engine cannot survive: every stream ends with an error, `/health` turns 503.
"""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest

os.environ["TOKENLOOM_FAULT_INJECTION"] = "1"   # this module is allowed to import the hook
import faults  # noqa: E402

from client import read_events  # noqa: E402
from tokenloom.actors.messages import CheckIntegrity  # noqa: E402

MAX_TOKENS = 48
BODY = dict(prompt="w5 w6 w7 w8", max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def injector():
    inj = faults.install()
    yield inj
    inj.uninstall()


@pytest.fixture(scope="module")
def serial_server(tiny_model_dir, tmp_path_factory):
    from servers import ServerThread, tiny_config

    s = ServerThread(tiny_config(tiny_model_dir, tmp_path_factory.mktemp("cache"),
                                 **{"scheduler.max_num_seqs": 1}))
    yield s
    s.close()


async def stream(session, url, model, user, **extra):
    """A streamed completion; returns its events (JSON objects, then "[DONE]")."""
    async with session.post(url + "/v1/completions", json=dict(
            model=model, user=user, stream=True, stream_options={"include_usage": True},
            **{**BODY, **extra})) as resp:
        assert resp.status == 200
        return await read_events(resp)


async def complete(session, url, model, user):
    async with session.post(url + "/v1/completions",
                            json=dict(model=model, user=user, **BODY)) as resp:
        return resp.status, await resp.json()


def assert_failed_mid_stream(events: list, point: str) -> None:
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    print(f"fault {point}: the client saw {error}")
    assert "injected fault" in error["message"], error
    texts = [e for e in events[:-2] if "choices" in e and e["choices"]]
    return texts


def assert_complete(events: list) -> None:
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == MAX_TOKENS
    assert events[-3]["choices"][0]["finish_reason"] == "length"


async def check_recovered(server) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(server.url + "/health") as r:
            assert r.status == 200
    idle = await asyncio.to_thread(server.wait_idle)
    assert idle["used"] == 0 and idle["running"] == 0 and idle["streams"] == 0
    assert await asyncio.to_thread(server.ask, "kv_manager", CheckIntegrity()) is None


@pytest.mark.parametrize("point,times", [("detokenize", 1), ("stream_output", 1),
                                         ("kv_allocate", 2)])
async def test_a_per_request_fault_ends_only_its_request(server, model_name, injector,
                                                         point, times):
    """kv_allocate: the step's allocation raises, then the victim's own retry does too (the
    KV manager retries grant by grant so that bystanders growing in the same step go on)."""
    injector.clear()
    injector.arm(point, tenant="victim", after=2, times=times)
    async with aiohttp.ClientSession() as session:
        victim, bystander, (status, body) = await asyncio.gather(
            stream(session, server.url, model_name, "victim"),
            stream(session, server.url, model_name, "bystander"),
            complete(session, server.url, model_name, "bystander"))
    assert injector.fired(point) == times
    texts = assert_failed_mid_stream(victim, point)
    if point != "kv_allocate":   # after=2: two outputs went through before the fault
        assert len(texts) >= 1
    assert_complete(bystander)
    assert status == 200 and body["usage"]["completion_tokens"] == MAX_TOKENS
    await check_recovered(server)


@pytest.mark.parametrize("point", ["forward", "sampler"])
async def test_a_failed_step_ends_its_requests_and_the_engine_goes_on(serial_server,
                                                                      model_name, injector,
                                                                      point):
    injector.clear()
    injector.arm(point, tenant="victim", after=3)
    async with aiohttp.ClientSession() as session:
        victim = asyncio.ensure_future(stream(session, serial_server.url, model_name, "victim"))
        bystander = asyncio.ensure_future(
            stream(session, serial_server.url, model_name, "bystander"))
        victim, bystander = await asyncio.gather(victim, bystander)
        assert injector.fired(point) == 1
        assert_failed_mid_stream(victim, point)
        assert_complete(bystander)
        again = await stream(session, serial_server.url, model_name, "victim")  # disarmed now
    assert_complete(again)
    await check_recovered(serial_server)


async def test_a_dead_actor_fails_every_stream_and_health(tiny_model_dir, tmp_path, model_name,
                                                          injector):
    """1. a bystander streams; 2. the KV manager actor raises on the victim's update and
    dies; 3. both streams end with an error event and [DONE]; 4. /health is 503 (the engine
    cannot make progress: the systemd watchdog pings stop, see test_supervisor.py); new
    requests get 503."""
    from servers import ServerThread, tiny_config

    from tokenloom.daemon.app import engine_problem
    from tokenloom.daemon.state import STATE

    server = ServerThread(tiny_config(tiny_model_dir, tmp_path))
    try:
        injector.clear()
        injector.arm("kv_actor", tenant="victim", after=1)
        async with aiohttp.ClientSession() as session:
            bystander, victim = await asyncio.gather(
                stream(session, server.url, model_name, "bystander", max_tokens=400),
                stream(session, server.url, model_name, "victim"))
            assert injector.fired("kv_actor") == 1
            for events in (victim, bystander):
                assert events[-1] == "[DONE]" and "engine stopped" in events[-2]["error"]["message"]
            async with session.get(server.url + "/health") as r:
                assert r.status == 503 and "stopped" in (await r.json())["error"]["message"]
            status, body = await complete(session, server.url, model_name, "later")
            assert status == 503
        assert engine_problem(server.app[STATE]) is not None   # what the watchdog reads
    finally:
        server.close()
