"""Bad input over HTTP: each case gets its 4xx status and an OpenAI-style error body naming
the field; a burst of 1,000 mixed bad requests leaves the server serving and the KV pool as
it was."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

M = "MODEL"  # replaced by the served model name


def _fill(body):
    if isinstance(body, dict):
        return {k: _fill(v) for k, v in body.items()}
    return body if body != M else _fill.model


CASES = {
    # name: (path, body (dict -> JSON, bytes -> raw), content type, status, param)
    "malformed json": ("/v1/completions", b'{"model": "x", "prompt": "w5"', None, 400, None),
    "not an object": ("/v1/completions", b'[1, 2]', None, 400, None),
    "wrong type": ("/v1/completions", dict(model=M, prompt="w5", max_tokens="ten"), None, 400,
                   "max_tokens"),
    "wrong type nested": ("/v1/chat/completions",
                          dict(model=M, messages=[{"role": "user", "content": 5}]), None, 400,
                          "messages[0].content"),
    "missing prompt": ("/v1/completions", dict(model=M), None, 400, "prompt"),
    "model not a string": ("/v1/completions", dict(model=5, prompt="w5"), None, 400, "model"),
    "missing messages": ("/v1/chat/completions", dict(model=M), None, 400, "messages"),
    "unknown model": ("/v1/completions", dict(model="gpt-9", prompt="w5"), None, 404, "model"),
    "unknown model chat": ("/v1/chat/completions",
                           dict(model="gpt-9", messages=[{"role": "user", "content": "w5"}]),
                           None, 404, "model"),
    "empty prompt": ("/v1/completions", dict(model=M, prompt=""), None, 400, "prompt"),
    "empty prompt list": ("/v1/completions", dict(model=M, prompt=[]), None, 400, "prompt"),
    "empty messages": ("/v1/chat/completions", dict(model=M, messages=[]), None, 400,
                       "messages"),
    "prompt that tokenizes to nothing": ("/v1/completions", dict(model=M, prompt="   "), None,
                                         400, "prompt"),
    "prompt + max_tokens beyond context": ("/v1/completions",
                                           dict(model=M, prompt="w5 w6", max_tokens=2047),
                                           None, 400, "max_tokens"),
    "prompt + max_completion_tokens beyond context": (
        "/v1/chat/completions", dict(model=M, messages=[{"role": "user", "content": "w5"}],
                                     max_completion_tokens=2047), None, 400,
        "max_completion_tokens"),
    "prompt alone beyond context": ("/v1/completions", dict(model=M, prompt=[5] * 2100), None,
                                    400, "prompt"),
    "chat beyond context": ("/v1/chat/completions",
                            dict(model=M, messages=[{"role": "user", "content": "w5 " * 2100}]),
                            None, 400, "messages"),
    "token id outside vocabulary": ("/v1/completions", dict(model=M, prompt=[5, 100000]), None,
                                    400, "prompt"),
    "max_tokens 0": ("/v1/completions", dict(model=M, prompt="w5", max_tokens=0), None, 400,
                     "max_tokens"),
    "max_tokens negative": ("/v1/completions", dict(model=M, prompt="w5", max_tokens=-3), None,
                            400, "max_tokens"),
    "max_completion_tokens 0": ("/v1/chat/completions",
                                dict(model=M, messages=[{"role": "user", "content": "w5"}],
                                     max_completion_tokens=0), None, 400,
                                "max_completion_tokens"),
    "temperature < 0": ("/v1/completions", dict(model=M, prompt="w5", temperature=-0.5), None,
                        400, "temperature"),
    "top_p 0": ("/v1/completions", dict(model=M, prompt="w5", top_p=0), None, 400, "top_p"),
    "top_p > 1": ("/v1/completions", dict(model=M, prompt="w5", top_p=1.01), None, 400,
                  "top_p"),
    "n above max": ("/v1/completions", dict(model=M, prompt="w5", n=17), None, 400, "n"),
    "n 0": ("/v1/completions", dict(model=M, prompt="w5", n=0), None, 400, "n"),
    "top_logprobs above 20": ("/v1/chat/completions",
                              dict(model=M, messages=[{"role": "user", "content": "w5"}],
                                   logprobs=True, top_logprobs=21), None, 400, "top_logprobs"),
    "logprobs above 20": ("/v1/completions", dict(model=M, prompt="w5", logprobs=21), None,
                          400, "logprobs"),
    "bad role": ("/v1/chat/completions", dict(model=M, messages=[{"role": "x", "content": "a"}]),
                 None, 400, "messages[0].role"),
    "invalid utf-8": ("/v1/completions", b'{"model": "m", "prompt": "\xff\xfe"}', None, 400,
                      None),
    "wrong content type": ("/v1/completions", b'{"model": "m", "prompt": "w5"}', "text/plain",
                           415, None),
    "form content type": ("/v1/completions", b"model=m&prompt=w5",
                          "application/x-www-form-urlencoded", 415, None),
    "body over the limit": ("/v1/completions", None, None, 413, None),
    # The render endpoints parse and validate as the generation endpoints do.
    "render unknown model": ("/v1/completions/render", dict(model="gpt-9", prompt="w5"), None,
                             404, "model"),
    "render empty prompt": ("/v1/completions/render", dict(model=M, prompt=""), None, 400,
                            "prompt"),
    "render token outside vocabulary": ("/v1/completions/render",
                                        dict(model=M, prompt=[5, 100000]), None, 400, "prompt"),
    "render chat bad role": ("/v1/chat/completions/render",
                             dict(model=M, messages=[{"role": "x", "content": "a"}]), None, 400,
                             "messages[0].role"),
    "render chat beyond context": ("/v1/chat/completions/render",
                                   dict(model=M, messages=[{"role": "user",
                                                            "content": "w5 " * 2100}]),
                                   None, 400, "messages"),
    "tokenize wrong type": ("/tokenize", dict(prompt=5), None, 400, "prompt"),
    "detokenize missing tokens": ("/detokenize", dict(), None, 400, "tokens"),
}


def _request(name: str, limit: int):
    path, body, ctype, status, param = CASES[name]
    if name == "body over the limit":
        body = json.dumps({"model": "m", "prompt": "w5 " * (limit // 3 + 10)}).encode()
    elif isinstance(body, dict):
        body = json.dumps(_fill(body)).encode()
    return path, body, ctype or "application/json", status, param


async def _send(session, url, name, limit):
    path, body, ctype, status, param = _request(name, limit)
    async with session.post(url + path, data=body, headers={"Content-Type": ctype}) as r:
        return r.status, await r.json(), status, param


@pytest.fixture(autouse=True)
def _model(model_name):
    _fill.model = model_name


@pytest.mark.parametrize("name", list(CASES))
async def test_bad_request_gets_openai_error(server, name):
    limit = server.engine.config.server.max_body_bytes
    async with aiohttp.ClientSession() as s:
        got, body, status, param = await _send(s, server.url, name, limit)
    assert got == status, body
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if param is not None:
        assert param.split("[")[0].split(".")[0] in err["message"] or param in err["message"]


async def test_unknown_route_and_method_are_openai_errors(server):
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/v1/nothing") as r:
            assert r.status == 404 and set((await r.json())["error"]) == {
                "message", "type", "param", "code"}
        async with s.get(server.url + "/v1/completions") as r:
            assert r.status == 405 and "error" in await r.json()


async def test_burst_of_bad_requests_leaves_the_server_serving(server, model_name):
    """1. note the KV pool; 2. 1,000 bad requests of every kind, 50 at a time; 3. each gets
    its status; 4. the KV pool is exactly as before and a good request is served."""
    before = server.wait_idle()
    limit = server.engine.config.server.max_body_bytes
    names = [n for n in CASES if n != "body over the limit"]
    names = [names[i % len(names)] for i in range(990)] + ["body over the limit"] * 10
    sem = asyncio.Semaphore(50)
    async with aiohttp.ClientSession() as s:
        async def one(name):
            async with sem:
                return name, await _send(s, server.url, name, limit)

        results = await asyncio.gather(*(one(n) for n in names))
        wrong = [(n, got, want) for n, (got, _, want, _) in results if got != want]
        assert not wrong, wrong[:5]
        async with s.post(server.url + "/v1/completions", json=dict(
                model=model_name, prompt="w5", max_tokens=4, temperature=0,
                ignore_eos=True)) as r:
            assert r.status == 200
            assert (await r.json())["usage"]["completion_tokens"] == 4
    after = server.wait_idle()
    for key in ("num_blocks", "free", "used", "waiting", "running", "streams"):
        assert after[key] == before[key], key
    assert server.stats().router.in_flight == 0
