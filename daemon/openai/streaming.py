"""Streaming responses: SSE frames written with a deadline, thinking streamed apart from
the answer (`reasoning_content` deltas, as vLLM streams them), and tool calls streamed in
OpenAI's incremental shape."""

from __future__ import annotations

import asyncio
import dataclasses

import structlog
from aiohttp import web

from tokenloom.daemon import sse
from tokenloom.daemon.errors import APIError
from tokenloom.daemon.openai import protocol
from tokenloom.daemon.openai import tools as T
from tokenloom.daemon.openai.formatter import Formatter
from tokenloom.daemon.openai.generation import Delta, Generation
from tokenloom.daemon.state import STATE

log = structlog.get_logger("tokenloom.http")


class ClientTooSlow(Exception):
    """The stream's client took no data for server.write_timeout_seconds; the connection
    has been aborted."""

    def __init__(self, response: web.StreamResponse):
        super().__init__("the client took no data within server.write_timeout_seconds")
        self.response = response


class StreamWriter:
    """Writes a stream's frames; a client whose socket takes no data for
    server.write_timeout_seconds is cut off (ConnectionResetError: the handler's cleanup
    aborts its engine requests). The fast path is a plain write: only when the transport
    already holds unsent data can a write wait, and only then is it given a deadline."""

    def __init__(self, request: web.Request, resp: web.StreamResponse, timeout: float):
        self.transport = request.transport
        self.resp = resp
        self.timeout = timeout
        self.stats = request.app[STATE].connections

    def _cut(self) -> ClientTooSlow:
        t = self.transport
        log.warning("slow client cut off: no data taken", seconds=self.timeout,
                    buffered_bytes=t.get_write_buffer_size())
        if self.stats is not None:
            self.stats.slow_readers_cut += 1
        t.abort()
        return ClientTooSlow(self.resp)

    async def write(self, data: bytes) -> None:
        t = self.transport
        if t is None or not t.get_write_buffer_size():
            await self.resp.write(data)
            return
        try:
            await asyncio.wait_for(self.resp.write(data), self.timeout)
        except TimeoutError:
            raise self._cut() from None

    async def eof(self) -> None:
        if self.transport is not None and self.transport.get_write_buffer_size():
            try:
                await asyncio.wait_for(self.resp.write_eof(), self.timeout)
            except TimeoutError:
                raise self._cut() from None
            return
        await self.resp.write_eof()


async def stream(request: web.Request, gen: Generation, fmt: Formatter,
                 parsed: protocol.ParsedRequest) -> web.StreamResponse:
    """Stream `gen` as SSE chunks (then the usage chunk, then [DONE]). Raises ClientTooSlow
    when the client takes no data for server.write_timeout_seconds."""
    resp = await sse.open_stream(request, {"X-Request-Id": gen.request_id})
    out = StreamWriter(request, resp, request.app[STATE].config.server.write_timeout_seconds)
    if parsed.continuous_usage:
        fmt.running_usage = gen.choice_usage
    try:
        for first in fmt.first_chunks(gen):
            await out.write(sse.frame(first))
        remaining = len(gen.choices)
        calls = ToolCallStream(fmt, parsed.tools) if fmt.calls_tools else None
        thoughts = ReasoningDeltas(fmt) if getattr(fmt, "thinking", None) else None
        async for delta in gen.deltas():
            if delta.finish_reason is not None:
                remaining -= 1
            if thoughts is not None:   # the reasoning goes out first; the answer goes on
                frame, delta = thoughts.split(delta)
                if frame is not None:
                    await out.write(frame)
            if calls is not None:
                last = remaining == 0 and not parsed.include_usage
                for frame in calls.feed(delta, gen if last else None):
                    await out.write(frame)
                continue
            if delta.finish_reason is None and not delta.text and parsed.logprobs is None:
                continue  # tokens whose text is held back (half a character, a stop prefix)
            last = remaining == 0 and not parsed.include_usage
            await out.write(fmt.chunk_frame(delta, gen if last else None))
        if parsed.include_usage:
            await out.write(sse.frame(fmt.usage_chunk(gen)))
    except APIError as e:
        # The status line is gone already: report the error as the stream's last event.
        log.warning("stream failed", error=e.message)
        await out.write(sse.frame(e.body()))
    await out.write(sse.DONE)
    await out.eof()
    return resp


class ReasoningDeltas:
    """Streamed chat with a reasoning parser: each delta's text is split by its choice's
    splitter (daemon/openai/reasoning.py) into a `reasoning_content` chunk and the answer's
    delta, which then goes the usual way (content, or tool calls)."""

    def __init__(self, fmt: Formatter):
        self.fmt = fmt
        self.splitters: dict[int, object] = {}

    def split(self, d: Delta) -> tuple[bytes | None, Delta]:
        splitter = self.splitters.get(d.index)
        if splitter is None:
            splitter = self.splitters[d.index] = self.fmt.thinking.splitter()
        reasoning, answer = splitter.feed(d.text)
        if d.finish_reason is not None:
            more = splitter.finish()
            reasoning, answer = reasoning + more[0], answer + more[1]
        frame = None
        if reasoning:
            chunk = self.fmt.chunk(Delta(d.index, "", [], []), None)
            chunk["choices"][0]["delta"] = {"reasoning_content": reasoning}
            frame = sse.frame(chunk)
        return frame, dataclasses.replace(d, text=answer)


class ToolCallStream:
    """Streamed chat with tools. A forced tool_choice's answer is a call by construction (an
    output constraint): its calls are streamed as generated, in OpenAI's incremental shape
    (daemon/openai/tools.py CallDeltas). With "auto" the text is held back while it may be a call
    (while it is empty or starts with "{" or "["); when it ends as a call, its calls are
    sent in the same shape, one argument fragment per generated piece, else it is sent as
    content. Either way the finish chunk says "tool_calls" for a call."""

    def __init__(self, fmt: Formatter, spec: T.ToolSpec):
        self.fmt, self.spec = fmt, spec
        # index -> (text pieces, logprobs) held back (auto), or the text so far (forced)
        self.held: dict[int, tuple[list[str], list]] = {}
        self.calls: dict[int, T.CallDeltas] = {}
        self.passing: set[int] = set()

    def _frame(self, index: int, entries: list[dict]) -> bytes:
        chunk = self.fmt.chunk(Delta(index, "", [], []), None)
        chunk["choices"][0]["delta"] = {"tool_calls": entries}
        return sse.frame(chunk)

    def feed(self, d: Delta, final_of: Generation | None) -> list[bytes]:
        fmt = self.fmt
        if d.index in self.passing:
            if d.finish_reason is None and not d.text:
                return []
            return [fmt.chunk_frame(d, final_of)]
        pieces, lps = self.held.pop(d.index, ([], []))
        pieces, lps = pieces + [d.text], lps + list(d.logprobs or ())
        text = "".join(pieces)
        if self.spec.forced:
            calls = self.calls.setdefault(d.index, T.CallDeltas())
            self.held[d.index] = ([text], [])
            entries = calls.feed(text)
            out = [self._frame(d.index, entries)] if entries else []
            if d.finish_reason is not None:
                reason = "tool_calls" if d.finish_reason == "stop" else d.finish_reason
                out.append(fmt.chunk_frame(Delta(d.index, "", [], [], reason), final_of))
            return out
        if d.finish_reason is None:
            if text.lstrip()[:1] in ("", "{", "["):
                self.held[d.index] = (pieces, lps)
                return []
            self.passing.add(d.index)
            return [fmt.chunk_frame(Delta(d.index, text, d.token_ids, lps), None)]
        if d.finish_reason != "stop" or T.parse_calls(text, self.spec) is None:
            return [fmt.chunk_frame(Delta(d.index, text, d.token_ids, lps, d.finish_reason),
                                    final_of)]
        calls, so_far, out = T.CallDeltas(), "", []
        for piece in pieces:
            so_far += piece
            entries = calls.feed(so_far)
            if entries:
                out.append(self._frame(d.index, entries))
        out.append(fmt.chunk_frame(Delta(d.index, "", [], [], "tool_calls"), final_of))
        return out
