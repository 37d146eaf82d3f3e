"""The per-token SSE fast path (`Formatter.chunk_frame`) is byte for byte the frame of the
general path (`sse.frame(Formatter.chunk(...))`), for both endpoints and every option that
shapes a text-only chunk."""

import json
from types import SimpleNamespace

import pytest

from tokenloom.daemon import sse
from tokenloom.daemon.openai import protocol
from tokenloom.daemon.openai.chat import ChatFormatter
from tokenloom.daemon.openai.completions import CompletionFormatter
from tokenloom.daemon.openai.formatter import Formatter
from tokenloom.daemon.openai.generation import Delta

LIMITS = protocol.Limits(max_n=4, served_name="m", model_names=frozenset({"m", 'we"ird/m'}),
                         max_model_len=4096)
TEXTS = ["", "hello", ' "quoted" \\ back\nslash', "é日本語🎉", "\u2028\x00"]


def formatter(chat: bool, include_usage: bool, model: str) -> Formatter:
    body = {"model": model, "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    parse = protocol.parse_chat if chat else protocol.parse_completion
    parsed = parse(json.dumps(body).encode(), LIMITS)
    state = SimpleNamespace(token_text=str)
    return (ChatFormatter if chat else CompletionFormatter)(state, "cmpl-0123", parsed)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", ["m", 'we"ird/m'])
def test_fast_frame_equals_general_frame(chat, include_usage, model):
    fmt = formatter(chat, include_usage, model)
    for text in TEXTS:
        for finish_reason in (None, "stop", "length"):
            for index in (0, 5):
                delta = Delta(index, text, [7], [], finish_reason)
                assert fmt.chunk_frame(delta, None) == sse.frame(fmt.chunk(delta, None))
