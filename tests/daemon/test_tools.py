"""Tool calling pieces without a model (daemon/tools.py): validation naming the field, the
forced call's schema, the fallback system message, and parsing an answer into a call."""

from __future__ import annotations

import json

import pytest

from tokenloom.daemon.errors import APIError
from tokenloom.daemon.protocol import _unsupported_keyword
from tokenloom.daemon.tools import fallback_messages, parse_call, parse_tools

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}
NOW = {"type": "function", "function": {"name": "now"}}


def spec(choice=None):
    return parse_tools([ADD, NOW], choice, _unsupported_keyword)


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None,
     "tools[0].function.parameters"),
    ([ADD, {"type": "function", "function": {"name": "bad name"}}], None,
     "tools[1].function.name"),
    ([ADD, ADD], None, "tools[1].function.name"),
    ([{"type": "retrieval"}], None, "tools[0].type"),
    ([ADD], {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
    ([ADD], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}], None,
     "tools[0].function.parameters"),
])
def test_bad_tools_name_the_field(tools, choice, param):
    with pytest.raises(APIError) as e:
        parse_tools(tools, choice, _unsupported_keyword)
    assert e.value.status == 400 and e.value.param == param


def test_forced_choices_and_their_call_schema():
    assert not spec().forced and spec().choice == "auto" and not spec("none").forced
    required = spec("required")
    assert required.forced and len(required.call_schema()["anyOf"]) == 2
    named = spec({"type": "function", "function": {"name": "add"}})
    schema = named.call_schema()
    assert named.forced and schema["properties"]["name"] == {"const": "add"}
    assert schema["properties"]["arguments"]["required"] == ["a", "b"]


def test_fallback_messages_describe_the_allowed_tools():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    out = fallback_messages(msgs, spec({"type": "function", "function": {"name": "add"}}))
    assert out[0]["content"].startswith("Be brief.") and '"add"' in out[0]["content"]
    assert '"now"' not in out[0]["content"] and msgs[0]["content"] == "Be brief."
    out = fallback_messages(msgs[1:], spec())
    assert out[0]["role"] == "system" and '"now"' in out[0]["content"] and len(out) == 2


def test_parse_call():
    call = parse_call('{"name": "add", "arguments": {"a": 2, "b": 3}}', spec())
    assert call["type"] == "function" and call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    for text in ('{"name": "sub", "arguments": {}}', "2 + 3 = 5", '{"name": "add"}',
                 '{"name": "add", "arguments": {}, "extra": 1}', '[1]'):
        assert parse_call(text, spec()) is None, text
    named_now = spec({"type": "function", "function": {"name": "now"}})
    assert parse_call('{"name": "add", "arguments": {}}', named_now) is None
