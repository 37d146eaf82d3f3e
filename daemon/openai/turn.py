"""One assistant turn served for the agent APIs (/v1/responses, /v1/messages): the request
became a chat conversation (protocol.ParsedRequest, one choice), which runs exactly as a
chat completion does — the same prompt through the chat template, the same scheduler, prefix
cache, priorities and trace — and its output goes through an `AnswerStream` to the API's
`TurnFormatter`, whole or as that API's stream of events.

Conventions shared with completions and chat (handlers.serve): the request id is the id the
client sees (so GET /v1/requests/{id}/trace finds it), it is in flight from before it is
submitted until its response is written (drain waits for it; admin cancel finds it), a
refusal picks the HTTP status before anything is sent, a failure after the stream started is
the stream's last event, a client that goes away aborts it, and a client that takes no data
for server.write_timeout_seconds is cut off.
"""

from __future__ import annotations

from typing import Protocol

import structlog
from aiohttp import web

from tokenloom.daemon import sse
from tokenloom.daemon.errors import APIError
from tokenloom.daemon.openai import protocol
from tokenloom.daemon.openai.answer import AnswerStream, Event
from tokenloom.daemon.openai.chat import template_inputs
from tokenloom.daemon.openai.generation import Generation
from tokenloom.daemon.openai.streaming import ClientTooSlow, StreamWriter
from tokenloom.daemon.state import ServerState

log = structlog.get_logger("tokenloom.http")


class TurnFormatter(Protocol):
    id: str          # the response's id, which is the engine request's
    endpoint: str    # for logs: "responses" | "messages"

    def refused(self, e: APIError) -> APIError:
        """A refusal at admission, with the field named as this API spells it."""

    def whole(self, answer: AnswerStream, gen: Generation) -> dict:
        """The non-streamed response."""

    def opening(self, gen: Generation) -> list[bytes]:
        """Stream frames before any output."""

    def events(self, events: list[Event]) -> list[bytes]:
        """Stream frames for some output."""

    def closing(self, answer: AnswerStream, gen: Generation) -> list[bytes]:
        """Stream frames once the output is complete."""

    def failed(self, e: APIError, answer: AnswerStream, gen: Generation) -> list[bytes]:
        """The stream's last frames when it fails after it started."""


async def serve_turn(request: web.Request, state: ServerState, parsed: protocol.ParsedRequest,
                     fmt: TurnFormatter, on_done=None) -> web.StreamResponse:
    """Serve `parsed` (one choice) through `fmt`. `on_done(answer, gen, body)`: called with
    the finished answer (and the whole response: `body`) when it completed."""
    structlog.contextvars.bind_contextvars(request_id=fmt.id)
    messages, template_tools = template_inputs(state, parsed)
    gen = Generation(state.engine, fmt.id, [None], messages, parsed.params,
                     parsed.fit_max_tokens, parsed.meta, metrics=state.metrics, log=log,
                     tools=template_tools, chat_template_kwargs=parsed.chat_template_kwargs)
    state.inflight.add(fmt.id, gen)   # drain waits for it; admin cancel/trace find it
    log.info("request", endpoint=fmt.endpoint, stream=parsed.stream,
             max_tokens=parsed.params.max_tokens)
    finished = False
    try:
        try:
            await gen.start()   # refusals become the HTTP status (400, 429) here
        except APIError as e:
            e = fmt.refused(e)
            if e.status == 429:
                e.headers["Retry-After"] = str(state.config.server.retry_after_seconds)
            raise e from None
        answer = AnswerStream(parsed.thinking, parsed.tools)
        if parsed.stream:
            try:
                resp = await _stream(request, state, gen, fmt, answer, on_done)
            except ClientTooSlow as e:
                return e.response   # not finished: the cleanup below aborts its request
        else:
            async for delta in gen.deltas():
                answer.feed(delta)
            body = fmt.whole(answer, gen)
            if on_done is not None:
                on_done(answer, gen, body)
            resp = web.json_response(body, headers={"X-Request-Id": fmt.id},
                                     dumps=lambda obj: sse.encode(obj).decode())
        finished = True
        return resp
    finally:
        state.inflight.remove(fmt.id)
        if gen.close() and not finished:
            state.metrics.aborted.inc()
            log.info("request aborted", reason="the client went away")


async def _stream(request: web.Request, state: ServerState, gen: Generation,
                  fmt: TurnFormatter, answer: AnswerStream, on_done) -> web.StreamResponse:
    resp = await sse.open_stream(request, {"X-Request-Id": fmt.id})
    out = StreamWriter(request, resp, state.config.server.write_timeout_seconds)
    try:
        for frame in fmt.opening(gen):
            await out.write(frame)
        async for delta in gen.deltas():
            for frame in fmt.events(answer.feed(delta)):
                await out.write(frame)
        for frame in fmt.closing(answer, gen):
            await out.write(frame)
        if on_done is not None:
            on_done(answer, gen, None)
    except APIError as e:
        # The status line is gone already: report the error as the stream's last event.
        log.warning("stream failed", error=e.message)
        for frame in fmt.failed(e, answer, gen):
            await out.write(frame)
    await out.eof()
    return resp


def event_frame(name: str, payload) -> bytes:
    """An SSE event with its type on the `event:` line (the Responses and Messages APIs
    name each event; their SDKs read the type from the data as well)."""
    return b"event: " + name.encode() + b"\n" + sse.frame(payload)
