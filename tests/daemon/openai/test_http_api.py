"""The OpenAI-compatible API over real HTTP (aiohttp client, raw SSE parsing), tiny model.

Response shapes are checked field by field against OpenAI's; streamed text equals
non-streamed text; greedy output over HTTP equals the offline `LLM.generate`.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from client import aget, apost, parse_sse, read_events

GREEDY = dict(temperature=0, ignore_eos=True)


def _usage_ok(usage: dict, prompt: int, completion: int) -> None:
    assert usage == {"prompt_tokens": prompt, "completion_tokens": completion,
                     "total_tokens": prompt + completion,
                     "prompt_tokens_details": {"cached_tokens": 0}}


# -- completions ----------------------------------------------------------------------------
async def test_completion_response_shape(server, model_name):
    status, body, headers = await apost(server, "/v1/completions", dict(
        model=model_name, prompt="w5 w6 w7", max_tokens=5, **GREEDY))
    assert status == 200, body
    assert set(body) == {"id", "object", "created", "model", "system_fingerprint", "choices",
                         "usage"}
    assert body["object"] == "text_completion" and body["model"] == model_name
    assert body["id"].startswith("cmpl-") and headers["X-Request-Id"] == body["id"]
    (choice,) = body["choices"]
    assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["logprobs"] is None and len(choice["text"].split()) == 5
    _usage_ok(body["usage"], 3, 5)


@pytest.mark.parametrize("prompt, num_prompts", [
    ("w5 w6 w7", 1), (["w5 w6", "w7"], 2), ([5, 6, 7], 1), ([[5, 6], [7, 8, 9]], 2)])
async def test_completion_prompt_forms(server, model_name, prompt, num_prompts):
    status, body, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt=prompt, max_tokens=3, n=2, **GREEDY))
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == list(range(2 * num_prompts))
    assert body["usage"]["completion_tokens"] == 3 * 2 * num_prompts


async def test_string_and_token_prompts_agree(server, model_name):
    texts = []
    for prompt in ("w5 w6 w7", [5, 6, 7]):
        _, body, _ = await apost(server, "/v1/completions", dict(
            model=model_name, prompt=prompt, max_tokens=6, **GREEDY))
        texts.append(body["choices"][0]["text"])
    assert texts[0] == texts[1]


async def test_streamed_text_equals_non_streamed(server, model_name):
    req = dict(model=model_name, prompt="w9 w10 w11", max_tokens=8, **GREEDY)
    _, full, _ = await apost(server, "/v1/completions", req)
    status, raw, headers = await apost(server, "/v1/completions",
                                      dict(req, stream=True,
                                           stream_options={"include_usage": True}))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = parse_sse(raw)[:-1]
    *chunks, usage_chunk = events
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert usage_chunk["choices"] == []
    _usage_ok(usage_chunk["usage"], 3, 8)


async def test_stream_without_usage_has_no_usage_field(server, model_name):
    _, raw, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt="w9", max_tokens=3, stream=True, **GREEDY))
    events = parse_sse(raw)[:-1]
    assert len(events) == 3 and all("usage" not in e for e in events)


async def test_n_streams_interleave_with_distinct_indices(server, model_name):
    _, raw, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt="w9 w10", max_tokens=4, n=3, seed=5, temperature=1.0,
        ignore_eos=True, stream=True, stream_options={"include_usage": True}))
    events = parse_sse(raw)[:-1]
    per_index: dict[int, list] = {}
    for e in events[:-1]:
        (c,) = e["choices"]
        per_index.setdefault(c["index"], []).append(c)
    assert sorted(per_index) == [0, 1, 2]
    assert all(len(v) == 4 and v[-1]["finish_reason"] == "length" for v in per_index.values())
    assert events[-1]["usage"]["completion_tokens"] == 12
    assert events[-1]["usage"]["prompt_tokens"] == 2  # the prompt counts once


async def test_stop_string_cuts_text_and_never_leaks(server, model_name):
    req = dict(model=model_name, prompt="w20 w21", max_tokens=10, **GREEDY)
    _, full, _ = await apost(server, "/v1/completions", req)
    words = full["choices"][0]["text"].split()
    stop = words[3]
    expected = full["choices"][0]["text"][: full["choices"][0]["text"].index(stop)]
    _, body, _ = await apost(server, "/v1/completions", dict(req, stop=[stop, "nothing"]))
    assert body["choices"][0]["text"] == expected
    assert body["choices"][0]["finish_reason"] == "stop"
    _, raw, _ = await apost(server, "/v1/completions", dict(req, stop=stop, stream=True))
    chunks = parse_sse(raw)[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert server.wait_idle()["used"] == 0


async def test_completion_logprobs_shape(server, model_name):
    _, body, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt="w5 w6", max_tokens=4, logprobs=3, **GREEDY))
    lp = body["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    # The text continues the prompt (detokenized with the prompt as context): " w.. w.."
    assert "".join(lp["tokens"]).replace("w", " w") == body["choices"][0]["text"]
    for tok, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert logprob <= 0 and tok in top and 3 <= len(top) <= 4
        # greedy: the chosen token is the most likely one
        assert logprob == pytest.approx(max(top.values()))
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


# -- chat -----------------------------------------------------------------------------------
async def test_chat_response_shape_and_logprobs(server, model_name):
    status, body, _ = await apost(server, "/v1/chat/completions", dict(
        model=model_name, messages=[{"role": "system", "content": "w4"},
                                    {"role": "user", "content": "w9 w10"}],
        max_completion_tokens=4, logprobs=True, top_logprobs=2, **GREEDY))
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason"}
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
    # The template renders "w4 w9 w10 w3": four prompt tokens.
    _usage_ok(body["usage"], 4, 4)


async def test_chat_stream_matches_non_stream(server, model_name):
    req = dict(model=model_name, messages=[{"role": "user", "content": "w30 w31"}],
               max_tokens=6, **GREEDY)
    _, full, _ = await apost(server, "/v1/chat/completions", req)
    _, raw, _ = await apost(server, "/v1/chat/completions",
                           dict(req, stream=True, stream_options={"include_usage": True},
                                return_metrics=True))
    events = parse_sse(raw)[:-1]
    first, *chunks, last = events
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in events)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == full["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert "metrics" in last and all("metrics" not in c for c in chunks)


async def test_chat_without_max_tokens_fills_the_context(server, model_name):
    """max_tokens unset: generation may use whatever the context window (2,048) leaves."""
    _, body, _ = await apost(server, "/v1/chat/completions", dict(
        model=model_name, messages=[{"role": "user", "content": "w5 " * 2040}], **GREEDY))
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 2041  # 2,040 words + the generation prompt
    assert body["usage"]["completion_tokens"] == 2048 - 2041


# -- prefix cache ---------------------------------------------------------------------------
async def test_cached_tokens_are_exact_and_salts_isolate(server, model_name):
    """1. a prompt is computed; 2. the same prompt again reuses every full block but the one
    holding its last token; 3. another cache_salt reuses nothing (and says why)."""
    prompt = " ".join(f"w{i % 50}" for i in range(61))
    req = dict(model=model_name, prompt=prompt, max_tokens=2, return_metrics=True,
               cache_salt="tenant-1", **GREEDY)
    _, first, _ = await apost(server, "/v1/completions", req)
    n = first["usage"]["prompt_tokens"]
    assert n > 32  # several full blocks
    _, second, _ = await apost(server, "/v1/completions", req)
    bs = 8  # the test server's cache.block_size (tests/servers.py tiny_config)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == ((n - 1) // bs) * bs
    assert second["metrics"]["cached_tokens"] == ((n - 1) // bs) * bs
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    _, other, _ = await apost(server, "/v1/completions", dict(req, cache_salt="tenant-2"))
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other["metrics"]["prefix_cache"][0]["first_miss_reason"] == "isolation"
    _, raw, _ = await aget(server, "/metrics")
    text = raw.decode()

    def value(name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(name))
        return float(line.rsplit(" ", 1)[1])

    hits = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert value("vllm:prefix_cache_hits_total{") >= hits
    assert value("vllm:prefix_cache_queries_total{") >= 3 * n
    assert value('tokenloom:prefix_cache_missed_tokens_total{model_name="%s",reason="isolation"}'
                 % model_name) >= n


# -- metrics object, models, health, tokenize ------------------------------------------------
async def test_metrics_object_is_opt_in(server, model_name):
    req = dict(model=model_name, prompt="w5", max_tokens=3, **GREEDY)
    _, plain, _ = await apost(server, "/v1/completions", req)
    assert "metrics" not in plain
    _, body, _ = await apost(server, "/v1/completions", dict(req, return_metrics=True))
    m = body["metrics"]
    assert set(m) == {"queue_time", "time_to_first_token", "decode_time", "e2e_time",
                      "cached_tokens", "num_preemptions", "prefix_cache", "trace"}
    assert 0 <= m["queue_time"] <= m["time_to_first_token"] <= m["e2e_time"]
    assert m["decode_time"] >= 0 and m["cached_tokens"] == 0 and m["num_preemptions"] == 0
    _, raw, _ = await apost(server, "/v1/completions", dict(req, return_metrics=True,
                                                           stream=True))
    *chunks, _ = parse_sse(raw)
    assert "metrics" in chunks[-1] and all("metrics" not in c for c in chunks[:-1])


async def test_models_health_ready(server, model_name):
    status, raw, _ = await aget(server, "/v1/models")
    body = json.loads(raw)
    assert status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [model_name]
    assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == 2048
    assert (await aget(server, "/health"))[0] == 200
    status, raw, _ = await aget(server, "/ready")
    assert status == 200 and json.loads(raw) == {"status": "ready"}


async def test_tokenize_detokenize_round_trip(server, model_name):
    status, body, _ = await apost(server, "/tokenize", {"model": model_name, "prompt": "w5 w6"})
    assert status == 200 and body["tokens"] == [5, 6] and body["count"] == 2
    assert body["max_model_len"] == 2048
    _, chat, _ = await apost(server, "/tokenize",
                            {"messages": [{"role": "user", "content": "w7"}]})
    assert chat["tokens"] == [7, 3]  # the template adds the generation prompt w3
    status, body, _ = await apost(server, "/detokenize", {"tokens": [5, 6]})
    assert status == 200 and body == {"prompt": "w5 w6"}
    status, body, _ = await apost(server, "/detokenize", {"tokens": [5, 999]})
    assert status == 400 and body["error"]["param"] == "tokens"


async def test_prometheus_metrics_use_vllm_names(server, model_name):
    await apost(server, "/v1/completions", dict(model=model_name, prompt="w5", max_tokens=3,
                                               **GREEDY))
    status, raw, headers = await aget(server, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = raw.decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket", "vllm:num_preemptions_total",
                 "vllm:request_success_total", "tokenloom:kv_blocks_free",
                 "tokenloom:requests_aborted_total", "tokenloom:http_requests_total"):
        assert f"{name}{{" in text, name
    assert f'vllm:kv_cache_usage_perc{{model_name="{model_name}"}} 0.0' in text
    assert "_created" not in text


# -- parity with the offline API ---------------------------------------------------------------
async def test_greedy_over_http_equals_offline_generate(server, model_name, tiny_model_dir,
                                                        tmp_path):
    from tokenloom import LLM, SamplingParams

    prompts = [[5, 6, 7, 8], [40, 41], list(range(10, 60))]
    llm = LLM(model=str(tiny_model_dir), quiet=True, device="cpu", dtype="float32",
              cache_dir=str(tmp_path), block_size=8)
    try:
        offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                       ignore_eos=True))
    finally:
        llm.close()
    _, body, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt=prompts, max_tokens=12, **GREEDY))
    assert [c["text"] for c in body["choices"]] == [o.text for o in offline]


# -- overload and responsiveness (their own small servers) ---------------------------------------
async def test_full_waiting_queue_gets_429_with_retry_after(tiny_model_dir, tmp_path,
                                                            model_name):
    """1. max_num_seqs=1, max_waiting=1: one request runs, one waits; 2. a third gets 429 with
    Retry-After and an OpenAI error body; 3. once they are gone, requests are served again."""
    from servers import ServerThread, tiny_config

    server = ServerThread(tiny_config(tiny_model_dir, tmp_path, **{
        "scheduler.max_num_seqs": 1, "scheduler.max_num_batched_tokens": 16,
        "scheduler.max_waiting": 1, "server.retry_after_seconds": 7}))
    try:
        long = dict(model=model_name, prompt="w5", max_tokens=1500, stream=True, **GREEDY)
        async with aiohttp.ClientSession() as s:
            first = await s.post(server.url + "/v1/completions", json=long)
            second = await s.post(server.url + "/v1/completions", json=long)
            assert first.status == second.status == 200
            async with s.post(server.url + "/v1/completions", json=long) as third:
                body = await third.json()
                assert third.status == 429 and third.headers["Retry-After"] == "7"
                assert body["error"]["type"] == "rate_limit_error"
                assert set(body["error"]) == {"message", "type", "param", "code"}
            first.close()
            second.close()
        assert server.wait_idle()["used"] == 0
        status, body, _ = await apost(server, "/v1/completions", dict(
            model=model_name, prompt="w5", max_tokens=2, **GREEDY))
        assert status == 200
    finally:
        server.close()


async def test_health_answers_while_a_long_prompt_prefills(tiny_model_dir, tmp_path,
                                                           model_name):
    """By ordering: 1. a 1,500-token prompt starts streaming (chunked into ~94 iterations);
    2. once it is running, GET /health; 3. the health response arrives before the prompt's
    first token."""
    from servers import ServerThread, tiny_config

    server = ServerThread(tiny_config(tiny_model_dir, tmp_path, **{
        "scheduler.max_num_batched_tokens": 16, "scheduler.max_num_seqs": 4}))
    order: list[str] = []
    try:
        async with aiohttp.ClientSession() as s:
            async def stream():
                async with s.post(server.url + "/v1/completions", json=dict(
                        model=model_name, prompt=[7] * 1500, max_tokens=2, stream=True,
                        **GREEDY)) as r:
                    await read_events(r, limit=1)
                    order.append("first token")

            task = asyncio.create_task(stream())
            deadline = time.monotonic() + 120
            while (await asyncio.to_thread(server.stats)).scheduler.running == 0:
                assert time.monotonic() < deadline, "the long prompt never started"
                await asyncio.sleep(0.005)
            async with s.get(server.url + "/health") as r:
                assert r.status == 200
                order.append("health")
            await task
        assert order == ["health", "first token"]
    finally:
        server.close()


async def test_engine_crash_ends_open_streams_and_fails_health(tiny_model_dir, tmp_path,
                                                               model_name):
    """1. a long stream is running; 2. the engine's task dies; 3. the stream ends with an
    error event and [DONE] instead of hanging; 4. /health and new requests get 503."""
    from servers import ServerThread, tiny_config

    server = ServerThread(tiny_config(tiny_model_dir, tmp_path))
    try:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(server.url + "/v1/completions", json=dict(
                model=model_name, prompt="w5", max_tokens=2000, stream=True, **GREEDY))
            assert len(await read_events(resp, limit=2)) == 2
            from tokenloom.daemon.state import STATE
            state = server.app[STATE]
            server.loop.call_soon_threadsafe(state.engine_task.cancel)
            rest = await asyncio.wait_for(read_events(resp), timeout=10)
            assert rest[-1] == "[DONE]" and "error" in rest[-2], rest[-3:]
            async with s.get(server.url + "/health") as r:
                assert r.status == 503
            async with s.post(server.url + "/v1/completions", json=dict(
                    model=model_name, prompt="w5", max_tokens=2)) as r:
                assert r.status == 503 and (await r.json())["error"]["type"] == "server_error"
    finally:
        server.close()


async def test_shutdown_while_streaming_is_prompt(tiny_model_dir, tmp_path, model_name):
    """1. a long stream is running (the scheduler is mid-step); 2. the server shuts down;
    3. shutdown completes within seconds (the scheduler must not wait for a KV manager or
    runner that already stopped); 4. the client sees its stream end."""
    import time

    from servers import ServerThread, tiny_config

    server = ServerThread(tiny_config(tiny_model_dir, tmp_path))
    async with aiohttp.ClientSession() as s:
        resp = await s.post(server.url + "/v1/completions", json=dict(
            model=model_name, prompt="w5", max_tokens=2000, stream=True, **GREEDY))
        assert len(await read_events(resp, limit=2)) == 2
        t0 = time.monotonic()
        await asyncio.to_thread(server.close)
        assert time.monotonic() - t0 < 10
        try:
            await asyncio.wait_for(read_events(resp), timeout=5)
        except aiohttp.ClientError:
            pass  # the connection was closed under the stream: also an end


# -- model optional, continuous usage stats -------------------------------------------------
async def test_model_may_be_omitted_when_one_is_served(server, model_name):
    """As vLLM and llama.cpp: no `model` means the served one; a wrong name is still 404."""
    status, body, _ = await apost(server, "/v1/completions", dict(prompt="w5 w6", max_tokens=2))
    assert status == 200 and body["model"] == model_name, body
    status, body, _ = await apost(server, "/v1/chat/completions", dict(
        messages=[{"role": "user", "content": "w5"}], max_tokens=2))
    assert status == 200 and body["model"] == model_name, body
    status, body, _ = await apost(server, "/v1/completions", dict(model="gpt-9", prompt="w5"))
    assert status == 404 and body["error"]["param"] == "model"


async def test_continuous_usage_stats_on_every_completion_chunk(server, model_name):
    """With include_usage and continuous_usage_stats, every chunk carries its choice's
    running counts (vLLM's stream); the last chunk is still the whole usage."""
    _, raw, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt="w9 w10 w11", max_tokens=6, n=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    *chunks, last = parse_sse(raw)[:-1]
    seen: dict[int, list[int]] = {}
    for c in chunks:
        u = c["usage"]
        assert u["prompt_tokens"] == 3 and u["total_tokens"] == 3 + u["completion_tokens"]
        seen.setdefault(c["choices"][0]["index"], []).append(u["completion_tokens"])
    for counts in seen.values():
        assert counts == sorted(counts) and counts[-1] == 6 and counts[0] >= 1
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12


async def test_continuous_usage_stats_on_chat_chunks(server, model_name):
    _, raw, _ = await apost(server, "/v1/chat/completions", dict(
        model=model_name, messages=[{"role": "user", "content": "w5 w6"}], max_tokens=4,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        **GREEDY))
    *chunks, last = parse_sse(raw)[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["usage"]["completion_tokens"] == 0   # the role chunk: nothing yet
    prompt = chunks[0]["usage"]["prompt_tokens"]
    assert prompt == last["usage"]["prompt_tokens"] > 0
    assert [c["usage"]["completion_tokens"] for c in chunks][-1] == 4
    # Without include_usage the option changes nothing (as vLLM).
    _, raw, _ = await apost(server, "/v1/chat/completions", dict(
        model=model_name, messages=[{"role": "user", "content": "w5 w6"}], max_tokens=2,
        stream=True, stream_options={"continuous_usage_stats": True}, **GREEDY))
    assert all("usage" not in e for e in parse_sse(raw)[:-1])
