"""Reasoning output over HTTP on a tiny random model that thinks (tests/thinking_model.py),
with the official `openai` client:

1. chat returns the thinking as `reasoning_content` beside `content`, split exactly where
   transformers' own greedy continuation of the same weights says `</think>` came, streamed
   (`delta.reasoning_content`, then `delta.content`) and not, the same;
2. `chat_template_kwargs` reaches the template: `enable_thinking: false` closes the thinking
   in the prompt, and the answer has no reasoning part;
3. structured output and forced tool calls apply to the answer: the model thinks freely,
   then the constraint holds after `</think>`."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

from thinking_model import thinking_conversation  # noqa: E402

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(thinking_server):
    return openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused",
                         max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def case(thinking_model):
    return thinking_conversation(*thinking_model, max_new_tokens=24)


def test_chat_splits_thinking_where_the_model_ended_it(client, model_dir_name, case):
    r = client.chat.completions.create(model=model_dir_name, messages=case["messages"],
                                       max_tokens=24, **GREEDY)
    msg = r.choices[0].message
    assert msg.reasoning_content == case["reasoning"] and msg.reasoning_content
    assert msg.content == case["answer"] and msg.content
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(case["prompt_ids"])


def test_streamed_reasoning_comes_first_and_equals_the_whole(client, model_dir_name, case):
    chunks = list(client.chat.completions.create(
        model=model_dir_name, messages=case["messages"], max_tokens=24, stream=True, **GREEDY))
    kinds, reasoning, content = [], "", ""
    for c in chunks:
        delta = c.choices[0].delta if c.choices else None
        r = getattr(delta, "reasoning_content", None) if delta else None
        if r:
            reasoning += r
            kinds.append("r")
        if delta is not None and delta.content:
            content += delta.content
            kinds.append("c")
    assert (reasoning, content) == (case["reasoning"], case["answer"])
    assert "cr" not in "".join(kinds)   # no reasoning after the answer began
    assert len([k for k in kinds if k == "r"]) > 1   # it streamed, not in one piece


def test_chat_template_kwargs_switch_the_thinking_off(client, model_dir_name, case):
    on = client.chat.completions.create(model=model_dir_name, messages=case["messages"],
                                        max_tokens=4, **GREEDY)
    off = client.chat.completions.create(
        model=model_dir_name, messages=case["messages"], max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    # "<think>" opened the thinking; "<think></think>" closes it: one more prompt token.
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + 1
    assert off.choices[0].message.reasoning_content is None
    assert on.choices[0].message.reasoning_content is not None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_dir_name, messages=case["messages"],
                                       max_tokens=4, extra_body={
                                           "chat_template_kwargs": {"tools": []}})
    assert e.value.body["param"] == "chat_template_kwargs.tools"


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def oracle(thinking_model):
    from thinking_model import Oracle
    return Oracle(*thinking_model)


def _thinking_request(server, oracle, **body) -> tuple[dict, str]:
    """A request body (one question, plus `body`) whose prompt, as the server renders it,
    transformers continues with a thinking that ends within 40 tokens; and that thinking."""
    import httpx

    for i in range(40):
        req = dict(messages=[{"role": "user", "content": f"What is {i} plus {i + 3}?"}],
                   **body)
        ids = httpx.post(server.url + "/v1/chat/completions/render", json=req,
                         timeout=60).json()["token_ids"]
        thought = oracle.thinking(ids, 40)
        if thought:
            return req, thought
    raise AssertionError("no conversation ends its thinking within 40 tokens")


def test_a_forced_tool_call_follows_the_thinking(client, model_dir_name, thinking_server,
                                                 oracle):
    body, thought = _thinking_request(thinking_server, oracle, tools=[WEATHER],
                                      tool_choice="required", parallel_tool_calls=False)
    for stream in (False, True):
        kwargs = dict(model=model_dir_name, max_tokens=300, temperature=0, stream=stream,
                      **body)
        if not stream:
            choice = client.chat.completions.create(**kwargs).choices[0]
            reasoning, reason = choice.message.reasoning_content, choice.finish_reason
            [call] = choice.message.tool_calls
            args = call.function.arguments
        else:
            reasoning, args, reason = "", "", None
            for c in client.chat.completions.create(**kwargs):
                d = c.choices[0].delta
                reasoning += getattr(d, "reasoning_content", None) or ""
                for tc in d.tool_calls or ():
                    args += tc.function.arguments or ""
                reason = c.choices[0].finish_reason or reason
        # The model thought first (the prompt opened it), unconstrained: what transformers
        # says it thinks, up to its </think>; then the call, in the grammar.
        assert reasoning == thought, stream
        assert json.loads(args)["city"] in ("Paris", "Oslo") and reason == "tool_calls"


def test_structured_output_applies_to_the_answer(client, model_dir_name, thinking_server,
                                                 oracle):
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    body, thought = _thinking_request(thinking_server, oracle, response_format=fmt)
    r = client.chat.completions.create(model=model_dir_name, max_tokens=300, temperature=0,
                                       **body)
    msg = r.choices[0].message
    assert msg.reasoning_content == thought
    assert 0 <= json.loads(msg.content)["n"] <= 99 and r.choices[0].finish_reason == "stop"
