"""Tool calling pieces without a model (daemon/openai/tools.py): validation naming the field, the
forced call's schema, the fallback system message, and parsing an answer into a call."""

from __future__ import annotations

import json

import pytest

from tokenloom.daemon.errors import APIError
from tokenloom.daemon.openai.guided_fields import unsupported_keyword
from tokenloom.daemon.openai.tools import (CallDeltas, fallback_messages, parse_calls, parse_tools,
                                    scan_calls)

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}
NOW = {"type": "function", "function": {"name": "now"}}


def spec(choice=None, parallel=None):
    return parse_tools([ADD, NOW], choice, unsupported_keyword, parallel)


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
        parse_tools(tools, choice, unsupported_keyword)
    assert e.value.status == 400 and e.value.param == param


def test_forced_choices_and_their_call_schema():
    assert not spec().forced and spec().choice == "auto" and not spec("none").forced
    required = spec("required", parallel=False)
    assert required.forced and len(required.call_schema()["anyOf"]) == 2
    one, many = spec("required").call_schema()["anyOf"]   # parallel calls (the default)
    assert one == required.call_schema() and many == {"type": "array", "items": one,
                                                      "minItems": 1}
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


def test_parse_calls():
    calls = parse_calls('{"name": "add", "arguments": {"a": 2, "b": 3}}', spec())
    assert len(calls) == 1 and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    two = parse_calls('[{"name": "add", "arguments": {"a":1,"b":2}},\n {"name": "now", '
                      '"arguments": {}}]', spec())
    assert [c["function"] for c in two] == [{"name": "add", "arguments": '{"a":1,"b":2}'},
                                            {"name": "now", "arguments": "{}"}]
    assert len({c["id"] for c in two}) == 2
    for text in ('{"name": "sub", "arguments": {}}', "2 + 3 = 5", '{"name": "add"}',
                 '{"name": "add", "arguments": {}, "extra": 1}', '[1]', "[]",
                 '[{"name": "now", "arguments": {}}, 3]'):
        assert parse_calls(text, spec()) is None, text
    named_now = spec({"type": "function", "function": {"name": "now"}})
    assert parse_calls('{"name": "add", "arguments": {}}', named_now) is None
    # One call per answer: with parallel_tool_calls false, and with a named tool_choice.
    array = '[{"name": "now", "arguments": {}}]'
    assert parse_calls(array, spec(parallel=False)) is None
    assert parse_calls(array, named_now) is None and parse_calls(array, spec()) is not None


ANSWERS = [
    '{"name": "add", "arguments": {"a": 2, "b": 3}}',
    '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "now", "arguments": {}}]',
    ' [ {"arguments": {"a": 7, "b": -1}, "name": "add"} ,{"name":"now","arguments":{}} ]',
    '{"name": "add", "arguments": {"a": 1, "b": 2, "note": "x}\\"]{\\u00e9", "l": [1, {"c": []}]}}',
]


@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_call_deltas_reassemble_to_the_parsed_calls(answer, piece):
    """Fed the answer a few characters at a time (as tokens come), the deltas have
    OpenAI's incremental shape (one first delta per call with id, type and name, then
    argument fragments only) and join up to the calls parsed from the whole answer."""
    deltas, seen = CallDeltas(), []
    for end in list(range(piece, len(answer), piece)) + [len(answer)]:
        seen.extend(deltas.feed(answer[:end]))
    assert deltas.feed(answer) == []                            # nothing sent twice
    joined: dict[int, dict] = {}
    for d in seen:
        if d["index"] not in joined:
            assert set(d) == {"index", "id", "type", "function"} and d["type"] == "function"
            assert d["function"]["arguments"] == ""
            joined[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            joined[d["index"]]["arguments"] += d["function"]["arguments"]
    expected = parse_calls(answer, spec())
    assert [joined[k] for k in sorted(joined)] == [c["function"] for c in expected]
    assert sorted(joined) == list(range(len(expected)))
    if answer.index('"name"') < answer.index('"arguments"') and len(answer) > 3 * piece:
        # Arguments come in several fragments as they are generated, not at the end (when
        # the name comes first: a call is announced once its name is known).
        assert sum("id" not in d for d in seen) > len(expected)


class _State:
    token_text = staticmethod(str)


class _Gen:
    def __init__(self, choices):
        self.choices = choices

    def results(self):
        return self.choices

    @staticmethod
    def usage():
        return {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}


def _served(answer: str, choice, piece: int, finish: str = "stop"):
    """The answer, generated a few characters at a time, through the server's formatter:
    (the non-streamed response, the streamed chunks reassembled by the openai client's own
    stream state)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from tokenloom.daemon import sse
    from tokenloom.daemon.openai import protocol
    from tokenloom.daemon.openai.chat import ChatFormatter
    from tokenloom.daemon.openai.generation import Choice, Delta
    from tokenloom.daemon.openai.streaming import ToolCallStream
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [ADD, NOW], "tool_choice": choice, "stream": True}
    parsed = protocol.parse_chat(json.dumps(body).encode(), protocol.Limits(
        max_n=1, served_name="m", model_names=frozenset({"m"}), max_model_len=100))
    fmt = ChatFormatter(_State(), "chatcmpl-1", parsed)
    done = [Choice(0, "r", text=[answer], finish_reason=finish)]
    full = ChatCompletion.model_validate(fmt.full_response(done, _Gen(done)))
    stream, state = ToolCallStream(fmt, parsed.tools), ChatCompletionStreamState()
    frames = [sse.frame(c) for c in fmt.first_chunks(_Gen([Choice(0, "r")]))]
    pieces = [answer[i:i + piece] for i in range(0, len(answer), piece)]
    for k, text in enumerate(pieces):
        frames += stream.feed(Delta(0, text, [k], []), None)
    frames += stream.feed(Delta(0, "", [], [], finish), None)
    for frame in frames:
        assert frame.startswith(b"data: ")
        state.handle_chunk(ChatCompletionChunk.model_validate_json(frame[6:]))
    if finish == "length":   # the client refuses to "finalize" a cut-off completion
        return full, state.current_completion_snapshot, len(frames)
    return full, state.get_final_completion(), len(frames)


@pytest.mark.parametrize("choice", ["required", "auto"])
@pytest.mark.parametrize("answer", ANSWERS[:2] + ANSWERS[3:])
def test_streamed_tool_calls_reassemble_to_the_response_with_openai_types(choice, answer):
    full, streamed, num_frames = _served(answer, choice, 4)
    want = full.choices[0]
    assert want.finish_reason == "tool_calls" and want.message.content is None
    got = streamed.choices[0]
    assert got.finish_reason == "tool_calls"
    assert [(c.type, c.function.name, c.function.arguments) for c in got.message.tool_calls] \
        == [(c.type, c.function.name, c.function.arguments) for c in want.message.tool_calls]
    assert [json.loads(c.function.arguments) for c in got.message.tool_calls] \
        == [c["arguments"] for c in ([json.loads(answer)] if answer[0] == "{"
                                     else json.loads(answer))]
    assert num_frames > 4 + len(want.message.tool_calls)   # fragments, not one delta per call


def test_an_auto_answer_that_is_not_a_call_streams_as_content():
    full, streamed, _ = _served('{"name": "add", "arguments": {"a": 1}} and more', "auto", 5)
    for c in (full.choices[0], streamed.choices[0]):
        assert c.finish_reason == "stop" and not c.message.tool_calls
        assert c.message.content == '{"name": "add", "arguments": {"a": 1}} and more'


@pytest.mark.parametrize("cut", [1, 12, 30, 50])
def test_a_forced_call_cut_off_says_the_same_streamed_or_not(cut):
    """max_tokens ends a forced call mid-way: both responses carry the calls as far as they
    got (none before a name is complete), with finish_reason "length"."""
    answer = ANSWERS[1][:cut]
    full, streamed, _ = _served(answer, "required", 3, finish="length")
    want, got = full.choices[0], streamed.choices[0]
    assert want.finish_reason == got.finish_reason == "length"
    assert want.message.content is None and not got.message.content
    calls = lambda m: [(c.function.name, c.function.arguments) for c in m.tool_calls or ()]
    assert calls(got.message) == calls(want.message)
    assert calls(want.message) == [(c.name, c.arguments) for c in scan_calls(answer)
                                   if c.name is not None]
