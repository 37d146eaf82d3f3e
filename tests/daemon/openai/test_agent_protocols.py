"""The agent APIs without a server: Responses and Messages bodies become the chat conversation
they are (the same messages chat would build) or a 400 naming the field as each API spells
it; an answer's deltas become the same events and final answer however they are cut; the
response store's bounds; Anthropic's error shape and usage split; the pooling config read
from a model directory."""

from __future__ import annotations

import json

import msgspec
import pytest

from tokenloom.daemon.errors import APIError
from tokenloom.daemon.openai import messages_protocol as MP
from tokenloom.daemon.openai import responses_protocol as RP
from tokenloom.daemon.openai.answer import ARGS, CALL, REASONING, TEXT, AnswerStream
from tokenloom.daemon.openai.generation import Delta
from tokenloom.daemon.openai.messages_api import error_body
from tokenloom.daemon.openai.pooling_config import PoolingConfigError, load
from tokenloom.daemon.openai.protocol import Limits, parse_chat
from tokenloom.daemon.openai.reasoning import TagParser, Thinking
from tokenloom.daemon.openai.responses_store import ResponseStore
from tokenloom.daemon.openai.tools import parse_tools

LIMITS = Limits(max_n=4, served_name="m", model_names=frozenset({"m"}), max_model_len=4096)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def responses(**body):
    return RP.parse_responses(json.dumps(body).encode(), LIMITS)


def messages(**body):
    return MP.parse_messages(json.dumps({"max_tokens": 8, **body}).encode(), LIMITS)


def chat(**body):
    return parse_chat(json.dumps(body).encode(), LIMITS)


# -- the same conversation -----------------------------------------------------------------
def test_a_tool_round_trip_is_the_conversation_chat_builds():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    expect = chat(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]).messages
    _, conv, r = responses(instructions="Be brief.", input=[
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_1", "summary": []}])
    assert r.messages == expect and len(conv) == 3   # (instructions are not kept)
    _, m = messages(system=[{"type": "text", "text": "Be brief.",
                             "cache_control": {"type": "ephemeral"}}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "tool_use", "id": "call_1", "name": "get_weather",
             "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                      "content": [{"type": "text", "text": "sunny"}]}]}])
    assert m.messages == expect


def test_tools_and_choices_map_onto_chats():
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    _, _, r = responses(input="hi", tools=[tool], tool_choice={"type": "function",
                                                               "name": "get_weather"})
    assert r.tools.choice == "get_weather" and r.params.guided.kind == "json_schema"
    _, m = messages(messages=[{"role": "user", "content": "hi"}],
                    tools=[{"name": "get_weather", "input_schema": WEATHER}],
                    tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert m.tools.choice == "required" and not m.tools.parallel and m.params.guided
    _, m = messages(messages=[{"role": "user", "content": "hi"}],
                    tools=[{"name": "get_weather", "input_schema": WEATHER}])
    assert m.tools.choice == "auto" and m.params.guided is None


def test_sampling_and_routing_fields():
    _, _, r = responses(input="hi", max_output_tokens=7, temperature=0, prompt_cache_key="k",
                        cache_salt="s", priority=-3, metadata={"a": "b"}, user="u",
                        text={"format": {"type": "json_schema", "name": "x", "schema": WEATHER}})
    assert (r.params.max_tokens, r.params.temperature, r.fit_max_tokens) == (7, 0.0, False)
    assert (r.meta.affinity, r.meta.cache_salt, r.meta.priority, r.meta.tenant) == \
        ("k", "s", -3, "u")
    assert r.params.guided.kind == "json_schema" and r.max_tokens_field == "max_output_tokens"
    _, m = messages(messages=[{"role": "user", "content": "hi"}], stop_sequences=["END"],
                    metadata={"user_id": "alice"}, top_k=5)
    assert m.params.stop == ("END",) and m.meta.tenant == "alice" and m.params.top_k == 5


@pytest.mark.parametrize("body, param", [
    (dict(input=[]), "input"),
    (dict(input=[{"role": "robot", "content": "x"}]), "input[0].role"),
    (dict(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]),
     "input[0].call_id"),
    (dict(input=[{"type": "function_call_output", "call_id": "c", "output": 5}]),
     "input[0].output"),
    (dict(input=[{"type": "input_image"}]), "input[0].type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image"}]}]),
     "input[0].content[0]"),
    (dict(input="x", tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(input="x", tools=[{"type": "function", "name": "bad name"}]), "tools[0].name"),
    (dict(input="x", tools=[{"type": "function", "name": "f", "parameters": {"type": "array"}}]),
     "tools[0].parameters"),
    (dict(input="x", tool_choice={"type": "file_search"}), "tool_choice"),
    (dict(input="x", text={"format": {"type": "json_schema", "schema": 3}}),
     "text.format.schema"),
    (dict(input="x", text={"format": {"type": "yaml"}}), "text.format.type"),
    (dict(input="x", reasoning={"effort": "extreme"}), "reasoning.effort"),
    (dict(input="x", max_output_tokens=0), "max_output_tokens"),
    (dict(input="x", temperature=-1), "temperature"),
    (dict(input="x", background=True), "background"),
    (dict(input="x", model="other"), "model"),
    (dict(input="x", chat_template_kwargs={"tokenize": True}), "chat_template_kwargs.tokenize"),
])
def test_bad_responses_bodies_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        responses(**body)
    assert e.value.param == param and e.value.status in (400, 404), e.value.message


@pytest.mark.parametrize("body, param", [
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "system", "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": [{"type": "image"}]}]),
     "messages[0].content[0].type"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]),
     "messages[0].content[0].tool_use_id"),
    (dict(messages=[{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]),
     "messages[0].content[0].input"),
    (dict(messages=[{"role": "user", "content": "x"}], tools=[{"name": "f"}]),
     "tools[0].input_schema"),
    (dict(messages=[{"role": "user", "content": "x"}],
          tools=[{"name": "f", "input_schema": {"type": "string"}}]), "tools[0].input_schema"),
    (dict(messages=[{"role": "user", "content": "x"}],
          tools=[{"type": "bash_20250124", "name": "bash"}]), "tools[0].type"),
    (dict(messages=[{"role": "user", "content": "x"}], tool_choice={"type": "sometimes"}),
     "tool_choice"),
    (dict(messages=[{"role": "user", "content": "x"}],
          thinking={"type": "enabled", "budget_tokens": 10}), "thinking.budget_tokens"),
    (dict(messages=[{"role": "user", "content": "x"}], stop_sequences=[""]), "stop_sequences"),
    (dict(messages=[{"role": "user", "content": "x"}], max_tokens=0), "max_tokens"),
    (dict(messages=[{"role": "user", "content": "x"}], system=[{"type": "image"}]),
     "system[0].type"),
])
def test_bad_messages_bodies_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        messages(**body)
    assert e.value.param == param and e.value.status == 400, e.value.message


def test_anthropic_errors_name_the_field_their_way():
    e = APIError(400, "must be user or assistant", param="messages[1].role")
    assert error_body(e) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "messages.1.role: must be user or assistant"}}
    assert error_body(APIError(503, "draining"))["error"]["type"] == "overloaded_error"
    assert error_body(APIError(429, "full"))["error"]["type"] == "rate_limit_error"
    assert error_body(APIError(404, "nope"))["error"]["type"] == "not_found_error"


# -- answers -------------------------------------------------------------------------------
def _run(text: str, cuts: list[int], thinking=None, tools=None, finish="stop"):
    answer = AnswerStream(thinking, tools)
    bounds = [0, *cuts, len(text)]
    events = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        last = k == len(bounds) - 2
        events += answer.feed(Delta(0, text[a:b], [k], [], finish if last else None))
    return answer, events


def _joined(events, kind):
    return "".join(e.text for e in events if e.kind == kind)


CALL_TEXT = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
SPEC = parse_tools([{"type": "function", "function": {"name": "get_weather",
                                                      "parameters": WEATHER}}],
                   None, lambda s, p: None)


@pytest.mark.parametrize("cuts", [[], [1], [5, 9], list(range(1, 60, 3))])
def test_answers_are_the_same_however_they_are_cut(cuts):
    thinking = Thinking(TagParser("think"), opened=True)
    text = "let me see</think>" + CALL_TEXT
    forced = parse_tools(SPEC.template_tools(), "required", lambda s, p: None)
    for tools in (SPEC, forced):
        answer, events = _run(text, [c for c in cuts if c < len(text)], thinking, tools)
        assert answer.reasoning_text == _joined(events, REASONING) == "let me see"
        [call] = answer.calls
        assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
        assert _joined(events, ARGS) == call.arguments and answer.stop == "tool_calls"
        [start] = [e for e in events if e.kind == CALL]
        assert start.call_id == call.id and answer.text == ""
    answer, events = _run("no call here", cuts, None, SPEC)
    assert _joined(events, TEXT) == answer.text == "no call here" and not answer.calls


def test_a_held_answer_that_is_not_a_call_is_text_and_a_cut_call_says_length():
    answer, events = _run('{"not": "a call"}', [3], None, SPEC)
    assert _joined(events, TEXT) == answer.text == '{"not": "a call"}'
    forced = parse_tools(SPEC.template_tools(), {"type": "function", "function": {
        "name": "get_weather"}}, lambda s, p: None)
    answer, events = _run(CALL_TEXT[:40], [10], None, forced, finish="length")
    assert answer.stop == "length" and answer.calls[0].name == "get_weather"


# -- the store -----------------------------------------------------------------------------
def test_the_store_is_bounded_in_count_and_time():
    now = [0.0]
    store = ResponseStore(2, 10.0, now=lambda: now[0])
    store.put("a", {"id": "a"}, [1])
    now[0] = 5
    store.put("b", {"id": "b"}, [2])
    now[0] = 8
    store.put("c", {"id": "c"}, [3])
    assert store.get("a") is None and store.get("b").conversation == (2,)
    now[0] = 15.5
    assert store.get("b") is None and store.get("c") is not None and len(store) == 1
    assert not ResponseStore(0, 1.0).enabled


# -- pooling config ------------------------------------------------------------------------
def test_pooling_config_from_sentence_transformers_files(tmp_path):
    assert load(tmp_path, 64) == load(tmp_path, 64)
    default = load(tmp_path, 64)
    assert (default.kind, default.normalize, default.matryoshka) == ("last", True, False)
    assert "Matryoshka" in default.check_dimensions(32)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [16, 32]}))
    cfg = load(tmp_path, 64)
    assert (cfg.kind, cfg.normalize, cfg.dimensions) == ("mean", False, (16, 32))
    assert cfg.check_dimensions(32) is None and "16, 32" in cfg.check_dimensions(20)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_max_tokens": True}))
    with pytest.raises(PoolingConfigError):
        load(tmp_path, 64)


def test_request_structs_encode():
    # The documented request types round-trip (what /openapi.json is generated from).
    req = msgspec.json.decode(b'{"input": "x", "store": true}', type=RP.ResponsesRequest)
    assert req.store and msgspec.json.decode(msgspec.json.encode(req),
                                             type=RP.ResponsesRequest) == req


def test_an_assistant_turn_with_text_and_calls_keeps_both():
    """Agents often write a sentence before a call: the template sees the text, then the
    calls as the model is asked to write them."""
    from tokenloom.daemon.openai.prompt_inputs import ChatMessage, chat_messages

    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    out = chat_messages([ChatMessage(role="assistant", content="Let me check.",
                                     tool_calls=[call])])
    assert out[0]["content"] == 'Let me check.\n{"name": "get_weather", "arguments": ' \
                                '{"city": "Oslo"}}'
    only = chat_messages([ChatMessage(role="assistant", tool_calls=[call, call])])
    assert json.loads(only[0]["content"]) == [{"name": "get_weather",
                                               "arguments": {"city": "Oslo"}}] * 2
