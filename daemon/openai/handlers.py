"""One OpenAI generation request served, whichever endpoint: the parsed request becomes a
`Generation` (one engine request per choice), refusals become the HTTP status, then the
answer is streamed (streaming.py) or returned whole (the endpoint's Formatter).

The opt-in per-request `metrics` object: send `"return_metrics": true` in the body (with the
openai client: `extra_body={"return_metrics": True}`); the JSON response, or the last SSE
chunk before `[DONE]`, then carries
`{"queue_time", "time_to_first_token", "decode_time", "e2e_time", "cached_tokens",
"num_preemptions"}` (seconds since the request arrived; see Generation.request_metrics).
"""

from __future__ import annotations

import uuid

import structlog
from aiohttp import web

from tokenloom.daemon import sse
from tokenloom.daemon.debug import record
from tokenloom.daemon.errors import APIError
from tokenloom.daemon.kv_transfer import http as kv_http
from tokenloom.daemon.openai import protocol
from tokenloom.daemon.openai.formatter import Formatter
from tokenloom.daemon.openai.generation import Generation
from tokenloom.daemon.openai.streaming import ClientTooSlow, stream
from tokenloom.daemon.state import ServerState

log = structlog.get_logger("tokenloom.http")


async def serve(request: web.Request, state: ServerState, parsed: protocol.ParsedRequest,
                formatter: type[Formatter], id_prefix: str, prompts=None, messages=None,
                tools: list[dict] | None = None) -> web.StreamResponse:
    """`prompts` (completions: parsed.prompts) or `messages` (chat, with the `tools` its
    template renders)."""
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    structlog.contextvars.bind_contextvars(request_id=request_id)
    if parsed.kv_transfer is not None:   # llm-d's prefill/decode protocol
        num_prompts = len(prompts if prompts is not None else parsed.prompts or [None])
        parsed = await kv_http.prepare(state, parsed, request_id, num_prompts)
    gen = Generation(state.engine, request_id, prompts if prompts is not None else parsed.prompts,
                     messages, parsed.params, parsed.fit_max_tokens, parsed.meta,
                     metrics=state.metrics, log=log, tools=tools,
                     prompt_only=parsed.prompt_only,
                     chat_template_kwargs=parsed.chat_template_kwargs)
    state.inflight.add(request_id, gen)  # drain waits for it; admin cancel/trace find it
    fmt = formatter(state, request_id, parsed)
    log.info("request", endpoint=formatter.object, stream=parsed.stream,
             choices=len(gen.choices), max_tokens=parsed.params.max_tokens)
    finished = False
    refused: APIError | None = None
    try:
        try:
            await gen.start()  # refusals become the HTTP status (400, 429) here
        except APIError as e:
            if e.param == "max_tokens" and parsed.max_tokens_field != "max_tokens":
                e.param = parsed.max_tokens_field
                e.message = e.message.replace("max_tokens", parsed.max_tokens_field)
            if e.param == "prompt_logprobs":   # asked for by echo + logprobs: name echo
                e.param = parsed.prompt_logprobs_field
            if e.status == 429:
                e.headers["Retry-After"] = str(state.config.server.retry_after_seconds)
            refused = e
            raise
        if parsed.stream:
            try:
                resp = await stream(request, gen, fmt, parsed)
            except ClientTooSlow as e:
                return e.response   # not finished: the cleanup below aborts its requests
        else:
            choices = await gen.run_to_end()
            body = fmt.full_response(choices, gen)
            if parsed.kv_transfer is not None:
                await kv_http.finish(state, parsed, gen, body)
            resp = web.json_response(body, headers={"X-Request-Id": request_id},
                                     dumps=_dumps)
        finished = True
        return resp
    finally:
        if parsed.kv_transfer is not None:
            kv_http.release(state, parsed, request_id)
        state.inflight.remove(request_id)
        aborted = gen.close() and not finished
        if aborted:
            state.metrics.aborted.inc()
            log.info("request aborted", reason="the client went away")
        if state.recorder is not None:   # off: this check is all it costs (daemon/debug/record.py)
            record.note_http(state.recorder, gen, parsed, formatter.endpoint,
                             await request.read(), refused or ("aborted" if aborted else None))


def _dumps(obj) -> str:
    return sse._encode(obj).decode()
