"""/openapi.json: generated from the handlers' msgspec types, and fuzzed by schemathesis.

1. the document is OpenAPI 3.1 that schemathesis loads, covers every route of the app, and
   states this server's configured bounds (n, max_tokens, logprobs, the model names);
2. real responses decode into the documented response Structs (the hot path builds dicts);
3. schemathesis (stateless, every operation, a bounded number of examples per operation,
   positive and negative data) runs against the live server: no 5xx, every status code,
   content type and body as documented; afterwards the KV pool is idle and intact.
`benchmarks/fuzz_api.py` is the longer run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import msgspec
import pytest

from tokenloom.actors.messages import CheckIntegrity
from tokenloom.daemon.openai import responses as R

from client import aget

ST = str(Path(sys.executable).with_name("st"))
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance," \
         "response_schema_conformance"
EXAMPLES = 25     # per operation and phase; the suite's budget (the script runs more)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir, tmp_path_factory):
    """Bounded by config so that fuzzed requests stay cheap: n <= 4, max_tokens <= 16."""
    from servers import ServerThread, tiny_config

    s = ServerThread(tiny_config(tiny_model_dir, tmp_path_factory.mktemp("cache"),
                                 **{"server.max_n": 4, "server.max_tokens": 16,
                                    "admin.enabled": False, "server.embeddings": True}))
    yield s
    s.close()


async def test_the_document_covers_every_route_with_the_configured_bounds(fuzz_server,
                                                                          model_name):
    import schemathesis

    status, raw, _ = await aget(fuzz_server, "/openapi.json")
    assert status == 200
    doc = json.loads(raw)
    assert doc["openapi"] == "3.1.0"
    schema = schemathesis.openapi.from_dict(doc)
    assert len(list(schema.get_all_operations())) >= 10
    routes = {r.canonical for r in fuzz_server.app.router.resources()}
    assert routes == set(doc["paths"])
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["n"]["maximum"] == 4
    assert props["max_tokens"]["anyOf"][0]["maximum"] == 16
    assert props["logprobs"]["anyOf"][0]["maximum"] == 20
    assert model_name in props["model"]["enum"]
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["max_completion_tokens"]["anyOf"][0]["maximum"] == 16
    schemas = doc["components"]["schemas"]
    assert schemas["ResponsesRequest"]["properties"]["max_output_tokens"]["anyOf"][0][
        "maximum"] == 16
    assert schemas["MessagesRequest"]["properties"]["max_tokens"]["maximum"] == 16
    assert model_name in schemas["EmbeddingRequest"]["properties"]["model"]["enum"]
    # The Messages API documents Anthropic's error shape.
    bad = doc["paths"]["/v1/messages"]["post"]["responses"]["400"]
    assert bad["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicError")


async def test_real_responses_decode_into_the_documented_types(fuzz_server, model_name):
    base = dict(model=model_name, max_tokens=5, n=2, return_metrics=True)
    async with aiohttp.ClientSession() as session:
        async with session.post(fuzz_server.url + "/v1/completions",
                                json=dict(base, prompt=["w5 w6", "w7"], logprobs=3)) as r:
            body = await r.json()
            msgspec.convert(body, R.CompletionResponse)
            assert body["choices"][0]["logprobs"]["top_logprobs"]
        async with session.post(fuzz_server.url + "/v1/chat/completions", json=dict(
                base, messages=[{"role": "user", "content": "hi"}], logprobs=True,
                top_logprobs=2)) as r:
            body = await r.json()
            msgspec.convert(body, R.ChatCompletionResponse)
            assert body["choices"][1]["logprobs"]["content"][0]["top_logprobs"]
        async with session.post(fuzz_server.url + "/v1/responses", json=dict(
                model=model_name, input="w5 w6", max_output_tokens=3)) as r:
            msgspec.convert(await r.json(), R.ResponseObject)
        async with session.post(fuzz_server.url + "/v1/messages", json=dict(
                model=model_name, max_tokens=3,
                messages=[{"role": "user", "content": "w5"}])) as r:
            msgspec.convert(await r.json(), R.MessageObject)
        async with session.post(fuzz_server.url + "/v1/embeddings", json=dict(
                model=model_name, input=["w5", "w6 w7"])) as r:
            from tokenloom.daemon.openai.embeddings import EmbeddingResponse
            msgspec.convert(await r.json(), EmbeddingResponse)
        async with session.post(fuzz_server.url + "/v1/completions",
                                json=dict(base, prompt="w5", max_tokens=17)) as r:
            assert r.status == 400
            err = msgspec.convert(await r.json(), R.ErrorResponse).error
            assert err.param == "max_tokens" and "server.max_tokens" in err.message


def test_schemathesis_finds_no_failure_and_the_pool_is_idle_after(fuzz_server, tmp_path):
    p = subprocess.run(
        [ST, "run", fuzz_server.url + "/openapi.json", "--checks", CHECKS,
         "--max-examples", str(EXAMPLES), "--seed", "17", "--no-color",
         "--report-junit-path", str(tmp_path / "junit.xml")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)  # (its cache dir there)
    summary = re.search(r"(\d+) generated, (.*)", p.stdout)
    print("schemathesis:", summary.group(0) if summary else p.stdout[-2000:])
    assert p.returncode == 0, p.stdout[-6000:]
    assert summary and int(summary.group(1)) >= 100
    assert "failure" not in summary.group(2)
    idle = fuzz_server.wait_idle()
    assert idle["used"] == 0 and idle["running"] == 0 and idle["waiting"] == 0
    assert fuzz_server.ask("kv_manager", CheckIntegrity()) is None
