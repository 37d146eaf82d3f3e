"""Speculative decoding over HTTP: the per-request `speculative` field, vLLM's
spec_decode counters in /metrics, and the decision in the request's trace.

Prompt lookup with unigrams over a prompt that holds every word of the tiny vocabulary:
whatever the model samples occurs in the prompt, so every step has drafts to verify."""

from __future__ import annotations

import re

import pytest

from client import get, metric, metrics, post
from tinymodel import VOCAB


@pytest.fixture(scope="module")
def spec_server(tiny_model_dir, tmp_path_factory):
    from servers import ServerThread, tiny_config
    s = ServerThread(tiny_config(tiny_model_dir, tmp_path_factory.mktemp("cache"), **{
        "speculative.method": "ngram", "speculative.ngram_min": 1,
        "speculative.ngram_max": 2, "speculative.num_speculative_tokens": 3}))
    yield s
    s.close()


PROMPT = " ".join(f"w{i}" for i in range(3, VOCAB)) * 2


def test_speculative_field_metrics_and_trace(spec_server, model_name):
    url = spec_server.url
    before = metrics(url)
    status, on = post(url, "/v1/completions", dict(
        model=model_name, prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True,
        speculative="on"))
    assert status == 200, on
    status, off = post(url, "/v1/completions", dict(
        model=model_name, prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True,
        speculative="off"))
    assert status == 200
    assert on["choices"][0]["text"] == off["choices"][0]["text"]     # exact greedy
    after = metrics(url)
    drafts = (metric(after, "vllm:spec_decode_num_drafts_total")
              - metric(before, "vllm:spec_decode_num_drafts_total"))
    tokens = metric(after, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(after, "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [metric(after, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                      position=str(j)) for j in range(3)]
    assert drafts > 0 and tokens >= drafts and 0 <= accepted <= tokens
    assert sum(per_pos) == accepted
    assert re.search(r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{.*position="2"',
                     after, re.M)
    trace = get(url, f"/v1/requests/{on['id']}/trace")[1]
    spec = trace["speculation"]
    assert spec["method"] == "ngram" and spec["mode"] == "on" and spec["drafted"] > 0
    assert len(spec["drafted_per_position"]) == 3
    trace_off = get(url, f"/v1/requests/{off['id']}/trace")[1]
    assert trace_off["speculation"] is None


def test_bad_speculative_value_is_a_400_naming_the_field(spec_server, model_name):
    status, body = post(spec_server, "/v1/completions", dict(
        model=model_name, prompt="w5 w6", max_tokens=2, speculative="always"))
    assert status == 400
    assert body["error"]["param"] == "speculative"
    assert "auto, on, off" in body["error"]["message"]


def test_speculative_on_without_a_proposer_is_a_400_naming_the_fix(server, model_name):
    """speculative.method = "off" (the default): asking for "on" is refused, not ignored;
    "auto" (the default) and "off" are served."""
    status, body = post(server, "/v1/completions", dict(
        model=model_name, prompt="w5 w6", max_tokens=2, speculative="on"))
    assert status == 400, body
    assert body["error"]["param"] == "speculative"
    assert "speculative.method=ngram" in body["error"]["message"]
    for value in ("auto", "off"):
        status, body = post(server, "/v1/completions", dict(
            model=model_name, prompt="w5 w6", max_tokens=2, speculative=value))
        assert status == 200, body
