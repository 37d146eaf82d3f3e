"""Structured output over HTTP with the official `openai` client, on the tiny model (whose
vocabulary is the words "w3" ... "w255", so constraints are written over those words):
guided_regex / guided_choice / guided_grammar / response_format hold on every choice
(n > 1, sampled, streamed); bad constraints are 400s naming the field and disturb nothing;
a constraint that leaves no legal token ends its request with a clear error."""

from __future__ import annotations

import re

import pytest

openai = pytest.importorskip("openai")

# Three words of w10..w19, then the grammar's end (only EOS is allowed after it).
THREE_TEENS = "(w1[0-9]){3}"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _words(text: str) -> list[str]:
    return text.split()


def test_guided_regex_holds_for_every_sampled_choice(client, model_name, server):
    r = client.completions.create(model=model_name, prompt="w5 w6 w7", max_tokens=10, n=4,
                                  temperature=1.5, seed=3,
                                  extra_body={"guided_regex": THREE_TEENS})
    assert len(r.choices) == 4
    for c in r.choices:
        assert c.finish_reason == "stop", c
        words = _words(c.text)
        assert len(words) == 3 and all(re.fullmatch(r"w1[0-9]", w) for w in words), c.text
    assert server.wait_idle()["used"] == 0


def test_unconstrained_rows_in_the_same_batch_are_untouched(client, model_name):
    """A constrained and an unconstrained greedy request side by side: the unconstrained
    one's output equals what it gives alone."""
    import concurrent.futures

    alone = client.completions.create(model=model_name, prompt="w9 w8", max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True}).choices[0]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        guided = pool.submit(client.completions.create, model=model_name, prompt="w9 w8",
                             max_tokens=8, temperature=0,
                             extra_body={"guided_regex": "(w2[0-9])+"})
        plain = pool.submit(client.completions.create, model=model_name, prompt="w9 w8",
                            max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        g, p = guided.result().choices[0], plain.result().choices[0]
    assert p.text == alone.text
    assert all(re.fullmatch(r"w2[0-9]", w) for w in _words(g.text)), g.text


def test_guided_choice_and_grammar(client, model_name):
    # One-digit words only: "w40" would also allow "w4", which no word continues.
    choices = ["w4w5", "w6", "w7w8w9"]
    spaced = {" ".join(re.findall(r"w\d+", c)) for c in choices}
    for seed in range(3):
        r = client.completions.create(model=model_name, prompt="w5", max_tokens=8,
                                      temperature=1.0, seed=seed,
                                      extra_body={"guided_choice": choices})
        assert r.choices[0].text.strip() in spaced and r.choices[0].finish_reason == "stop"
    grammar = 'root ::= "w7" item item\nitem ::= "w8" | "w9"'
    r = client.completions.create(model=model_name, prompt="w5", max_tokens=8, temperature=1.0,
                                  seed=1, extra_body={"guided_grammar": grammar})
    words = _words(r.choices[0].text)
    assert words[0] == "w7" and set(words[1:]) <= {"w8", "w9"} and len(words) == 3


def test_streamed_chat_deltas_follow_the_constraint(client, model_name):
    stream = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "w5 w6"}], max_tokens=10,
        temperature=1.0, seed=5, stream=True, extra_body={"guided_regex": THREE_TEENS})
    text, reasons = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["stop"]
    assert [bool(re.fullmatch(r"w1[0-9]", w)) for w in _words(text)] == [True] * 3, text


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "a[]"}, "guided_regex"),                  # does not parse
    ({"guided_regex": r"[^\s\S]"}, "guided_regex"),             # parses, matches nothing
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "w5", "guided_choice": ["w6"]}, "guided_choice"),   # two constraints
    ({"guided_regex": "w5", "ignore_eos": True}, "ignore_eos"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "bogus"}}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "patternProperties": {"^a": {}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_bad_constraints_are_400s_naming_the_field(client, model_name, server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, max_tokens=4,
                                       messages=[{"role": "user", "content": "w5"}],
                                       extra_body=extra)
    assert e.value.body["param"] == param, e.value.body
    # Nothing else disturbed: the next request is served.
    ok = client.completions.create(model=model_name, prompt="w5", max_tokens=2,
                                   extra_body={"guided_regex": "w7w8"}, temperature=0)
    assert ok.choices[0].text.split() == ["w7", "w8"]
    assert server.wait_idle()["used"] == 0


def test_a_constraint_with_no_legal_token_ends_the_request_with_an_error(client, model_name,
                                                                          server):
    """After "w7" the grammar allows only EOS, which min_tokens forbids: no token is legal.
    The request ends with an error saying so (no hang, no garbage output); others go on."""
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=model_name, prompt="w5", max_tokens=6,
                                  extra_body={"guided_choice": ["w7"], "min_tokens": 4})
    assert "allows no further token" in e.value.body["message"], e.value.body
    assert "guided_choice" in e.value.body["message"]
    ok = client.completions.create(model=model_name, prompt="w5", max_tokens=4, temperature=0,
                                   extra_body={"guided_choice": ["w7"]})
    assert ok.choices[0].text.strip() == "w7" and ok.choices[0].finish_reason == "stop"
    assert server.wait_idle()["used"] == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_requests_resume_with_their_grammar_state(
        client, model_name, server, tiny_model_dir, tmp_path, mode):
    """8 concurrent guided requests (40-token prompts, 24 constrained words out) in a
    24-block pool of 8 tokens with the KV plan off, so that some are preempted mid-output:
    each text equals the big-pool server's and still matches the constraint."""
    import concurrent.futures

    from servers import ServerThread, tiny_config

    prompts = [[10 + (i * 7 + k) % 90 for k in range(40)] for i in range(8)]
    regex = "(w1[0-9]|w2[0-9]){24}"
    body = dict(max_tokens=30, temperature=0, extra_body={"guided_regex": regex})

    def texts(c) -> list[str]:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(c.completions.create, model=model_name, prompt=p, **body)
                       for p in prompts]
            return [f.result().choices[0].text for f in futures]

    expected = texts(client)
    small = ServerThread(tiny_config(tiny_model_dir, tmp_path, **{
        "cache.num_blocks": 24, "scheduler.preemption_mode": mode,
        "cache.swap_space_bytes": 1 << 20, "scheduler.admission_lookahead_tokens": 0,
        "scheduler.kv_watermark": 0.0, "scheduler.kv_resume_watermark": 0.0}))
    try:
        got = texts(openai.OpenAI(base_url=small.url + "/v1", api_key="unused",
                                  max_retries=0, timeout=60))
        stats = small.wait_idle()
    finally:
        small.close()
    assert stats["num_preemptions"] > 0 and stats["used"] == 0
    assert got == expected
    for text in got:
        words = _words(text)
        assert len(words) == 24 and all(re.fullmatch(r"w[12][0-9]", w) for w in words), text


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]), "tools[0].function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
          response_format={"type": "json_object"}), "tool_choice"),
])
def test_bad_tools_are_400s_naming_the_field(client, model_name, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, max_tokens=4,
                                       messages=[{"role": "user", "content": "w5"}], **kwargs)
    assert e.value.body["param"] == param, e.value.body


def test_tool_choice_none_and_auto_answers_are_plain_content(client, model_name):
    """The tiny model cannot write JSON: with tools and tool_choice auto or none, its answer
    is content with its own finish reason, streamed or not."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=model_name, max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "w5"}],
                                           tools=tools, tool_choice=choice,
                                           extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
        assert len(_words(r.choices[0].message.content)) == 4
        stream = client.chat.completions.create(
            model=model_name, max_tokens=4, temperature=0, stream=True, tools=tools,
            tool_choice=choice, messages=[{"role": "user", "content": "w5"}], logprobs=True,
            extra_body={"ignore_eos": True})
        chunks = [c for chunk in stream for c in chunk.choices]
        assert "".join(c.delta.content or "" for c in chunks) == r.choices[0].message.content
        # Every token's logprob arrives, held-back ones included.
        assert sum(len(c.logprobs.content) for c in chunks if c.logprobs) == 4
