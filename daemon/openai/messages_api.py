"""POST /v1/messages and /v1/messages/count_tokens (the Anthropic Messages API, which
Claude Code speaks), and POST /v1/messages/render.

A message's `content` is a list of blocks: a `thinking` block (the model's thinking), a
`text` block (the answer) and one `tool_use` block per tool call (`input`: the arguments
object). `stop_reason` is "end_turn", "max_tokens", "stop_sequence" (with `stop_sequence`
the one that matched) or "tool_use". `usage`: `cache_read_input_tokens` are the prompt
tokens served from the prefix cache, `cache_creation_input_tokens` the prompt tokens this
request computed and left in it (its full blocks), `input_tokens` the rest of the prompt.

Streamed (`stream: true`), the SSE events are Anthropic's: message_start, ping, then per block
content_block_start, content_block_delta (`thinking_delta`, `text_delta` or
`input_json_delta`) ..., content_block_stop; message_delta (stop_reason and the final usage)
and message_stop. A failure after the stream started is an `error` event. Errors are
Anthropic's error bodies, {"type": "error", "error": {"type", "message"}}, the message
starting with the field at fault (`messages.1.content.0.type: ...`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import uuid

import msgspec
from aiohttp import web

from tokenloom.actors.front.fan_out import fan_out
from tokenloom.actors.front.prompts import PromptError, encode_prompt
from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.daemon.errors import APIError
from tokenloom.daemon.openai import messages_protocol as P
from tokenloom.daemon.openai import protocol
from tokenloom.daemon.openai.answer import ARGS, CALL, REASONING, TEXT, AnswerStream, Event
from tokenloom.daemon.openai.chat import template_inputs
from tokenloom.daemon.openai.endpoints import check_serving, read_body, struct_response
from tokenloom.daemon.openai.generation import Generation
from tokenloom.daemon.openai.reasoning import with_thinking
from tokenloom.daemon.openai.render import render_conversation
from tokenloom.daemon.openai.turn import event_frame, serve_turn
from tokenloom.daemon.state import STATE, ServerState

# HTTP status -> Anthropic's error type.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
_STOPS = {"tool_calls": "tool_use", "length": "max_tokens"}


class AnthropicErrorDetail(msgspec.Struct, kw_only=True):
    type: str
    message: str


class AnthropicError(msgspec.Struct, kw_only=True):
    """Anthropic's error body (what /openapi.json documents for these endpoints)."""
    type: str
    error: AnthropicErrorDetail


class CountTokensResponse(msgspec.Struct, kw_only=True):
    input_tokens: int


def error_body(e: APIError) -> dict:
    message = e.message
    if e.param and not message.startswith(e.param):
        message = f"{e.param}: {message}"
    message = re.sub(r"\[(\d+)\]", r".\1", message)   # Anthropic writes paths messages.1.x
    kind = _ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(e: APIError) -> web.Response:
    return web.Response(status=e.status, body=msgspec.json.encode(error_body(e)),
                        content_type="application/json", headers=e.headers)


def usage(gen: Generation, block_size: int, prefix_caching: bool) -> dict:
    """Anthropic's usage: the prompt as cache reads + cache writes + the rest."""
    u = gen.usage()
    prompt, cached = u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]
    created = max(prompt // block_size * block_size - cached, 0) if prefix_caching else 0
    return {"input_tokens": prompt - cached - created, "output_tokens": u["completion_tokens"],
            "cache_creation_input_tokens": created, "cache_read_input_tokens": cached}


class MessagesFormatter:
    endpoint = "messages"

    def __init__(self, state: ServerState, req: P.MessagesRequest, model: str):
        self.state = state
        self.req = req
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self._block = -1                    # index of the block being streamed
        self._open: str | None = None       # its type
        self._text_sent = False

    # -- whole messages ------------------------------------------------------------------
    def content(self, answer: AnswerStream) -> list[dict]:
        blocks = []
        if answer.reasoning_text:
            blocks.append({"type": "thinking", "thinking": answer.reasoning_text,
                           "signature": ""})
        if answer.text or not answer.calls and not answer.reasoning_text:
            blocks.append({"type": "text", "text": answer.text})
        for call in answer.calls:
            blocks.append({"type": "tool_use", "id": call.id, "name": call.name,
                           "input": _input(call.arguments)})
        return blocks

    def stop(self, answer: AnswerStream, gen: Generation) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        reason = answer.stop
        if reason in _STOPS:
            return _STOPS[reason], None
        matched = self._stop_sequence(gen) if reason == "stop" else None
        return ("stop_sequence", matched) if matched is not None else ("end_turn", None)

    def _stop_sequence(self, gen: Generation) -> str | None:
        """The stop sequence that ended the output: the engine ends on one without emitting
        it (the finish reason says "stop" either way); the output's last tokens hold it
        unless they end with EOS."""
        stops = self.req.stop_sequences
        [c] = gen.results()
        if not stops or not c.token_ids or c.token_ids[-1] in self.state.engine.eos_token_ids:
            return None
        tail = self.state.engine.tokenizer.decode(c.token_ids[-16:])
        found = [(tail.rfind(s), s) for s in stops if s in tail]
        return max(found)[1] if found else None

    def usage(self, gen: Generation) -> dict:
        cfg = self.state.config.cache
        return usage(gen, self.state.engine.info.block_size, cfg.enable_prefix_caching)

    def message(self, content: list, stop: tuple, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": usage}

    # -- TurnFormatter -------------------------------------------------------------------
    def refused(self, e: APIError) -> APIError:
        return e

    def whole(self, answer: AnswerStream, gen: Generation) -> dict:
        return self.message(self.content(answer), self.stop(answer, gen), self.usage(gen))

    @staticmethod
    def _event(kind: str, **fields) -> bytes:
        return event_frame(kind, {"type": kind, **fields})

    def opening(self, gen: Generation) -> list[bytes]:
        prompt = gen.usage()["prompt_tokens"]
        start = self.message([], (None, None), {"input_tokens": prompt, "output_tokens": 0,
                                                "cache_creation_input_tokens": None,
                                                "cache_read_input_tokens": None})
        return [self._event("message_start", message=start), self._event("ping")]

    def events(self, events: list[Event]) -> list[bytes]:
        out = []
        for ev in events:
            if ev.kind == REASONING:
                if self._open != "thinking":
                    out += self._start({"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": ev.text}))
            elif ev.kind == TEXT:
                if self._open != "text":
                    out += self._start({"type": "text", "text": ""})
                    self._text_sent = True
                out.append(self._delta({"type": "text_delta", "text": ev.text}))
            elif ev.kind == CALL:
                out += self._start({"type": "tool_use", "id": ev.call_id, "name": ev.name,
                                    "input": {}})
            elif ev.kind == ARGS:
                out.append(self._delta({"type": "input_json_delta", "partial_json": ev.text}))
        return out

    def _start(self, block: dict) -> list[bytes]:
        out = self._stop()
        self._block += 1
        self._open = block["type"]
        return out + [self._event("content_block_start", index=self._block,
                                  content_block=block)]

    def _delta(self, delta: dict) -> bytes:
        return self._event("content_block_delta", index=self._block, delta=delta)

    def _stop(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [self._event("content_block_stop", index=self._block)]

    def closing(self, answer: AnswerStream, gen: Generation) -> list[bytes]:
        out = self._stop()
        if not answer.calls and not answer.reasoning_text and not self._text_sent:
            out += self._start({"type": "text", "text": ""}) + self._stop()
        reason, matched = self.stop(answer, gen)
        return out + [self._event("message_delta",
                                  delta={"stop_reason": reason, "stop_sequence": matched},
                                  usage=self.usage(gen)),
                      self._event("message_stop")]

    def failed(self, e: APIError, answer: AnswerStream, gen: Generation) -> list[bytes]:
        return [event_frame("error", error_body(e))]


def _input(arguments: str) -> dict:
    """A tool_use block's input: the arguments object (one cut off by max_tokens: {})."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _parse(request: web.Request, state: ServerState, body: bytes):
    req, parsed = P.parse_messages(body, state.limits, request.headers,
                                   state.config.scheduler.priority_classes)
    return req, with_thinking(state.reasoning, _switched(state, req, parsed))


def _switched(state: ServerState, req, parsed):
    """`parsed` with the template's thinking switch set as `thinking` asks."""
    if state.reasoning is None:
        return parsed
    kwargs = state.reasoning.with_switch(parsed.chat_template_kwargs, P.thinking_switch(req))
    if kwargs is parsed.chat_template_kwargs:
        return parsed
    return dataclasses.replace(parsed, chat_template_kwargs=kwargs)


async def create_message(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    check_serving(state)
    req, parsed = _parse(request, state, await read_body(request, state))
    return await serve_turn(request, state, parsed, MessagesFormatter(state, req, parsed.model))


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the prompt tokens the same conversation (system, tools,
    thinking switch) would be given; what `usage` adds up to for it."""
    state = request.app[STATE]
    check_serving(state)
    req = protocol.decode(await read_body(request, state), P.CountTokensRequest)
    model, messages, tools, kwargs = P.conversation(req, state.limits)
    if state.reasoning is not None:
        kwargs = state.reasoning.with_switch(kwargs, P.thinking_switch(req))
    parsed = protocol.ParsedRequest(
        prompts=None, messages=messages, params=SamplingParams(max_tokens=1),
        fit_max_tokens=True, stream=False, include_usage=False, return_metrics=False,
        logprobs=None, model=model, tools=tools, chat_template_kwargs=kwargs)
    messages, template_tools = template_inputs(state, parsed)
    [gen_req] = fan_out("count", [None], parsed.params, messages=messages,
                        tools=template_tools, chat_template_kwargs=kwargs)
    try:
        ids = await asyncio.to_thread(encode_prompt, state.engine.tokenizer, gen_req)
    except PromptError as e:
        raise APIError(400, str(e), param=e.param) from None
    return struct_response(CountTokensResponse(input_tokens=len(ids)))


async def render_message(request: web.Request) -> web.Response:
    """POST /v1/messages/render: the prompt token ids the request would run with (as the
    chat render endpoint answers them)."""
    state = request.app[STATE]
    check_serving(state)
    _, parsed = _parse(request, state, await read_body(request, state))
    return struct_response(await render_conversation(state, parsed, "msg"))
