"""Client disconnects abort their requests and free their KV blocks.

The storm: 100 concurrent streaming requests, every 10th cancelled mid-stream, every 15th with
n=3; survivors produce exactly their token counts (ignore_eos), nothing stays unfinished, and
the KV pool returns to its idle count.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tokenloom.actors.messages import CheckIntegrity

from client import ametric, read_events


async def test_storm_of_streams_with_cancellations(server, model_name):
    """1. 100 streams start together (more than max_num_seqs=64, so some queue);
    2. every 10th reads 2 events and hangs up; every 15th asks for n=3;
    3. every survivor gets exactly max_tokens tokens per choice and a matching usage;
    4. afterwards nothing is running or waiting, no stream is open, every block is free."""
    idle = server.wait_idle()
    assert idle["used"] == 0
    aborted_before = await ametric(server, "tokenloom:requests_aborted_total")

    async def one(s: aiohttp.ClientSession, i: int):
        cancel = i % 10 == 0
        n = 3 if i % 15 == 0 else 1
        max_tokens = 200 if cancel else 8 + i % 9
        # logprobs=0: every token shows up in a chunk, even one that decodes to no text.
        body = dict(model=model_name, prompt=[3 + i % 200, 4, 5 + i % 7], max_tokens=max_tokens,
                    n=n, temperature=0.8, seed=i, ignore_eos=True, stream=True, logprobs=0,
                    stream_options={"include_usage": True})
        resp = await s.post(server.url + "/v1/completions", json=body)
        assert resp.status == 200
        if cancel:
            events = await read_events(resp, limit=2)
            assert len(events) == 2
            resp.close()  # hang up mid-stream
            return i, None
        events = await read_events(resp)
        resp.release()
        assert events[-1] == "[DONE]"
        *chunks, usage = events[:-1]
        tokens: dict[int, int] = {}
        finish: dict[int, str] = {}
        for c in chunks:
            (choice,) = c["choices"]
            tokens[choice["index"]] = (tokens.get(choice["index"], 0)
                                       + len(choice["logprobs"]["tokens"]))
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
        assert tokens == {k: max_tokens for k in range(n)}, (i, tokens)
        assert finish == {k: "length" for k in range(n)}
        assert usage["usage"]["completion_tokens"] == n * max_tokens
        return i, usage["usage"]

    connector = aiohttp.TCPConnector(limit=200)
    async with aiohttp.ClientSession(connector=connector) as s:
        results = await asyncio.gather(*(one(s, i) for i in range(100)))
    assert sum(u is None for _, u in results) == 10
    after = server.wait_idle(timeout=2)
    assert after["used"] == 0 and after["free"] == idle["free"]
    assert after["running"] == 0 and after["waiting"] == 0 and after["streams"] == 0
    assert server.stats().router.in_flight == 0
    assert server.ask("kv_manager", CheckIntegrity()) is None
    # The hung-up streams were aborted by the server, not left to run out their 200 tokens.
    assert await ametric(server, "tokenloom:requests_aborted_total") - aborted_before == 10


async def test_non_streaming_client_that_goes_away_is_aborted(server, model_name):
    """1. a non-streaming request for 1,500 tokens starts; 2. the client gives up after 0.3 s;
    3. within a moment the request is aborted and all its blocks are free again."""
    async with aiohttp.ClientSession() as s:
        try:
            await asyncio.wait_for(s.post(server.url + "/v1/completions", json=dict(
                model=model_name, prompt="w5 w6", max_tokens=1500, temperature=0,
                ignore_eos=True)), timeout=0.3)
        except asyncio.TimeoutError:
            pass
        else:
            raise AssertionError("the request finished before the client went away")
    t0 = time.monotonic()
    idle = server.wait_idle(timeout=5)
    assert idle["used"] == 0 and idle["running"] == 0 and idle["streams"] == 0
    assert time.monotonic() - t0 < 2
    assert await ametric(server, "tokenloom:requests_aborted_total") >= 1


async def test_storm_with_shared_prefixes_preemption_and_cancellations(tiny_model_dir, model_name,
                                                                       tmp_path):
    """The storm again, on a pool so small that requests are preempted, with prompts that
    share a prefix (cache hits and shared blocks) and n=3 siblings sharing their prompt:
    1. 60 streams; every 7th hangs up mid-stream; every 5th asks for n=3;
    2. survivors get exactly their tokens;
    3. preemptions happened, prefix blocks were shared, and afterwards every block is
       free, no block is owned twice, nothing runs, waits or streams."""
    from servers import ServerThread, tiny_config

    # Static admission (no KV plan: no lookahead, no watermark) so that victims are certain.
    server = ServerThread(tiny_config(tiny_model_dir, tmp_path, **{
        "cache.num_blocks": 24, "scheduler.max_num_seqs": 32,
        "scheduler.admission_lookahead_tokens": 0, "scheduler.kv_watermark": 0.0,
        "scheduler.kv_resume_watermark": 0.0}))
    try:
        shared = [10 + (k % 50) for k in range(40)]  # 5 full blocks of 8

        async def one(s: aiohttp.ClientSession, i: int):
            cancel = i % 7 == 3
            n = 3 if i % 5 == 0 else 1
            max_tokens = 150 if cancel else 10 + i % 13
            body = dict(model=model_name, prompt=shared + [60 + i % 100, 5], n=n,
                        max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True,
                        stream=True, logprobs=0, stream_options={"include_usage": True})
            resp = await s.post(server.url + "/v1/completions", json=body)
            assert resp.status == 200
            if cancel:
                await read_events(resp, limit=3)
                resp.close()
                return None
            events = await read_events(resp)
            resp.release()
            *chunks, usage = events[:-1]
            tokens: dict[int, int] = {}
            for c in chunks:
                (choice,) = c["choices"]
                tokens[choice["index"]] = (tokens.get(choice["index"], 0)
                                           + len(choice["logprobs"]["tokens"]))
            assert tokens == {k: max_tokens for k in range(n)}, (i, tokens)
            return usage["usage"]["prompt_tokens_details"]["cached_tokens"]

        connector = aiohttp.TCPConnector(limit=100)
        async with aiohttp.ClientSession(connector=connector) as s:
            cached = await asyncio.gather(*(one(s, i) for i in range(60)))
        after = server.wait_idle(timeout=10)
        assert after["num_preemptions"] > 0, ("the small pool must force preemption", str(after))
        assert any(c for c in cached if c), "some requests must reuse the shared prefix"
        assert after["used"] == 0 and after["running"] == 0 and after["waiting"] == 0
        assert after["streams"] == 0
        assert server.ask("kv_manager", CheckIntegrity()) is None
    finally:
        server.close()
