"""SSE frames (daemon/sse.py): one line of JSON per event, even for clients that split lines
the way str.splitlines does (httpx's aiter_lines, which guidellm reads streams with)."""

from __future__ import annotations

import json

import pytest

from tokenloom.daemon import sse


@pytest.mark.parametrize("text", ["a\u2028b", "\x85", "x\u2029y\u2028", "plain é€ \u2027",
                                  "line\nbreak\r"])
def test_frame_is_one_line_and_decodes_back(text):
    frame = sse.frame({"choices": [{"text": text}]})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    (line,) = frame.decode().strip().splitlines()
    assert json.loads(line[len("data: "):])["choices"][0]["text"] == text
    assert sse.encode(text) == frame[len(b'data: {"choices":[{"text":'):-len(b"}]}\n\n")]
