"""POST /v1/responses with the official `openai` client (`client.responses.create`), unchanged,
on a tiny random model that thinks (tests/thinking_model.py):

1. a response's reasoning item and message carry the same text as chat's reasoning_content
   and content for the same conversation (greedy), and its usage the same prompt tokens;
2. streamed, the events come in OpenAI's order with consecutive sequence numbers, their
   deltas add up to the items of the final `response.completed`, which equals the
   non-streamed response;
3. a tool round trip: a forced function call (after the thinking), then its
   function_call_output; the answer equals chat's for the same conversation;
4. store + previous_response_id continue the conversation (the prompt is chat's for the
   whole conversation, and the earlier prefix is served from the prefix cache); retrieve;
   an unknown id is a 404 naming the field;
5. text.format (structured output) applies to the answer; reasoning.effort "none" switches
   the template's thinking off;
6. the daemon's conventions: errors name the field, the trace is found by the response id,
   /metrics counts the endpoint, the render endpoint gives chat's token ids, cache_salt
   isolates, and a draining server refuses with 503."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")

EXTRA = {"ignore_eos": True}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Oslo"]}},
               "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(thinking_server):
    return openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused",
                         max_retries=0, timeout=60)


def chat(client, model, messages, n=20, **extra):
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=n,
                                       temperature=0, extra_body={**EXTRA, **extra})
    return r


def items(resp, kind):
    return [o for o in resp.output if o.type == kind]


QUESTION = [{"role": "user", "content": "What is 8 plus 11?"}]


def test_text_and_reasoning_equal_chats(client, model_dir_name):
    r = client.responses.create(model=model_dir_name, input=QUESTION[0]["content"],
                                instructions="Answer briefly.", max_output_tokens=20,
                                temperature=0, extra_body=EXTRA)
    c = chat(client, model_dir_name,
             [{"role": "system", "content": "Answer briefly."}, *QUESTION])
    msg = c.choices[0].message
    assert r.object == "response" and r.status == "incomplete"   # cut at max_output_tokens
    assert r.incomplete_details.reason == "max_output_tokens"
    [reasoning] = items(r, "reasoning")
    assert reasoning.content[0].text == msg.reasoning_content
    assert r.output_text == msg.content
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == 20
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < 20
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_stream_events_add_up_to_the_response(client, model_dir_name):
    kwargs = dict(model=model_dir_name, input=QUESTION, max_output_tokens=20, temperature=0,
                  extra_body=EXTRA)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.incomplete" and events[-1].response.status == "incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert reasoning == items(final, "reasoning")[0].content[0].text \
        == items(whole, "reasoning")[0].content[0].text
    assert text == final.output_text == whole.output_text
    # Each item: added, its content, done; reasoning before the message.
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert added == done == ["reasoning", "message"]
    first = types.index("response.output_text.delta")
    assert types.index("response.reasoning_text.done") < first
    assert types.index("response.content_part.added", first - 3) < first
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_a_tool_round_trip(client, model_dir_name):
    r = client.responses.create(model=model_dir_name, input=QUESTION, tools=[WEATHER],
                                tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=300, temperature=0)
    [call] = items(r, "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    assert r.status == "completed" and not items(r, "message")
    streamed = list(client.responses.create(
        model=model_dir_name, input=QUESTION, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=300, temperature=0, stream=True))
    args = "".join(e.delta for e in streamed
                   if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert args == done.arguments == call.arguments
    # The tool's result goes back; the answer equals chat's for the same conversation.
    follow = [*QUESTION, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                          "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    r2 = client.responses.create(model=model_dir_name, input=follow, tools=[WEATHER],
                                 max_output_tokens=12, temperature=0, extra_body=EXTRA)
    c = client.chat.completions.create(
        model=model_dir_name, max_tokens=12, temperature=0, extra_body=EXTRA,
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                 if k != "type"}}],
        messages=[*QUESTION, {"role": "assistant", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}])
    assert r2.usage.input_tokens == c.usage.prompt_tokens
    assert r2.output_text == (c.choices[0].message.content or "")


def test_previous_response_id_continues_the_conversation(client, model_dir_name):
    first = client.responses.create(model=model_dir_name, input=QUESTION, store=True,
                                    max_output_tokens=16, temperature=0, extra_body=EXTRA)
    assert first.store and client.responses.retrieve(first.id).id == first.id
    second = client.responses.create(model=model_dir_name, input="And 3 plus 4?",
                                     previous_response_id=first.id, max_output_tokens=8,
                                     temperature=0, extra_body=EXTRA)
    assert second.previous_response_id == first.id
    whole = [*QUESTION, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And 3 plus 4?"}]
    c = chat(client, model_dir_name, whole, n=8)
    assert second.usage.input_tokens == c.usage.prompt_tokens
    assert second.output_text == c.choices[0].message.content
    assert second.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model_dir_name, input="x", previous_response_id="resp_0")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")


def test_text_format_applies_to_the_answer(client, model_dir_name):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    r = client.responses.create(model=model_dir_name, input=QUESTION, max_output_tokens=300,
                                temperature=0, text={"format": {
                                    "type": "json_schema", "name": "n", "schema": schema}})
    assert r.status == "completed" and 0 <= json.loads(r.output_text)["n"] <= 99


def test_reasoning_effort_none_switches_thinking_off(client, model_dir_name):
    off = client.responses.create(model=model_dir_name, input=QUESTION, max_output_tokens=4,
                                  temperature=0, reasoning={"effort": "none"}, extra_body=EXTRA)
    on = client.responses.create(model=model_dir_name, input=QUESTION, max_output_tokens=4,
                                 temperature=0, reasoning={"effort": "high"}, extra_body=EXTRA)
    assert not items(off, "reasoning") and items(on, "reasoning")
    assert off.usage.input_tokens == on.usage.input_tokens + 1   # "<think></think>"
    assert off.reasoning.effort == "none"


@pytest.mark.parametrize("kwargs, param", [
    (dict(input=[{"role": "robot", "content": "x"}]), "input[0].role"),
    (dict(input="x", tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(input="x", max_output_tokens=0), "max_output_tokens"),
    (dict(input="x", text={"format": {"type": "json_schema", "name": "x", "schema": 5}}),
     "text.format.schema"),
])
def test_errors_name_the_field(client, model_dir_name, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_dir_name, **kwargs)
    assert e.value.body["param"] == param


def test_conventions_trace_metrics_render_salt(client, model_dir_name, thinking_server):
    url = thinking_server.url
    r = client.responses.create(model=model_dir_name, input=QUESTION, max_output_tokens=2,
                                temperature=0, extra_body={**EXTRA, "priority": -5})
    trace = httpx.get(f"{url}/v1/requests/{r.id}/trace").json()
    assert trace["request_id"] == r.id and trace["priority"] == -5
    metrics = httpx.get(f"{url}/metrics").text
    assert 'tokenloom:http_requests_total{endpoint="/v1/responses",status="200"}' in metrics
    body = {"model": model_dir_name, "input": QUESTION, "instructions": "Be brief."}
    ids = httpx.post(f"{url}/v1/responses/render", json=body).json()["token_ids"]
    chat_ids = httpx.post(f"{url}/v1/chat/completions/render", json={
        "messages": [{"role": "system", "content": "Be brief."}, *QUESTION]}).json()
    assert ids == chat_ids["token_ids"]
    long = [{"role": "user", "content": "tell me about salts " * 8}]
    kw = dict(model=model_dir_name, input=long, max_output_tokens=1, temperature=0)
    client.responses.create(**kw, extra_body={"cache_salt": "a"})
    again = client.responses.create(**kw, extra_body={"cache_salt": "a"})
    other = client.responses.create(**kw, extra_body={"cache_salt": "b"})
    assert again.usage.input_tokens_details.cached_tokens > 0
    assert other.usage.input_tokens_details.cached_tokens == 0


def test_a_draining_server_refuses(client, model_dir_name, thinking_server):
    state = thinking_server.app[next(iter(thinking_server.app))]
    state.draining = True
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client.responses.create(model=model_dir_name, input="x")
        assert e.value.status_code == 503
    finally:
        state.draining = False


def test_a_streaming_response_is_in_flight_until_it_ends(thinking_server, model_dir_name):
    """Drain and admin cancel find a running response by its id."""
    from servers import wait_for

    state = thinking_server.app[next(iter(thinking_server.app))]
    body = {"model": model_dir_name, "input": QUESTION, "max_output_tokens": 1000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", thinking_server.url + "/v1/responses", json=body,
                      timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        rid = json.loads(first[6:])["response"]["id"]
        assert rid in state.inflight
        assert sum(1 for _ in lines) > 1000
    assert wait_for(lambda: rid not in state.inflight)
