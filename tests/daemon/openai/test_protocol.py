"""Request parsing and validation, without a server: every refusal names its field."""

from __future__ import annotations

import json

import msgspec

import pytest

from tokenloom.actors.messages import RequestMeta
from tokenloom.daemon.errors import APIError
from tokenloom.daemon.openai.protocol import Limits, parse_chat, parse_completion

LIMITS = Limits(max_n=4, served_name="m", model_names=frozenset({"m"}), max_model_len=100)


def body(**fields) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


@pytest.mark.parametrize("prompt, expected", [
    ("w5 w6", ["w5 w6"]),
    (["w5", "w6 w7"], ["w5", "w6 w7"]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5, 6], [7]], [[5, 6], [7]]),
])
def test_completion_prompt_forms(prompt, expected):
    assert parse_completion(body(prompt=prompt), LIMITS).prompts == expected


def test_completion_defaults_follow_openai():
    p = parse_completion(body(prompt="x"), LIMITS)
    assert (p.params.max_tokens, p.params.temperature, p.params.n) == (16, 1.0, 1)
    assert not p.stream and not p.include_usage and not p.return_metrics and p.logprobs is None


def test_sampling_fields_reach_sampling_params():
    p = parse_completion(body(prompt="x", max_tokens=7, temperature=0.5, top_p=0.9, top_k=5,
                              min_p=0.1, n=3, stop="END", seed=11, presence_penalty=0.5,
                              frequency_penalty=-0.5, repetition_penalty=1.2, ignore_eos=True,
                              min_tokens=2, logprobs=3, cache_salt="tenant-a", priority=-1,
                              user="u", stream=True, stream_options={"include_usage": True},
                              return_metrics=True, speculative="off"), LIMITS)
    sp = p.params
    assert sp.speculative == "off"
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.n, sp.stop,
            sp.seed) == (7, 0.5, 0.9, 5, 0.1, 3, ("END",), 11)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.2)
    assert sp.ignore_eos and sp.min_tokens == 2 and sp.logprobs == 3
    assert p.stream and p.include_usage and p.return_metrics
    assert (p.meta.cache_salt, p.meta.priority, p.meta.tenant) == ("tenant-a", -1, "u")


def test_request_metadata_comes_whole_from_body_and_headers():
    classes = {"interactive": -1, "batch": 5}
    p = parse_chat(body(messages=[{"role": "user", "content": "a"}], user="u",
                        metadata={"team": "search", "exp": "t17"}, prompt_cache_key="k"),
                   LIMITS, {"X-Priority": "batch", "X-Tenant": "acme"}, classes)
    assert p.meta == RequestMeta(priority=5, tenant="acme", affinity="k",
                                 labels={"team": "search", "exp": "t17"})
    assert parse_completion(body(prompt="x"), LIMITS).meta == RequestMeta()


def test_chat_max_completion_tokens_and_logprobs():
    p = parse_chat(body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}],
                        max_completion_tokens=9, logprobs=True, top_logprobs=2), LIMITS)
    assert p.messages == [{"role": "user", "content": "ab"}]
    assert p.params.max_tokens == 9 and p.params.logprobs == 2 and not p.fit_max_tokens
    unset = parse_chat(body(messages=[{"role": "user", "content": "a"}]), LIMITS)
    assert unset.fit_max_tokens and unset.params.max_tokens == LIMITS.max_model_len
    assert unset.params.logprobs is None


@pytest.mark.parametrize("fields, status, param", [
    (dict(prompt=""), 400, "prompt"),
    (dict(prompt=[]), 400, "prompt"),
    (dict(prompt=["a", ""]), 400, "prompt[1]"),
    (dict(prompt=[1, "a"]), 400, "prompt"),
    (dict(prompt=[-1]), 400, "prompt"),
    (dict(prompt=5), 400, "prompt"),
    (dict(), 400, "prompt"),
    (dict(prompt="x", max_tokens=0), 400, "max_tokens"),
    (dict(prompt="x", max_tokens="3"), 400, "max_tokens"),
    (dict(prompt="x", temperature=-0.1), 400, "temperature"),
    (dict(prompt="x", top_p=0), 400, "top_p"),
    (dict(prompt="x", top_p=1.5), 400, "top_p"),
    (dict(prompt="x", n=5), 400, "n"),
    (dict(prompt="x", logprobs=21), 400, "logprobs"),
    (dict(prompt="x", min_tokens=20, max_tokens=3), 400, "min_tokens"),
    (dict(prompt="x", stop=[""]), 400, "stop"),
    (dict(prompt="x", stop=5), 400, "stop"),
    (dict(prompt="x", cache_salt=""), 400, "cache_salt"),
    (dict(prompt="x", metadata={f"k{i}": "v" for i in range(17)}), 400, "metadata"),
    (dict(prompt="x", metadata={"k": "v" * 513}), 400, "metadata"),
    (dict(prompt="x", metadata={"k": 3}), 400, "metadata[...]"),
    (dict(prompt="x", speculative="maybe"), 400, "speculative"),
    (dict(prompt="x", priority=[1]), 400, "priority"),
    (dict(prompt="x", stream_options={"include_usage": True}), 400, "stream_options"),
    (dict(prompt="x", model="other"), 404, "model"),
])
def test_completion_refusals_name_the_field(fields, status, param):
    with pytest.raises(APIError) as info:
        parse_completion(body(**fields), LIMITS)
    assert (info.value.status, info.value.param) == (status, param)
    assert set(msgspec.to_builtins(info.value.body())["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("fields, param", [
    (dict(messages=[]), "messages"),
    (dict(), "messages"),
    (dict(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
    (dict(messages=[{"role": "user", "content": "x"}], top_logprobs=2), "top_logprobs"),
    (dict(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=21),
     "top_logprobs"),
    (dict(messages=[{"role": "user", "content": "x"}], max_completion_tokens=0),
     "max_completion_tokens"),
])
def test_chat_refusals_name_the_field(fields, param):
    with pytest.raises(APIError) as info:
        parse_chat(body(**fields), LIMITS)
    assert (info.value.status, info.value.param) == (400, param)


def test_malformed_json_and_bad_utf8():
    with pytest.raises(APIError, match="not valid JSON"):
        parse_completion(b'{"model": "m", "prompt": ', LIMITS)
    with pytest.raises(APIError, match="UTF-8"):
        parse_completion(b'{"model": "m", "prompt": "\xff"}', LIMITS)
