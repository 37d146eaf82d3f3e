"""The OpenAI-compatible handlers: /v1/completions, /v1/chat/completions, /v1/models,
/tokenize, /detokenize. Response bodies follow OpenAI's shapes exactly, streamed and not.

The opt-in per-request `metrics` object: send `"return_metrics": true` in the body (with the
openai client: `extra_body={"return_metrics": True}`); the JSON response, or the last SSE
chunk before `[DONE]`, then carries
`{"queue_time", "time_to_first_token", "decode_time", "e2e_time", "cached_tokens",
"num_preemptions"}` (seconds since the request arrived; see Generation.request_metrics).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from functools import lru_cache

import msgspec
import structlog
from aiohttp import web

from tokenloom.daemon import sse

from tokenloom.daemon.openai import protocol

from tokenloom.daemon.openai import tools as T
from tokenloom.daemon.openai import responses as R
from tokenloom.daemon.errors import APIError
from tokenloom.daemon.openai.generation import Delta, Generation
from tokenloom.daemon.state import STATE, ServerState

log = structlog.get_logger("tokenloom.http")

JSON = "application/json"


async def read_body(request: web.Request, state: ServerState) -> bytes:
    """The raw JSON body, or APIError: 415 (not JSON), 413 (too large), 400 (not UTF-8)."""
    if request.content_type != JSON:
        raise APIError(415, f"Content-Type must be {JSON}, got "
                            f"{request.headers.get('Content-Type', '(none)')!r}")
    limit = state.config.server.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise APIError(413, f"the request body ({request.content_length} bytes) is larger than "
                            f"the limit of {limit} bytes")
    try:
        body = await asyncio.wait_for(request.read(), state.config.server.body_timeout_seconds)
    except TimeoutError:
        raise APIError(408, f"the request body was not received within "
                            f"{state.config.server.body_timeout_seconds:g} s "
                            f"(server.body_timeout_seconds)") from None
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"the request body is larger than the limit of {limit} bytes") from None
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    return body


def _check_serving(state: ServerState) -> None:
    if state.draining:
        raise APIError(503, "the server is draining; retry later or elsewhere",
                       headers={"Retry-After": str(state.config.server.retry_after_seconds)})
    if state.engine_task is not None and state.engine_task.done():
        raise APIError(503, "the engine has stopped")
    if state.engine is None or not state.ready:
        raise APIError(503, "the model is not loaded yet")


# -- completions -----------------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    _check_serving(state)
    parsed = protocol.parse_completion(await read_body(request, state), state.limits)
    return await _serve(request, state, parsed, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    _check_serving(state)
    parsed = protocol.parse_chat(await read_body(request, state), state.limits)
    return await _serve(request, state, parsed, chat=True)


async def _serve(request: web.Request, state: ServerState, parsed: protocol.ParsedRequest,
                 chat: bool) -> web.StreamResponse:
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    structlog.contextvars.bind_contextvars(request_id=request_id)
    prompts = [None] if chat else parsed.prompts
    priority = protocol.resolve_priority(parsed.priority, request.headers.get("X-Priority"),
                                         state.config.scheduler.priority_classes)
    tenant = protocol.resolve_tenant(parsed.user, request.headers.get("X-Tenant"))
    messages, template_tools = parsed.messages, None
    if parsed.tools is not None and parsed.tools.choice != "none":
        # Through the chat template when it renders tools, else described in the system
        # message (daemon/openai/tools.py).
        if T.template_renders_tools(getattr(state.engine.tokenizer, "chat_template", None)):
            template_tools = parsed.tools.template_tools()
        else:
            messages = T.fallback_messages(messages, parsed.tools)
    gen = Generation(state.engine, request_id, prompts, messages, parsed.params,
                     parsed.fit_max_tokens, metrics=state.metrics, log=log,
                     cache_salt=parsed.cache_salt, priority=priority, tenant=tenant,
                     tools=template_tools,
                     affinity=protocol.resolve_affinity(parsed.prompt_cache_key,
                                                        request.headers.get("X-Session-Id"),
                                                        tenant))
    state.inflight.add(request_id, gen)  # drain waits for it; admin cancel/trace find it
    fmt = _Formatter(state, request_id, parsed, chat)
    log.info("request", endpoint="chat" if chat else "completions", stream=parsed.stream,
             choices=len(gen.choices), max_tokens=parsed.params.max_tokens)
    finished = False
    try:
        try:
            await gen.start()  # refusals become the HTTP status (400, 429) here
        except APIError as e:
            if e.param == "max_tokens" and parsed.max_tokens_field != "max_tokens":
                e.param = parsed.max_tokens_field
                e.message = e.message.replace("max_tokens", parsed.max_tokens_field)
            if e.status == 429:
                e.headers["Retry-After"] = str(state.config.server.retry_after_seconds)
            raise
        if parsed.stream:
            try:
                resp = await _stream(request, gen, fmt, parsed)
            except ClientTooSlow as e:
                return e.response   # not finished: the cleanup below aborts its requests
        else:
            choices = await gen.run_to_end()
            body = fmt.full_response(choices, gen)
            resp = web.json_response(body, headers={"X-Request-Id": request_id},
                                     dumps=_dumps)
        finished = True
        return resp
    finally:
        state.inflight.remove(request_id)
        if gen.close() and not finished:
            state.metrics.aborted.inc()
            log.info("request aborted", reason="the client went away")


class ClientTooSlow(Exception):
    """The stream's client took no data for server.write_timeout_seconds; the connection
    has been aborted."""

    def __init__(self, response: web.StreamResponse):
        super().__init__("the client took no data within server.write_timeout_seconds")
        self.response = response


class _Writer:
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


async def _stream(request: web.Request, gen: Generation, fmt: "_Formatter",
                  parsed: protocol.ParsedRequest) -> web.StreamResponse:
    resp = await sse.open_stream(request, {"X-Request-Id": gen.request_id})
    out = _Writer(request, resp, request.app[STATE].config.server.write_timeout_seconds)
    try:
        for first in fmt.first_chunks(gen):
            await out.write(sse.frame(first))
        remaining = len(gen.choices)
        calls = _CallStream(fmt, parsed.tools) if fmt.calls_tools else None
        async for delta in gen.deltas():
            if delta.finish_reason is not None:
                remaining -= 1
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


class _CallStream:
    """Streamed chat with tools. A forced tool_choice's answer is a call by construction (an
    output constraint): its calls are streamed as generated, in OpenAI's incremental shape
    (daemon/openai/tools.py CallDeltas). With "auto" the text is held back while it may be a call
    (while it is empty or starts with "{" or "["); when it ends as a call, its calls are
    sent in the same shape, one argument fragment per generated piece, else it is sent as
    content. Either way the finish chunk says "tool_calls" for a call."""

    def __init__(self, fmt: "_Formatter", spec: T.ToolSpec):
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


def _dumps(obj) -> str:
    return sse._encode(obj).decode()


class _Formatter:
    """Builds OpenAI's response objects for one request."""

    def __init__(self, state: ServerState, request_id: str, parsed: protocol.ParsedRequest,
                 chat: bool):
        self.state = state
        self.id = request_id
        self.parsed = parsed
        self.chat = chat
        self.created = int(time.time())
        self.model = parsed.model
        self.object = "chat.completion" if chat else "text_completion"
        self._offsets: dict[int, int] = {}
        self._frame_parts: tuple[bytes, bytes, bytes] | None = None   # see chunk_frame
        self.token_text = state.token_text
        # Chat with tools the model may call: answers are parsed for a tool call.
        self.calls_tools = chat and parsed.tools is not None and parsed.tools.choice != "none"

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    # -- logprobs ------------------------------------------------------------------------
    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, index: int, lps) -> dict | None:
        if self.parsed.logprobs is None:
            return None
        if self.chat:
            content = []
            for lp in lps:
                e = self._entry(lp.token_id, lp.logprob)
                e["top_logprobs"] = [self._entry(t, v) for t, v in (lp.top or ())]
                content.append(e)
            return {"content": content, "refusal": None}
        tokens, token_logprobs, tops, offsets = [], [], [], []
        offset = self._offsets.get(index, 0)
        for lp in lps:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            token_logprobs.append(lp.logprob)
            top = {self.token_text(t): v for t, v in (lp.top or ())}
            top.setdefault(text, lp.logprob)
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    # -- whole responses -----------------------------------------------------------------
    def full_response(self, choices, gen: Generation) -> dict:
        out = self._base(self.object)
        items = []
        for c in choices:
            lps = self._logprobs(c.index, c.logprobs)
            calls, reason = None, "tool_calls"
            if self.calls_tools and c.finish_reason == "stop":
                calls = T.parse_calls(c.full_text, self.parsed.tools)
            elif self.calls_tools and self.parsed.tools.forced and c.finish_reason:
                # A forced call cut off (e.g. by max_tokens): the calls as far as they got,
                # as the streamed response sends them, with the reason it ended.
                calls, reason = T.partial_calls(c.full_text), c.finish_reason
            if calls is not None:
                message = {"role": "assistant", "content": None, "refusal": None}
                if calls:
                    message["tool_calls"] = calls
                items.append({"index": c.index, "message": message, "logprobs": lps,
                              "finish_reason": reason})
            elif self.chat:
                items.append({"index": c.index,
                              "message": {"role": "assistant", "content": c.full_text,
                                          "refusal": None},
                              "logprobs": lps, "finish_reason": c.finish_reason})
            else:
                items.append({"index": c.index, "text": c.full_text, "logprobs": lps,
                              "finish_reason": c.finish_reason})
        out["choices"] = items
        out["usage"] = gen.usage()
        if self.parsed.return_metrics:
            out["metrics"] = gen.request_metrics()
        return out

    # -- stream chunks -------------------------------------------------------------------
    def first_chunks(self, gen: Generation) -> list[dict]:
        if not self.chat:
            return []
        chunks = []
        for c in gen.results():
            chunk = self._base("chat.completion.chunk")
            chunk["choices"] = [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]
            self._usage_slot(chunk)
            chunks.append(chunk)
        return chunks

    def chunk(self, d: Delta, final_of: Generation | None) -> dict:
        lps = self._logprobs(d.index, d.logprobs) if d.logprobs else None
        if self.chat:
            chunk = self._base("chat.completion.chunk")
            delta = {"content": d.text} if d.text or d.finish_reason is None else {}
            chunk["choices"] = [{"index": d.index, "delta": delta, "logprobs": lps,
                                 "finish_reason": d.finish_reason}]
        else:
            chunk = self._base("text_completion")
            chunk["choices"] = [{"index": d.index, "text": d.text, "logprobs": lps,
                                 "finish_reason": d.finish_reason}]
        self._usage_slot(chunk)
        if final_of is not None and self.parsed.return_metrics:
            chunk["metrics"] = final_of.request_metrics()
        return chunk

    def chunk_frame(self, d: Delta, final_of: Generation | None) -> bytes:
        """`sse.frame(self.chunk(d, final_of))`, byte for byte. The common chunk (text only:
        no logprobs, no metrics) is spliced into bytes prepared once per request, without
        building and encoding its dicts: this runs once per streamed token."""
        if d.logprobs or (final_of is not None and self.parsed.return_metrics):
            return sse.frame(self.chunk(d, final_of))
        if self._frame_parts is None:
            self._frame_parts = self._frame_template()
        head, middle, tail = self._frame_parts
        enc = sse.encode
        if self.chat:
            if d.text or d.finish_reason is None:
                body = b'"delta":{"content":' + enc(d.text) + b"}"
            else:
                body = b'"delta":{}'
        else:
            body = b'"text":' + enc(d.text)
        return b"".join((head, enc(d.index), middle, body, b',"logprobs":null,"finish_reason":',
                         enc(d.finish_reason), tail))

    def _frame_template(self) -> tuple[bytes, bytes, bytes]:
        """The bytes around index, text and finish_reason in a text-only chunk's frame."""
        chunk = self._base("chat.completion.chunk" if self.chat else "text_completion")
        chunk["choices"] = [0]
        self._usage_slot(chunk)
        before, after = sse.frame(chunk).split(b'"choices":[0]')
        return before + b'"choices":[{"index":', b",", b"}]" + after

    def _usage_slot(self, chunk: dict) -> None:
        # With include_usage, OpenAI sends "usage": null on every chunk but the last.
        if self.parsed.include_usage:
            chunk["usage"] = None

    def usage_chunk(self, gen: Generation) -> dict:
        chunk = self._base("chat.completion.chunk" if self.chat else "text_completion")
        chunk["choices"] = []
        chunk["usage"] = gen.usage()
        if self.parsed.return_metrics:
            chunk["metrics"] = gen.request_metrics()
        return chunk


# -- models, tokenize, detokenize ------------------------------------------------------------
async def request_trace(request: web.Request) -> web.Response:
    """GET /v1/requests/{id}/trace: the per-request trace of a recent request, by the id
    the client saw (the response's `id` / X-Request-Id). Traces are kept for the last
    scheduler.trace_history requests; older ids get 404."""
    state = request.app[STATE]
    if state.engine is None or not state.ready and not state.draining:
        raise APIError(503, "loading")
    request_id = request.match_info["request_id"]
    trace = await state.engine.trace(request_id)
    if trace is None:
        raise APIError(404, f"no trace for request {request_id!r} (unknown, or older than the "
                            f"last {state.config.scheduler.trace_history} requests)",
                       param="request_id", code="request_not_found")
    return web.json_response(trace)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.engine
    model = R.Model(id=state.model_name, object="model", created=state.started,
                    owned_by="tokenloom", root=str(engine.info.model_dir) if engine else None,
                    parent=None, max_model_len=engine.info.max_model_len if engine else None)
    return struct_response(R.ModelList(object="list", data=[model]))


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _check_serving(state)
    req = protocol.decode(await read_body(request, state), protocol.TokenizeRequest)
    if req.model is not None and req.model not in state.limits.model_names:
        raise APIError(404, f"the model `{req.model}` does not exist", param="model",
                       code="model_not_found")
    tok = state.engine.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        messages = protocol.chat_messages(req.messages)
        try:
            ids = list(tok.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True, return_dict=False))
        except Exception as e:
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
    else:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return struct_response(R.TokenizeResponse(tokens=ids, count=len(ids),
                                              max_model_len=state.engine.info.max_model_len))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _check_serving(state)
    req = protocol.decode(await read_body(request, state), protocol.DetokenizeRequest)
    vocab = len(state.engine.tokenizer)
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                       param="tokens")
    return struct_response(R.DetokenizeResponse(prompt=state.engine.tokenizer.decode(req.tokens)))


def struct_response(body, status: int = 200) -> web.Response:
    """A JSON response from a responses.py Struct."""
    return web.Response(status=status, body=msgspec.json.encode(body),
                        content_type="application/json")


def token_text_cache(tokenizer, size: int = 65536):
    """token id -> its text (as logprobs report it), memoised."""
    @lru_cache(maxsize=size)
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id])
    return text


__all__ = ["chat_completions", "completions", "detokenize", "models", "tokenize",
           "token_text_cache"]
