"""Structured output on the real default model (SmolLM2-135M-Instruct) served by
`tokenloom serve`, through the official `openai` client: every answer to a nested JSON
schema (objects, arrays, enums, required fields) parses with json.loads and validates with
jsonschema, sampled, with n > 1, streamed, and sharing a cached prompt prefix."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from servers import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "user", "strict": True, "schema": SCHEMA}}
MESSAGES = [{"role": "system", "content": "You answer with JSON describing a user."},
            {"role": "user", "content": "Describe a user of a wiki who edits pages about cats."}]


@pytest.fixture(scope="module")
def served(default_model_dir):
    server = ServerProcess("--model", str(default_model_dir), "--set", "model.device=cpu",
                           "--set", "model.dtype=float32", "--set", "model.num_threads=2",
                           timeout=300)
    yield server
    assert server.stop() == 0, "\n".join(server.lines[-20:])


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def _valid(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


def test_nested_schema_holds_greedy_and_sampled_with_n(client):
    greedy = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                            max_tokens=160, response_format=RESPONSE_FORMAT)
    assert greedy.choices[0].finish_reason == "stop"
    _valid(greedy.choices[0].message.content)
    # Sampled at a high temperature, where an unconstrained small model wanders off.
    sampled = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.3,
                                             seed=11, n=3, max_tokens=160,
                                             response_format=RESPONSE_FORMAT)
    assert len(sampled.choices) == 3
    for c in sampled.choices:
        assert c.finish_reason == "stop", c
        _valid(c.message.content)


def test_streamed_answer_reassembles_to_valid_json(client):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.9,
                                            seed=4, max_tokens=160, stream=True,
                                            response_format=RESPONSE_FORMAT)
    parts, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["stop"] and len([p for p in parts if p]) > 5
    _valid("".join(parts))


def test_json_object_and_choice_on_the_default_model(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.7, seed=2,
                                       max_tokens=120, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=8,
        temperature=1.0, n=4, seed=3, extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert {c.message.content for c in r.choices} <= {"yes", "no", "maybe"}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


def test_required_tool_call_is_parsed_by_the_client_types(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice="required", temperature=0.8, seed=5,
                                       max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_named_tool_call_streams_as_one_delta_that_reassembles(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    full = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                          tool_choice=named, temperature=0, max_tokens=80)
    (call,) = full.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                            tool_choice=named, temperature=0, max_tokens=80,
                                            stream=True)
    name, arguments, reasons, content = "", "", [], ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or ():
                assert tc.index == 0
                name += tc.function.name or ""
                arguments += tc.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["tool_calls"] and content == ""
    assert (name, json.loads(arguments)) == (call.function.name,
                                             json.loads(call.function.arguments))
