"""The real default model (SmolLM2-135M-Instruct) served by `tokenloom serve` as a subprocess:
greedy output over HTTP (openai client) equals the offline `LLM.generate`; multi-byte text and
emoji stream exactly as they come out non-streamed; /health answers while a 1,500-token
prompt is being prefilled."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

openai = pytest.importorskip("openai")

from servers import ServerProcess  # noqa: E402
from client import read_events  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Grüße aus München! 日本語のテキスト: 東京は日本の首都です。 Emoji: 🎉🚀 — translate:",
    "def fibonacci(n):\n",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def served(default_model_dir):
    server = ServerProcess("--model", str(default_model_dir), "--set", "model.device=cpu",
                           "--set", "model.dtype=float32", "--set", "model.num_threads=2",
                           timeout=300)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def test_greedy_over_http_equals_offline_generate(client, default_model_dir):
    from tokenloom import LLM, SamplingParams

    http = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS,
                                     max_tokens=MAX_TOKENS, temperature=0)
    llm = LLM(model=str(default_model_dir), quiet=True, device="cpu", dtype="float32")
    try:
        offline = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    finally:
        llm.close()
    assert [c.text for c in sorted(http.choices, key=lambda c: c.index)] == \
        [o.text for o in offline]


def test_multibyte_text_streams_exactly_as_non_streamed(client):
    messages = [{"role": "user", "content": "Reply with three emoji and the word 日本: " + "🎉"}]
    full = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                          max_tokens=32, temperature=0)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=32, temperature=0,
        stream=True) if c.choices]
    assert "".join(pieces) == full.choices[0].message.content
    # No piece carries half a character (U+FFFD) unless the text itself does.
    assert "\ufffd" in full.choices[0].message.content or all("\ufffd" not in p for p in pieces)


async def test_health_answers_during_a_long_prefill(served):
    """1. a 1,500-token prompt starts streaming; 2. GET /health right after it is accepted;
    3. the health response arrives before the prompt's first token."""
    story = "The lighthouse keeper counted the ships and wrote each name in the ledger. "
    order = []
    async with aiohttp.ClientSession() as s:
        async with s.post(served.url + "/tokenize", json={"prompt": story * 120}) as r:
            ids = (await r.json())["tokens"][:1500]
        assert len(ids) == 1500
        resp = await s.post(served.url + "/v1/completions", json=dict(
            model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=2, temperature=0,
            stream=True))
        assert resp.status == 200  # headers come with the admission, before any token
        first = asyncio.create_task(read_events(resp, limit=1))
        first.add_done_callback(lambda _: order.append("first token"))
        t0 = time.monotonic()
        async with s.get(served.url + "/health") as r:
            assert r.status == 200
            order.append("health")
        health_s = time.monotonic() - t0
        await first
        resp.close()
    assert order == ["health", "first token"], (order, health_s)
