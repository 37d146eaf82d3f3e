"""The OpenAI server's small endpoints and the helpers every handler shares: reading a JSON
body within its limits, refusing while not serving, /v1/models, the per-request trace,
/tokenize and /detokenize. The generation endpoints are completions.py and chat.py.
"""

from __future__ import annotations

import asyncio
from functools import lru_cache

import msgspec
from aiohttp import web

from tokenloom.daemon.errors import APIError
from tokenloom.daemon.openai import protocol
from tokenloom.daemon.openai import responses as R
from tokenloom.daemon.openai.prompt_inputs import chat_messages
from tokenloom.daemon.state import STATE, ServerState

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


def check_serving(state: ServerState) -> None:
    if state.draining:
        raise APIError(503, "the server is draining; retry later or elsewhere",
                       headers={"Retry-After": str(state.config.server.retry_after_seconds)})
    if state.engine_task is not None and state.engine_task.done():
        raise APIError(503, "the engine has stopped")
    if state.engine is None or not state.ready:
        raise APIError(503, "the model is not loaded yet")


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
    # LoRA adapters, each with the base model as its parent (as vLLM lists them).
    adapters = [R.Model(id=name, object="model", created=state.started, owned_by="tokenloom",
                        root=path, parent=state.model_name, max_model_len=model.max_model_len)
                for name, path in sorted((getattr(engine, "lora_adapters", None) or {}).items())]
    return struct_response(R.ModelList(object="list", data=[model, *adapters]))


async def load_lora_adapter(request: web.Request) -> web.Response:
    """POST /v1/load_lora_adapter {"lora_name", "lora_path"} (vLLM's runtime LoRA update;
    registered only with lora.allow_runtime_updates). The adapter is checked against the
    base model before any request may name it; a bad one is a 400 naming it."""
    from tokenloom.config.schema import valid_adapter_name
    from tokenloom.kernels.lora.peft_adapter import LoRAAdapterError

    state = request.app[STATE]
    check_serving(state)
    req = protocol.decode(await read_body(request, state), protocol.LoadLoRAAdapterRequest)
    name = req.lora_name
    if not valid_adapter_name(name):
        raise APIError(400, f"lora_name {name[:140]!r} must be 1-128 letters, digits, '.', '_', "
                            "'-' or '/'", param="lora_name")
    if name in state.limits.model_names:
        raise APIError(400, f"lora_name {name!r} is the base model's name", param="lora_name")
    engine = state.engine
    if engine.lora_adapters is None:
        raise APIError(400, "LoRA serving is off: set lora.enable = true", param="lora_name")
    if name in engine.lora_adapters:
        raise APIError(400, f"The lora adapter '{name}' has already been loaded.",
                       param="lora_name", code="lora_adapter_exists")
    try:
        await engine.load_lora_adapter(name, req.lora_path)
    except LoRAAdapterError as e:
        raise APIError(400, str(e), param="lora_path", code="invalid_lora_adapter") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """POST /v1/unload_lora_adapter {"lora_name"}: new requests may no longer name it;
    running ones finish with it, waiting ones fail."""
    state = request.app[STATE]
    check_serving(state)
    req = protocol.decode(await read_body(request, state), protocol.UnloadLoRAAdapterRequest)
    if not await state.engine.unload_lora_adapter(req.lora_name):
        raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.",
                       param="lora_name", code="lora_adapter_not_found")
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    check_serving(state)
    req = protocol.decode(await read_body(request, state), protocol.TokenizeRequest)
    if req.model is not None and not state.limits.accepts(req.model):
        raise APIError(404, f"the model `{req.model}` does not exist", param="model",
                       code="model_not_found")
    tok = state.engine.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        messages = chat_messages(req.messages)
        kwargs = protocol.check_template_kwargs(req.chat_template_kwargs) or {}
        try:
            ids = list(tok.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True, return_dict=False, **kwargs))
        except Exception as e:
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
    else:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return struct_response(R.TokenizeResponse(tokens=ids, count=len(ids),
                                              max_model_len=state.engine.info.max_model_len))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    check_serving(state)
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
