"""POST /v1/responses (the OpenAI Responses API, which Codex CLI speaks), GET
/v1/responses/{id} and POST /v1/responses/render.

A response's `output` is a list of items: a `reasoning` item (the thinking, as
`reasoning_text` content), a `message` item (the answer, as `output_text`) and one
`function_call` item per tool call. Its status is "completed", or "incomplete" with
`incomplete_details.reason` "max_output_tokens" when the output was cut there. `usage`
counts input tokens (with `input_tokens_details.cached_tokens`: prefix-cache hits) and
output tokens (with `output_tokens_details.reasoning_tokens`).

Streamed (`stream: true`), the SSE events are OpenAI's, each with its `sequence_number`:
response.created, response.in_progress, then per output item response.output_item.added,
its content (response.content_part.added, response.reasoning_text.delta /
response.output_text.delta ..., their .done events, response.content_part.done; for a call
response.function_call_arguments.delta ... .done), response.output_item.done; last
response.completed (or response.incomplete). A failure after the stream started ends it with
response.failed. Errors before it are OpenAI's error bodies, naming the field.

Stateless by default: with `store: true` the response and its conversation are kept
(responses_store.py) for a later `previous_response_id`.
"""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from tokenloom.daemon.errors import APIError
from tokenloom.daemon.openai import protocol
from tokenloom.daemon.openai import responses_protocol as P
from tokenloom.daemon.openai.answer import ARGS, CALL, REASONING, TEXT, AnswerStream, Event
from tokenloom.daemon.openai.endpoints import check_serving, read_body, struct_response
from tokenloom.daemon.openai.generation import Generation
from tokenloom.daemon.openai.prompt_inputs import ChatMessage
from tokenloom.daemon.openai.reasoning import with_thinking
from tokenloom.daemon.openai.render import render_conversation
from tokenloom.daemon.openai.turn import event_frame, serve_turn
from tokenloom.daemon.state import STATE, ServerState


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormatter:
    endpoint = "responses"

    def __init__(self, req: P.ResponsesRequest, model: str, effort: str | None):
        self.req = req
        self.id = _id("resp")
        self.model = model
        self.effort = effort
        self.created = int(time.time())
        self.seq = 0
        self._ids = {"reasoning": _id("rs"), "message": _id("msg")}
        self._call_items: dict[int, str] = {}    # call index -> its item id
        self._open: dict | None = None           # the item being streamed
        self._index = -1                         # its output_index
        self._message_sent = False
        self.final: dict | None = None           # the last response object built

    # -- the response object -------------------------------------------------------------
    def response(self, status: str, output: list, usage: dict | None = None,
                 error: dict | None = None, incomplete: dict | None = None) -> dict:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": error, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": self.effort, "summary": None},
            "service_tier": "default", "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": (req.text.format if req.text is not None and req.text.format
                                else {"type": "text"})},
            "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
            "tools": req.tools or [], "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": req.truncation or "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {}}

    def _call_item_id(self, index: int) -> str:
        if index not in self._call_items:
            self._call_items[index] = _id("fc")
        return self._call_items[index]

    def output(self, answer: AnswerStream, incomplete: bool) -> list[dict]:
        items = []
        if answer.reasoning_text:
            items.append(self._reasoning_item(answer.reasoning_text))
        if not answer.calls:
            items.append(self._message_item(answer.text, incomplete))
        for k, call in enumerate(answer.calls):
            items.append(self._call_item(k, call.id, call.name, call.arguments, "completed"))
        return items

    def _reasoning_item(self, text: str, status: str = "completed") -> dict:
        content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
        return {"type": "reasoning", "id": self._ids["reasoning"], "summary": [],
                "content": content, "encrypted_content": None, "status": status}

    def _message_item(self, text: str | None, incomplete: bool = False,
                      status: str | None = None) -> dict:
        content = [] if text is None else [_output_text(text)]
        return {"type": "message", "id": self._ids["message"], "role": "assistant",
                "status": status or ("incomplete" if incomplete else "completed"),
                "content": content}

    def _call_item(self, index: int, call_id: str, name: str, arguments: str,
                   status: str) -> dict:
        return {"type": "function_call", "id": self._call_item_id(index), "call_id": call_id,
                "name": name, "arguments": arguments, "status": status}

    @staticmethod
    def usage(answer: AnswerStream, gen: Generation) -> dict:
        u = gen.usage()
        return {"input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"][
                    "cached_tokens"]},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": answer.reasoning_tokens},
                "total_tokens": u["total_tokens"]}

    def _final(self, answer: AnswerStream, gen: Generation) -> dict:
        incomplete = answer.finish_reason == "length"
        self.final = self.response(
            "incomplete" if incomplete else "completed", self.output(answer, incomplete),
            self.usage(answer, gen),
            incomplete={"reason": "max_output_tokens"} if incomplete else None)
        return self.final

    # -- TurnFormatter ---------------------------------------------------------------------
    def refused(self, e: APIError) -> APIError:
        if e.param == "max_tokens":
            e.param, e.message = "max_output_tokens", e.message.replace("max_tokens",
                                                                        "max_output_tokens")
        elif e.param == "messages":
            e.param = "input"
        return e

    def whole(self, answer: AnswerStream, gen: Generation) -> dict:
        return self._final(answer, gen)

    def _event(self, kind: str, **fields) -> bytes:
        frame = event_frame(kind, {"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return frame

    def opening(self, gen: Generation) -> list[bytes]:
        started = self.response("in_progress", [])
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]

    def events(self, events: list[Event]) -> list[bytes]:
        out = []
        for ev in events:
            if ev.kind == REASONING:
                if self._open is None or self._open["type"] != "reasoning":
                    out += self._close()
                    out += self._start(self._reasoning_item("", "in_progress"),
                                       {"type": "reasoning_text", "text": ""})
                self._open["text"] += ev.text
                out.append(self._event("response.reasoning_text.delta",
                                       item_id=self._open["id"], output_index=self._index,
                                       content_index=0, delta=ev.text))
            elif ev.kind == TEXT:
                if self._open is None or self._open["type"] != "message":
                    out += self._close()
                    out += self._start(self._message_item(None, status="in_progress"),
                                       _output_text(""))
                self._open["text"] += ev.text
                out.append(self._event("response.output_text.delta", item_id=self._open["id"],
                                       output_index=self._index, content_index=0,
                                       delta=ev.text, logprobs=[]))
            elif ev.kind == CALL:
                out += self._close()
                out += self._start(self._call_item(ev.index, ev.call_id, ev.name, "",
                                                   "in_progress"), None)
                self._open.update(call_id=ev.call_id, name=ev.name)
            elif ev.kind == ARGS:
                self._open["text"] += ev.text
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=self._open["id"], output_index=self._index,
                                       delta=ev.text))
        return out

    def _start(self, item: dict, part: dict | None) -> list[bytes]:
        self._index += 1
        self._open = {"type": item["type"], "id": item["id"], "text": "", "part": part}
        out = [self._event("response.output_item.added", output_index=self._index, item=item)]
        if part is not None:
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=self._index, content_index=0, part=part))
        if item["type"] == "message":
            self._message_sent = True
        return out

    def _close(self, incomplete: bool = False) -> list[bytes]:
        o, self._open = self._open, None
        if o is None:
            return []
        i, text, common = self._index, o["text"], {"item_id": o["id"]}
        if o["type"] == "function_call":
            item = self._call_item(self._index_of(o["id"]), o["call_id"], o["name"], text,
                                   "completed")
            return [self._event("response.function_call_arguments.done", **common,
                                output_index=i, name=o["name"], arguments=text),
                    self._event("response.output_item.done", output_index=i, item=item)]
        if o["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            done = self._event("response.reasoning_text.done", **common, output_index=i,
                               content_index=0, text=text)
            item = self._reasoning_item(text)
        else:
            part = _output_text(text)
            done = self._event("response.output_text.done", **common, output_index=i,
                               content_index=0, text=text, logprobs=[])
            item = self._message_item(text, incomplete)
        return [done, self._event("response.content_part.done", **common, output_index=i,
                                  content_index=0, part=part),
                self._event("response.output_item.done", output_index=i, item=item)]

    def _index_of(self, item_id: str) -> int:
        return next(k for k, v in self._call_items.items() if v == item_id)

    def closing(self, answer: AnswerStream, gen: Generation) -> list[bytes]:
        incomplete = answer.finish_reason == "length"
        out = self._close(incomplete)
        if not answer.calls and not self._message_sent:   # an empty answer is a message too
            out += self._start(self._message_item(None, status="in_progress"),
                               _output_text(""))
            out += self._close(incomplete)
        final = self._final(answer, gen)
        kind = "response.incomplete" if incomplete else "response.completed"
        return out + [self._event(kind, response=final)]

    def failed(self, e: APIError, answer: AnswerStream, gen: Generation) -> list[bytes]:
        self.final = None
        failed = self.response("failed", [], error={
            "code": "server_error" if e.status >= 500 else "invalid_prompt",
            "message": e.message})
        return [self._event("response.failed", response=failed)]


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def assistant_message(answer: AnswerStream) -> ChatMessage:
    """The turn's output as the chat message a continuation puts in its conversation."""
    calls = [{"id": c.id, "type": "function",
              "function": {"name": c.name, "arguments": c.arguments}} for c in answer.calls]
    return ChatMessage(role="assistant", content=answer.text or None, tool_calls=calls or None)


def _parse(request: web.Request, state: ServerState, body: bytes):
    """The request, its conversation and its ParsedRequest (with the model's thinking)."""
    store = state.responses_store
    req = protocol.decode(body, P.ResponsesRequest)
    previous: tuple = ()
    if req.previous_response_id is not None:
        stored = store.get(req.previous_response_id) if store is not None else None
        if stored is None:
            raise APIError(404, f"Previous response with id '{req.previous_response_id[:80]}' "
                                "not found (responses are kept only with store: true, for "
                                "server.responses_store_ttl_seconds)",
                           param="previous_response_id", code="previous_response_not_found")
        previous = stored.conversation
    if req.store and (store is None or not store.enabled):
        raise APIError(400, "store is off on this server (server.responses_store_size = 0)",
                       param="store")
    if req.reasoning is not None and req.reasoning.effort is not None and \
            state.reasoning is not None:
        enable = req.reasoning.effort != "none"
        req.chat_template_kwargs = state.reasoning.with_switch(req.chat_template_kwargs, enable)
    conversation, parsed = P.parse_decoded(req, state.limits, request.headers,
                                           state.config.scheduler.priority_classes, previous)
    return req, conversation, with_thinking(state.reasoning, parsed)


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    check_serving(state)
    req, conversation, parsed = _parse(request, state, await read_body(request, state))
    fmt = ResponsesFormatter(req, parsed.model,
                             req.reasoning.effort if req.reasoning is not None else None)

    def keep(answer: AnswerStream, gen: Generation, body: dict | None) -> None:
        if req.store and fmt.final is not None:
            state.responses_store.put(fmt.id, fmt.final,
                                      [*conversation, assistant_message(answer)])

    return await serve_turn(request, state, parsed, fmt, on_done=keep)


async def get_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{response_id}: a response kept with store: true."""
    state = request.app[STATE]
    rid = request.match_info["response_id"]
    stored = state.responses_store.get(rid) if state.responses_store is not None else None
    if stored is None:
        raise APIError(404, f"No response found with id '{rid[:80]}'", param="response_id",
                       code="response_not_found")
    return struct_response(stored.response)


async def render_response(request: web.Request) -> web.Response:
    """POST /v1/responses/render: the prompt token ids the request would run with, as the
    chat render endpoint answers them (daemon/openai/render.py)."""
    state = request.app[STATE]
    check_serving(state)
    _, _, parsed = _parse(request, state, await read_body(request, state))
    return struct_response(await render_conversation(state, parsed, "resp"))
