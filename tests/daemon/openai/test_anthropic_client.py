"""POST /v1/messages and /v1/messages/count_tokens with the official `anthropic` client,
unchanged (`client.messages.create`, `.stream`, `.count_tokens`), on a tiny random model
that thinks (tests/thinking_model.py):

1. the answer equals chat's for the same conversation (greedy): without `thinking` the
   template's thinking is switched off (as in this API); with it, the thinking comes back
   as a thinking block equal to chat's reasoning_content;
2. streamed, Anthropic's events (message_start, content_block_start/delta/stop,
   message_delta, message_stop) add up to the non-streamed message;
3. a tool-use round trip: a forced tool_use block (input an object), then its tool_result;
   the answer equals chat's for the same conversation;
4. count_tokens equals the prompt a message request is given, which `usage` splits into
   cache reads (prefix hits), cache writes (full blocks computed) and the rest;
5. stop_sequences end the answer with stop_reason "stop_sequence";
6. errors are Anthropic's shape, naming the field, as the SDK's exception types."""

from __future__ import annotations

import json

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

# Greedy (this SDK no longer sends sampling parameters of its own: extra_body does).
GREEDY = {"temperature": 0}
EXTRA = {"ignore_eos": True, **GREEDY}
QUESTION = [{"role": "user", "content": "What is 8 plus 11?"}]
THINKING = {"type": "enabled", "budget_tokens": 1024}
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Oslo"]}},
               "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(thinking_server):
    return anthropic.Anthropic(base_url=thinking_server.url, api_key="unused", max_retries=0,
                               timeout=60)


@pytest.fixture(scope="module")
def oai(thinking_server):
    return openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused",
                         max_retries=0, timeout=60)


def chat(oai, model, messages, n, thinking: bool, **kwargs):
    return oai.chat.completions.create(
        model=model, messages=messages, max_tokens=n, temperature=0,
        extra_body={**EXTRA, "chat_template_kwargs": {"enable_thinking": thinking}}, **kwargs)


def blocks(message, kind):
    return [b for b in message.content if b.type == kind]


def test_answers_equal_chats_with_and_without_thinking(client, oai, model_dir_name):
    plain = client.messages.create(model=model_dir_name, max_tokens=12, messages=QUESTION,
                                   system="Answer briefly.", extra_body=EXTRA)
    c = chat(oai, model_dir_name, [{"role": "system", "content": "Answer briefly."},
                                   *QUESTION], 12, thinking=False)
    assert plain.type == "message" and plain.role == "assistant"
    assert not blocks(plain, "thinking") and plain.stop_reason == "max_tokens"
    assert blocks(plain, "text")[0].text == c.choices[0].message.content
    u = plain.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens \
        == c.usage.prompt_tokens and u.output_tokens == 12
    thought = client.messages.create(model=model_dir_name, max_tokens=20, messages=QUESTION,
                                     thinking=THINKING, extra_body=EXTRA)
    c = chat(oai, model_dir_name, QUESTION, 20, thinking=True)
    [block] = blocks(thought, "thinking")
    assert block.thinking == c.choices[0].message.reasoning_content and block.thinking
    assert blocks(thought, "text")[0].text == c.choices[0].message.content


def test_the_stream_adds_up_to_the_message(client, model_dir_name, thinking_server):
    kwargs = dict(model=model_dir_name, max_tokens=20, messages=QUESTION, thinking=THINKING,
                  extra_body=EXTRA)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events]
    assert types[0] == "message_start" and "message_stop" in types
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 20
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens \
        + final.usage.cache_creation_input_tokens == whole.usage.input_tokens \
        + whole.usage.cache_read_input_tokens + whole.usage.cache_creation_input_tokens
    # Raw frames: named events, thinking deltas before text deltas.
    with httpx.stream("POST", thinking_server.url + "/v1/messages", json={
                      **{k: v for k, v in kwargs.items() if k != "extra_body"}, **EXTRA,
                      "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in datas]
    deltas = [d["delta"]["type"] for d in datas if d["type"] == "content_block_delta"]
    assert deltas == sorted(deltas, key=lambda t: t != "thinking_delta")
    assert "thinking_delta" in deltas and "text_delta" in deltas


def test_a_tool_use_round_trip(client, oai, model_dir_name):
    kwargs = dict(model=model_dir_name, max_tokens=300, messages=QUESTION, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    m = client.messages.create(**kwargs)
    [use] = blocks(m, "tool_use")
    assert m.stop_reason == "tool_use" and use.name == "get_weather"
    assert use.input["city"] in ("Paris", "Oslo")
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert blocks(final, "tool_use")[0].input == use.input
    follow = [*QUESTION, {"role": "assistant", "content": m.content},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                            "content": "sunny"}]}]
    answer = client.messages.create(model=model_dir_name, max_tokens=10, messages=follow,
                                    tools=[WEATHER], extra_body=EXTRA)
    c = chat(oai, model_dir_name, [*QUESTION, {"role": "assistant", "tool_calls": [
        {"id": use.id, "type": "function", "function": {
            "name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny"}], 10, thinking=False,
        tools=[{"type": "function", "function": {"name": WEATHER["name"],
                                                 "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}])
    assert blocks(answer, "text")[0].text == (c.choices[0].message.content or "")


def test_count_tokens_and_cache_usage(client, model_dir_name, thinking_server):
    long = [{"role": "user", "content": "a long and stable prefix " * 6}]
    kw = dict(model=model_dir_name, messages=long, system=[
        {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}])
    counted = client.messages.count_tokens(**kw).input_tokens
    first = client.messages.create(max_tokens=1, **kw,
                                   extra_body={"cache_salt": "usage", **GREEDY})
    again = client.messages.create(max_tokens=1, **kw,
                                   extra_body={"cache_salt": "usage", **GREEDY})
    block = thinking_server.engine.info.block_size
    u1, u2 = first.usage, again.usage
    assert u1.cache_read_input_tokens == 0
    assert u1.cache_creation_input_tokens == counted // block * block
    assert u1.input_tokens == counted - u1.cache_creation_input_tokens
    assert u2.cache_read_input_tokens == counted // block * block
    assert u2.cache_creation_input_tokens == 0
    assert sum((u2.input_tokens, u2.cache_read_input_tokens)) == counted
    assert client.messages.count_tokens(**kw, thinking=THINKING).input_tokens == counted - 1


def test_stop_sequences(client, model_dir_name):
    whole = client.messages.create(model=model_dir_name, max_tokens=12, messages=QUESTION,
                                   extra_body=EXTRA)
    text = blocks(whole, "text")[0].text
    # A character of the answer that first appears after its start (random bytes decode
    # to replacement characters too: not one of those).
    i = next(i for i in range(2, len(text)) if text[i] not in text[:i] + "\ufffd"
             and text[i].strip())
    stop = text[i]
    m = client.messages.create(model=model_dir_name, max_tokens=12, messages=QUESTION,
                               stop_sequences=[stop, "zzz-never"], extra_body=EXTRA)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert blocks(m, "text")[0].text == text[:i]


@pytest.mark.parametrize("kwargs, error, where", [
    (dict(messages=[{"role": "system", "content": "x"}]), "BadRequestError",
     "messages.0.role"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
     "BadRequestError", "messages.0.content.0.type"),
    (dict(messages=QUESTION, thinking={"type": "enabled", "budget_tokens": 5}),
     "BadRequestError", "thinking.budget_tokens"),
    (dict(messages=QUESTION, model="claude-nope"), "NotFoundError", "model"),
])
def test_errors_are_anthropics_shape(client, model_dir_name, kwargs, error, where):
    kwargs = {"model": model_dir_name, "max_tokens": 4, **kwargs}
    with pytest.raises(getattr(anthropic, error)) as e:
        client.messages.create(**kwargs)
    body = e.value.body
    assert body["type"] == "error" and body["error"]["message"].startswith(where)
    assert body["error"]["type"] in ("invalid_request_error", "not_found_error")


def test_other_errors_keep_the_shape(thinking_server):
    r = httpx.get(thinking_server.url + "/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    r = httpx.post(thinking_server.url + "/v1/messages", content=b"{", headers={
        "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(thinking_server.url + "/v1/messages", json={"messages": QUESTION})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens")


def test_conventions_trace_metrics_render_drain(client, model_dir_name, thinking_server):
    url = thinking_server.url
    m = client.messages.create(model=model_dir_name, max_tokens=2, messages=QUESTION,
                               extra_body={**EXTRA, "priority": 3})
    trace = httpx.get(f"{url}/v1/requests/{m.id}/trace").json()
    assert trace["request_id"] == m.id and trace["priority"] == 3
    assert 'tokenloom:http_requests_total{endpoint="/v1/messages",status="200"}' \
        in httpx.get(f"{url}/metrics").text
    ids = httpx.post(f"{url}/v1/messages/render", json={
        "model": model_dir_name, "max_tokens": 4, "messages": QUESTION, "system": "Hi."}).json()
    chat_ids = httpx.post(f"{url}/v1/chat/completions/render", json={
        "messages": [{"role": "system", "content": "Hi."}, *QUESTION],
        "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert ids["token_ids"] == chat_ids["token_ids"]
    state = thinking_server.app[next(iter(thinking_server.app))]
    state.draining = True
    try:
        with pytest.raises(anthropic.APIStatusError) as e:
            client.messages.create(model=model_dir_name, max_tokens=2, messages=QUESTION)
        assert e.value.status_code == 503
        assert e.value.body["error"]["type"] == "overloaded_error"
    finally:
        state.draining = False
