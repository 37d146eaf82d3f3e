"""The OpenAPI 3.1 document, served at /openapi.json: generated, never hand-written.

Request bodies are the very msgspec Structs the handlers decode (`protocol`), responses the
Structs of `responses`; `msgspec.json.schema_components` turns them into JSON Schema. The
bounds that come from configuration (`n` up to server.max_n, `max_tokens` up to
server.max_tokens or the context window, logprobs up to server.max_logprobs, the served
model names) are written into the document from the running server's limits, so a client
or a fuzzer reads the bounds this server enforces.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokenloom.daemon.openai import embeddings as E
from tokenloom.daemon.openai import messages_api as MA
from tokenloom.daemon.openai import messages_protocol as M
from tokenloom.daemon.openai import protocol as Q
from tokenloom.daemon.openai import responses as R
from tokenloom.daemon.openai import responses_protocol as RP

REF = "#/components/schemas/{name}"
JSON = "application/json"


def _ref(t: type) -> dict:
    return {"$ref": REF.format(name=t.__name__)}


def _error(description: str) -> dict:
    return {"description": description, "content": {JSON: {"schema": _ref(R.ErrorResponse)}}}


# Statuses every POST endpoint may answer with besides 200 (see docs/http-api.md, "Errors").
_POST_ERRORS = {
    "400": "malformed JSON, wrong types, values out of range, prompt too long, invalid UTF-8",
    "404": "unknown model", "408": "the body was not received within the read timeout",
    "413": "body over server.max_body_bytes", "415": "Content-Type is not application/json",
    "429": "the waiting queue is full (Retry-After)",
    "503": "draining, loading, or the engine has stopped (Retry-After when draining)",
}


def _post(summary: str, body: type, ok: dict, error: type = R.ErrorResponse) -> dict:
    """`error`: the error body's type (the Messages API answers in Anthropic's shape)."""
    def err(why: str) -> dict:
        return {"description": why, "content": {JSON: {"schema": _ref(error)}}}
    return {"post": {"summary": summary,
                     "requestBody": {"required": True,
                                     "content": {JSON: {"schema": _ref(body)}}},
                     "responses": {"200": ok, **{code: err(why) for code, why
                                                 in _POST_ERRORS.items()}}}}


def _events(response: type) -> dict:
    """A response, or with `stream: true` its API's named SSE events."""
    return {"description": "the response (JSON), or with `stream: true` SSE events "
                           "(`event: <type>` and `data: <event object>`)",
            "content": {JSON: {"schema": _ref(response)},
                        "text/event-stream": {"schema": {
                            "type": "object", "required": ["data"],
                            "properties": {"data": {"type": "string", "minLength": 1}}}}}}


# Hand-written where the Structs decode `list[Any]` and the handler checks items by hand.
_TEXT_PARTS = {"type": "array", "items": {
    "type": "object", "required": ["type", "text"],
    "properties": {"type": {"enum": ["input_text", "output_text", "text"]},
                   "text": {"type": "string"}}}}
_RESPONSE_INPUT = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "type": {"const": "message"},
            "role": {"enum": ["user", "assistant", "system", "developer"]},
            "content": {"anyOf": [{"type": "string"}, _TEXT_PARTS]}}},
        {"type": "object", "required": ["type", "call_id", "name", "arguments"],
         "properties": {"type": {"const": "function_call"},
                        "call_id": {"type": "string", "minLength": 1},
                        "name": {"type": "string", "minLength": 1},
                        "arguments": {"type": "string"}}},
        {"type": "object", "required": ["type", "call_id", "output"],
         "properties": {"type": {"const": "function_call_output"},
                        "call_id": {"type": "string", "minLength": 1},
                        "output": {"anyOf": [{"type": "string"}, _TEXT_PARTS]}}},
        {"type": "object", "required": ["type"],
         "properties": {"type": {"const": "reasoning"}}}]}}]}
_FUNCTION_TOOL = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"const": "function"}, "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
    "description": {"type": "string"}, "parameters": {"type": "object"},
    "strict": {"type": "boolean"}}}
_BLOCKS = {"type": "array", "items": {"anyOf": [
    {"type": "object", "required": ["type", "text"],
     "properties": {"type": {"const": "text"}, "text": {"type": "string"},
                    "cache_control": {"type": "object"}}},
    {"type": "object", "required": ["type", "id", "name", "input"],
     "properties": {"type": {"const": "tool_use"}, "id": {"type": "string", "minLength": 1},
                    "name": {"type": "string", "minLength": 1}, "input": {"type": "object"}}},
    {"type": "object", "required": ["type", "tool_use_id"],
     "properties": {"type": {"const": "tool_result"},
                    "tool_use_id": {"type": "string", "minLength": 1},
                    "content": {"type": "string"}, "is_error": {"type": "boolean"}}},
    {"type": "object", "required": ["type", "thinking"],
     "properties": {"type": {"const": "thinking"}, "thinking": {"type": "string"},
                    "signature": {"type": "string"}}}]}}
_ANTHROPIC_TOOL = {"type": "object", "required": ["name", "input_schema"], "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
    "description": {"type": "string"}, "input_schema": {"type": "object"},
    "cache_control": {"type": "object"}}}


def _get(summary: str, ok: dict, errors: dict[str, str] | None = None,
         parameters: list | None = None) -> dict:
    op: dict[str, Any] = {"summary": summary,
                          "responses": {"200": ok, **{c: _error(w)
                                                      for c, w in (errors or {}).items()}}}
    if parameters:
        op["parameters"] = parameters
    return {"get": op}


def _generation(response: type) -> dict:
    return {"description": "the completion (JSON), or with `stream: true` SSE frames "
                           "`data: <chunk>` ending with `data: [DONE]`",
            "content": {JSON: {"schema": _ref(response)},
                        # OpenAPI 3.1: `schema` describes one event; its data is a chunk
                        # (JSON) or the final "[DONE]".
                        "text/event-stream": {"schema": {
                            "type": "object", "required": ["data"],
                            "properties": {"data": {"type": "string", "minLength": 1}}}}}}


def _set_bounds(prop: dict, **bounds) -> None:
    """Bounds on a property, or on the non-null branch of an optional one."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") in ("integer", "number"):
            branch.update(bounds)


def _apply_limits(components: dict, limits: Q.Limits | None, max_tokens: int | None,
                  max_logprobs: int) -> None:
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = components[name]["properties"]
        _set_bounds(props["n"], minimum=1, **({"maximum": limits.max_n} if limits else {}))
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                _set_bounds(props[field], minimum=1,
                            **({"maximum": max_tokens} if max_tokens else {}))
        _set_bounds(props["temperature"], minimum=0)
        _set_bounds(props["top_p"], exclusiveMinimum=0, maximum=1)
        _set_bounds(props["priority"], minimum=-(2**31), maximum=2**31 - 1)
        if limits is not None and limits.lora_adapters is None:
            props["model"] = {"type": "string", "enum": sorted(limits.model_names)}
        elif limits is not None:   # LoRA adapters come and go at run time: names, not an enum
            props["model"] = {"type": "string", "description": "the base model ("
                              + ", ".join(sorted(limits.model_names))
                              + ") or a LoRA adapter listed by /v1/models"}
    # `prompt` is decoded as `str | list[Any]` (msgspec unions allow one array type) and
    # checked by hand (prompt_inputs.completion_prompts); the document states what is accepted.
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    components["CompletionRequest"]["properties"]["prompt"] = {"anyOf": [
        {"type": "string", "minLength": 1}, ids,
        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "items": ids}]}
    for field in ("logprobs", "prompt_logprobs"):
        _set_bounds(components["CompletionRequest"]["properties"][field], minimum=0,
                    maximum=max_logprobs)
    _set_bounds(components["ChatCompletionRequest"]["properties"]["top_logprobs"], minimum=0,
                maximum=max_logprobs)
    _set_bounds(components["DetokenizeRequest"]["properties"]["tokens"].get("items", {}),
                minimum=0)
    models = (({"type": "string", "enum": sorted(limits.model_names)}
               if limits.lora_adapters is None else {"type": "string"})
              if limits is not None else None)
    cap = {"maximum": max_tokens} if max_tokens else {}
    for name, field in (("ResponsesRequest", "max_output_tokens"),
                        ("MessagesRequest", "max_tokens")):
        props = components[name]["properties"]
        _set_bounds(props[field], minimum=1, **cap)
        _set_bounds(props["temperature"], minimum=0)
        _set_bounds(props["top_p"], exclusiveMinimum=0, maximum=1)
        _set_bounds(props["priority"], minimum=-(2**31), maximum=2**31 - 1)
    for name in ("ResponsesRequest", "MessagesRequest", "CountTokensRequest",
                 "EmbeddingRequest"):
        if models is not None and name in components:
            components[name]["properties"]["model"] = models
    responses = components["ResponsesRequest"]["properties"]
    responses["input"] = _RESPONSE_INPUT
    responses["tools"] = {"anyOf": [{"type": "array", "items": _FUNCTION_TOOL},
                                    {"type": "null"}]}
    responses["tool_choice"] = {"anyOf": [
        {"enum": ["none", "auto", "required"]}, {"type": "null"},
        {"type": "object", "required": ["type", "name"],
         "properties": {"type": {"const": "function"}, "name": {"type": "string"}}}]}
    responses["reasoning"] = {"anyOf": [{"type": "object", "properties": {"effort": {
        "anyOf": [{"enum": list(RP.EFFORTS)}, {"type": "null"}]}}}, {"type": "null"}]}
    for name in ("MessagesRequest", "CountTokensRequest"):
        props = components[name]["properties"]
        props["system"] = {"anyOf": [{"type": "string"}, {"type": "null"}, _BLOCKS]}
        props["tools"] = {"anyOf": [{"type": "array", "items": _ANTHROPIC_TOOL},
                                    {"type": "null"}]}
        props["tool_choice"] = {"anyOf": [{"type": "null"}, {
            "type": "object", "required": ["type"], "properties": {
                "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
                "disable_parallel_tool_use": {"type": "boolean"}}}]}
        props["thinking"] = {"anyOf": [{"type": "null"}, {
            "type": "object", "required": ["type"], "properties": {
                "type": {"enum": ["enabled", "disabled"]},
                "budget_tokens": {"type": "integer", "minimum": M.MIN_THINKING_BUDGET}}}]}
    components["AnthropicMessage"]["properties"]["role"] = {"enum": ["user", "assistant"]}
    components["AnthropicMessage"]["properties"]["content"] = {"anyOf": [
        {"type": "string"}, _BLOCKS]}
    if "EmbeddingRequest" in components:
        ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
        emb = components["EmbeddingRequest"]["properties"]
        emb["input"] = {"anyOf": [
            {"type": "string", "minLength": 1}, ids,
            {"type": "array", "minItems": 1, "maxItems": E.MAX_INPUTS,
             "items": {"type": "string", "minLength": 1}},
            {"type": "array", "minItems": 1, "maxItems": E.MAX_INPUTS, "items": ids}]}
        emb["encoding_format"] = {"enum": ["float", "base64"]}
        _set_bounds(emb["dimensions"], minimum=1)


def document(limits: Q.Limits | None = None, max_tokens: int | None = None,
             max_logprobs: int = 20, title: str = "tokenloom",
             lora_updates: bool = False, embeddings: bool = False) -> dict:
    """The OpenAPI 3.1 document. `limits`: the running server's (None: no server bounds);
    `max_tokens`: the most tokens one choice may ask for (None: unbounded here);
    `lora_updates`: the runtime LoRA endpoints are served (lora.allow_runtime_updates);
    `embeddings`: /v1/embeddings is served (server.embeddings)."""
    types = [Q.CompletionRequest, Q.ChatCompletionRequest, Q.TokenizeRequest,
             Q.DetokenizeRequest, R.CompletionResponse, R.ChatCompletionResponse, R.ModelList,
             R.TokenizeResponse, R.DetokenizeResponse, R.ReadyResponse, R.ErrorResponse,
             R.RenderedPrompt, Q.LoadLoRAAdapterRequest, Q.UnloadLoRAAdapterRequest,
             RP.ResponsesRequest, R.ResponseObject, M.MessagesRequest, M.CountTokensRequest,
             R.MessageObject, MA.AnthropicError, MA.CountTokensResponse]
    if embeddings:
        types += [E.EmbeddingRequest, E.EmbeddingResponse]
    _, components = msgspec.json.schema_components(types, ref_template=REF)
    _apply_limits(components, limits, max_tokens, max_logprobs)
    json_ok = lambda t: {"description": "OK", "content": {JSON: {"schema": _ref(t)}}}  # noqa
    paths = {
        "/v1/completions": _post("Create a completion (OpenAI-compatible)",
                                 Q.CompletionRequest, _generation(R.CompletionResponse)),
        "/v1/chat/completions": _post("Create a chat completion (OpenAI-compatible)",
                                      Q.ChatCompletionRequest,
                                      _generation(R.ChatCompletionResponse)),
        "/v1/completions/render": _post(
            "The prompts' token ids, without generating (vLLM's render endpoint)",
            Q.CompletionRequest, {"description": "one rendered prompt per prompt", "content": {
                JSON: {"schema": {"type": "array", "items": _ref(R.RenderedPrompt)}}}}),
        "/v1/chat/completions/render": _post(
            "The conversation's prompt token ids, without generating (vLLM's render "
            "endpoint)", Q.ChatCompletionRequest, json_ok(R.RenderedPrompt)),
        "/v1/responses": _post("Create a response (OpenAI Responses API)",
                               RP.ResponsesRequest, _events(R.ResponseObject)),
        "/v1/responses/{response_id}": _get(
            "A response kept with store: true", json_ok(R.ResponseObject),
            {"404": "no such response (never stored, or expired)"},
            [{"name": "response_id", "in": "path", "required": True,
              "schema": {"type": "string"}}]),
        "/v1/responses/render": _post(
            "The response's prompt token ids, without generating", RP.ResponsesRequest,
            json_ok(R.RenderedPrompt)),
        "/v1/messages": _post("Create a message (Anthropic Messages API)", M.MessagesRequest,
                              _events(R.MessageObject), error=MA.AnthropicError),
        "/v1/messages/count_tokens": _post(
            "Count a conversation's input tokens (Anthropic Messages API)",
            M.CountTokensRequest, json_ok(MA.CountTokensResponse), error=MA.AnthropicError),
        "/v1/messages/render": _post(
            "The message's prompt token ids, without generating", M.MessagesRequest,
            json_ok(R.RenderedPrompt), error=MA.AnthropicError),
        "/v1/models": _get("The served model", json_ok(R.ModelList)),
        "/v1/requests/{request_id}/trace": _get(
            "The per-request trace of a recent request",
            {"description": "the trace", "content": {JSON: {"schema": {"type": "object"}}}},
            {"404": "no such request in the trace history", "503": "loading"},
            [{"name": "request_id", "in": "path", "required": True,
              "schema": {"type": "string"}}]),
        "/tokenize": _post("Tokenize a prompt or a conversation", Q.TokenizeRequest,
                           json_ok(R.TokenizeResponse)),
        "/detokenize": _post("Token ids to text", Q.DetokenizeRequest,
                             json_ok(R.DetokenizeResponse)),
        "/health": _get("Liveness", {"description": "the engine makes progress"},
                        {"503": "the engine has stopped or made no step for "
                                "server.health_stall_seconds with work queued"}),
        "/ready": _get("Readiness", json_ok(R.ReadyResponse),
                       {"503": "loading or draining"}),
        "/metrics": _get("Prometheus metrics", {"description": "text format", "content": {
            "text/plain": {"schema": {"type": "string"}}}}),
        "/openapi.json": _get("This document", {"description": "OpenAPI 3.1", "content": {
            JSON: {"schema": {"type": "object"}}}}),
    }
    if embeddings:
        paths["/v1/embeddings"] = _post("Create embeddings (OpenAI-compatible)",
                                        E.EmbeddingRequest, json_ok(E.EmbeddingResponse))
    if lora_updates:
        text_ok = {"description": "done", "content": {"text/plain": {"schema": {
            "type": "string"}}}}
        paths["/v1/load_lora_adapter"] = _post(
            "Serve a PEFT LoRA adapter under a name (vLLM's runtime LoRA update)",
            Q.LoadLoRAAdapterRequest, text_ok)
        paths["/v1/unload_lora_adapter"] = _post(
            "Stop serving a LoRA adapter", Q.UnloadLoRAAdapterRequest, text_ok)
    for path, item in paths.items():
        for op in item.values():
            op["responses"].setdefault("405", {"description": "the wrong method", "content": {
                JSON: {"schema": _ref(MA.AnthropicError if path.startswith("/v1/messages")
                                      else R.ErrorResponse)}}})
    return {"openapi": "3.1.0",
            "info": {"title": title, "version": "0.1.0",
                     "description": "OpenAI-compatible LLM serving (tokenloom)"},
            "paths": paths, "components": {"schemas": components}}
