"""OpenAI response objects for one request: what completions and chat share.

`Formatter` builds the whole response (non-streamed) and each stream chunk; the two
endpoints differ only in their object names, a choice's shape and its logprobs' shape, which
the subclasses (completions.py, chat.py) give. Text-only stream chunks (the per-token hot
path) are spliced into bytes prepared once per request.
"""

from __future__ import annotations

import time

from tokenloom.daemon import sse
from tokenloom.daemon.openai import protocol
from tokenloom.daemon.openai.generation import Choice, Delta, Generation


class Formatter:
    object = ""          # the whole response's "object"
    endpoint = ""        # "completions" | "chat" (as captures name it: daemon/debug/capture.py)
    chunk_object = ""    # a stream chunk's "object"
    calls_tools = False  # chat with tools the model may call (chat.py)

    def __init__(self, state, request_id: str, parsed: protocol.ParsedRequest):
        self.state = state
        self.id = request_id
        self.parsed = parsed
        self.created = int(time.time())
        self.model = parsed.model
        self._frame_parts: tuple[bytes, bytes, bytes] | None = None   # see chunk_frame
        # continuous_usage_stats: choice index -> its usage so far (set by streaming.stream).
        self.running_usage = None
        self.token_text = state.token_text

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    # -- per endpoint --------------------------------------------------------------------
    def logprobs(self, index: int, lps) -> dict | None:
        """The logprobs object of a choice's tokens `lps` (None when not asked for)."""
        raise NotImplementedError

    def choice(self, c: Choice, lps: dict | None) -> dict:
        """One choice of the whole response."""
        raise NotImplementedError

    def choice_logprobs(self, c: Choice) -> dict | None:
        """The logprobs object of a whole choice (completions' echo prepends the prompt)."""
        return self.logprobs(c.index, c.logprobs)

    def delta_logprobs(self, d: Delta) -> dict | None:
        """The logprobs object of a stream chunk (None: the chunk has no token logprobs)."""
        return self.logprobs(d.index, d.logprobs) if d.logprobs else None

    def delta_fields(self, d: Delta) -> dict:
        """A stream chunk's choice fields carrying the delta's text."""
        raise NotImplementedError

    def frame_body(self, d: Delta) -> bytes:
        """The bytes of `delta_fields(d)` inside a chunk's choice (text-only chunks)."""
        raise NotImplementedError

    def first_chunks(self, gen: Generation) -> list[dict]:
        """Chunks sent before any token (chat: the role)."""
        return []

    # -- whole responses -----------------------------------------------------------------
    def full_response(self, choices: list[Choice], gen: Generation) -> dict:
        out = self._base(self.object)
        out["choices"] = [self.choice(c, self.choice_logprobs(c)) for c in choices]
        out["usage"] = gen.usage()
        if self.parsed.return_metrics:
            out["metrics"] = gen.request_metrics()
        return out

    # -- stream chunks -------------------------------------------------------------------
    def chunk(self, d: Delta, final_of: Generation | None) -> dict:
        lps = self.delta_logprobs(d)
        chunk = self._base(self.chunk_object)
        chunk["choices"] = [{"index": d.index, **self.delta_fields(d), "logprobs": lps,
                             "finish_reason": d.finish_reason}]
        self.usage_slot(chunk)
        if final_of is not None and self.parsed.return_metrics:
            chunk["metrics"] = final_of.request_metrics()
        return chunk

    def chunk_frame(self, d: Delta, final_of: Generation | None) -> bytes:
        """`sse.frame(self.chunk(d, final_of))`, byte for byte. The common chunk (text only:
        no logprobs, no metrics) is spliced into bytes prepared once per request, without
        building and encoding its dicts: this runs once per streamed token."""
        if d.logprobs or (final_of is not None and self.parsed.return_metrics) or \
                self.parsed.continuous_usage:
            return sse.frame(self.chunk(d, final_of))
        if self._frame_parts is None:
            self._frame_parts = self._frame_template()
        head, middle, tail = self._frame_parts
        return b"".join((head, sse.encode(d.index), middle, self.frame_body(d),
                         b',"logprobs":null,"finish_reason":', sse.encode(d.finish_reason),
                         tail))

    def _frame_template(self) -> tuple[bytes, bytes, bytes]:
        """The bytes around index, text and finish_reason in a text-only chunk's frame."""
        chunk = self._base(self.chunk_object)
        chunk["choices"] = [0]
        self.usage_slot(chunk)
        before, after = sse.frame(chunk).split(b'"choices":[0]')
        return before + b'"choices":[{"index":', b",", b"}]" + after

    def usage_slot(self, chunk: dict) -> None:
        # With include_usage, OpenAI sends "usage": null on every chunk but the last; with
        # continuous_usage_stats too, vLLM sends the choice's running counts on every chunk.
        if not self.parsed.include_usage:
            return
        choices = chunk["choices"]
        if self.running_usage is not None and choices and isinstance(choices[0], dict):
            chunk["usage"] = self.running_usage(choices[0]["index"])
        else:
            chunk["usage"] = None

    def usage_chunk(self, gen: Generation) -> dict:
        chunk = self._base(self.chunk_object)
        chunk["choices"] = []
        chunk["usage"] = gen.usage()
        if self.parsed.return_metrics:
            chunk["metrics"] = gen.request_metrics()
        return chunk
