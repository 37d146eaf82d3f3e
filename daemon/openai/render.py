"""POST /v1/completions/render and /v1/chat/completions/render: a request's prompt token
ids, without generating, as vLLM's render endpoints answer them.

llm-d's precise prefix scorer (the endpoint picker's `token-producer` with its `vllm`
backend) posts the client's body here, hashes `token_ids` into block keys and looks them
up in the index it builds from the pods' KV events. So the ids must be exactly those the
engine caches for the same body: the body is parsed by the generation endpoints' own
parsers and tokenized by the tokenizer actor's own pure functions (actors/front/prompts.py),
chat tools included (chat.template_inputs).

Shapes (vLLM's GenerateRequest, responses.RenderedPrompt): chat answers one object,
completions an array with one object per prompt. Errors are the generation endpoints'
(400 naming the field, 404 for an unknown model, ...). Nothing is admitted or cached.
"""

from __future__ import annotations

import asyncio
import uuid

import msgspec
from aiohttp import web

from tokenloom.actors.front.fan_out import fan_out
from tokenloom.actors.front.prompts import PromptError, encode_prompt, fit_prompt
from tokenloom.actors.front.tokenizer_actor import TokenizerActor
from tokenloom.actors.messages import GenerateRequest
from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.daemon.errors import APIError
from tokenloom.daemon.openai import protocol
from tokenloom.daemon.openai import responses as R
from tokenloom.daemon.openai.chat import template_inputs
from tokenloom.daemon.openai.endpoints import check_serving, read_body, struct_response
from tokenloom.daemon.state import STATE, ServerState

# SamplingParams fields under the names vLLM's SamplingParams gives them.
_VLLM_PARAMS = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                "ignore_eos", "max_tokens", "min_tokens", "logprobs")


async def render_completion(request: web.Request) -> web.Response:
    state = request.app[STATE]
    check_serving(state)
    parsed = protocol.parse_completion(await read_body(request, state), state.limits,
                                       request.headers, state.config.scheduler.priority_classes)
    reqs = fan_out("render", parsed.prompts, _one(parsed.params), meta=parsed.meta,
                   fit_max_tokens=parsed.fit_max_tokens)
    out = []
    for req in reqs:
        out.append(await _render(state, req, parsed, "cmpl"))
    return struct_response(out)


async def render_chat(request: web.Request) -> web.Response:
    state = request.app[STATE]
    check_serving(state)
    parsed = protocol.parse_chat(await read_body(request, state), state.limits,
                                 request.headers, state.config.scheduler.priority_classes)
    return struct_response(await render_conversation(state, parsed, "chatcmpl"))


async def render_conversation(state: ServerState, parsed: protocol.ParsedRequest,
                              id_prefix: str) -> R.RenderedPrompt:
    """A chat-shaped request's prompt (chat, and the Responses and Messages APIs, which
    become the same conversation)."""
    messages, tools = template_inputs(state, parsed)
    [req] = fan_out("render", [None], _one(parsed.params), meta=parsed.meta,
                    messages=messages, tools=tools, fit_max_tokens=parsed.fit_max_tokens,
                    chat_template_kwargs=parsed.chat_template_kwargs)
    return await _render(state, req, parsed, id_prefix)


def _one(params: SamplingParams) -> SamplingParams:
    # One rendered prompt per prompt, whatever n (the ids are the same for every choice).
    return msgspec.structs.replace(params, n=1)


async def _render(state: ServerState, req: GenerateRequest, parsed: protocol.ParsedRequest,
                  id_prefix: str) -> R.RenderedPrompt:
    tokenizer, max_model_len = state.engine.tokenizer, state.engine.info.max_model_len

    def work():
        ids = encode_prompt(tokenizer, req)
        return ids, fit_prompt(req, ids, max_model_len)

    try:
        # Long prompts and chat templates off the loop, as the tokenizer actor does.
        ids, params = work() if TokenizerActor.is_cheap(req) else await asyncio.to_thread(work)
    except Exception as e:   # as the tokenizer actor: whatever the tokenizer refuses is a 400
        param = e.param if isinstance(e, PromptError) else None
        raise APIError(400, str(e), param=_param(param, parsed)) from None
    sampling = {f: getattr(params, f) for f in _VLLM_PARAMS}
    sampling["n"] = parsed.params.n
    sampling["stop"], sampling["stop_token_ids"] = list(params.stop), list(params.stop_token_ids)
    options = None
    if parsed.stream and parsed.include_usage:
        options = R.StreamOptionsEcho(include_usage=parsed.include_usage,
                                      continuous_usage_stats=parsed.continuous_usage)
    return R.RenderedPrompt(
        request_id=f"{id_prefix}-{uuid.uuid4().hex}", token_ids=ids, sampling_params=sampling,
        model=parsed.model, stream=parsed.stream, stream_options=options,
        cache_salt=parsed.cache_salt, priority=parsed.meta.priority)


def _param(param: str | None, parsed: protocol.ParsedRequest) -> str | None:
    return parsed.max_tokens_field if param == "max_tokens" else param
