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


def _check_calls(calls) -> None:
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments),
                            tools[call.function.name]["function"]["parameters"])


def _reassembled(stream):
    """The streamed chunks put together by the openai client's own stream state, and how
    many chunks carried tool-call deltas."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    state, with_calls = ChatCompletionStreamState(), 0
    for chunk in stream:
        state.handle_chunk(chunk)
        with_calls += any(c.delta.tool_calls for c in chunk.choices)
    return state.get_final_completion(), with_calls


def test_required_tool_call_is_parsed_by_the_client_types(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice="required", temperature=0.8, seed=5,
                                       max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) >= 1
    _check_calls(choice.message.tool_calls)
    one = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                         tool_choice="required", parallel_tool_calls=False,
                                         temperature=0.8, seed=5, max_tokens=80)
    assert len(one.choices[0].message.tool_calls) == 1
    _check_calls(one.choices[0].message.tool_calls)


TWO_CITIES = [{"role": "user", "content": "What is the weather in Paris and in Tokyo? Call "
                                          "get_weather once for each city."}]


@pytest.mark.parametrize("messages, choice", [
    (ASK, {"type": "function", "function": {"name": "get_time"}}),
    (TWO_CITIES, "required"),
])
def test_streamed_tool_calls_are_incremental_and_reassemble(client, messages, choice):
    """Streamed in OpenAI's incremental shape (a first delta with id, type and name, then
    argument fragments as they are generated), reassembled by the openai client's stream
    state: the same calls as the non-streamed answer (greedy)."""
    kwargs = dict(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=choice,
                  temperature=0, max_tokens=120)
    full = client.chat.completions.create(**kwargs).choices[0]
    assert full.finish_reason == "tool_calls"
    _check_calls(full.message.tool_calls)
    if isinstance(choice, dict):
        assert [c.function.name for c in full.message.tool_calls] == ["get_time"]
    streamed, with_calls = _reassembled(client.chat.completions.create(**kwargs, stream=True))
    got = streamed.choices[0]
    assert got.finish_reason == "tool_calls" and not got.message.content
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in full.message.tool_calls]
    assert with_calls > 2 * len(full.message.tool_calls)   # fragments, not a call per delta
