"""The Anthropic Messages API's request bodies (/v1/messages, /v1/messages/count_tokens),
validated into the chat conversation they are.

`parse_messages(body, limits, ...)` returns (the decoded request, a ParsedRequest) or raises
APIError naming the field (`messages[1].content[0].tool_use_id`, `tools[0].input_schema`,
`thinking.budget_tokens`; messages_api.py writes it Anthropic's way, `messages.1...`). A
Messages request is a chat completion with one choice: `system` (a string or text blocks)
becomes the system message, each message's text blocks its content, an assistant's
`tool_use` blocks its tool calls, a user's `tool_result` blocks tool messages (before its
text), `tools` (`input_schema`) and `tool_choice` ({"type": "auto" | "any" | "tool" |
"none"}) chat's, so the prompt is the one chat builds for the same conversation. Earlier
`thinking` blocks are left out of the prompt, as chat templates leave out earlier thinking.
`cache_control` on any block (or the request) is accepted: prefix caching is automatic,
whatever the breakpoints say. `output_config.format` (a JSON schema) is structured output,
as chat's response_format, for the turns that answer in text (a forced tool_choice answers
with a call). `thinking` ({"type": "enabled", "budget_tokens": N} or "disabled") turns
the chat template's thinking switch on or off where it has one; the budget is not enforced
(the thinking ends when the model ends it, within max_tokens), as vLLM serves it.

Extensions, as on the chat endpoint: min_p, repetition_penalty, seed, ignore_eos, cache_salt,
priority, prompt_cache_key, speculative, chat_template_kwargs.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from tokenloom.actors.sampling_params import GuidedDecoding
from tokenloom.daemon.errors import APIError
from tokenloom.daemon.openai import protocol
from tokenloom.daemon.openai.guided_fields import guided_decoding, unsupported_keyword
from tokenloom.daemon.openai.prompt_inputs import ChatMessage, chat_messages
from tokenloom.daemon.openai.tools import parse_tools

MIN_THINKING_BUDGET = 1024   # Anthropic's least budget_tokens


class AnthropicMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Any]


class _Conversation(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: list[AnthropicMessage]
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CountTokensRequest(_Conversation, kw_only=True):
    pass


class MessagesRequest(_Conversation, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None     # {"user_id": ...}: the fair-share tenant
    service_tier: str | None = None
    # {"format": {"type": "json_schema", "schema": ...}} (structured output); `effort` is
    # accepted and left to the model.
    output_config: dict[str, Any] | None = None
    # Extensions.
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    priority: int | str | None = None
    prompt_cache_key: str | None = None
    speculative: str | None = None


def thinking_switch(req: _Conversation) -> bool:
    """What `thinking` asks of the template's switch: on when enabled, else off (thinking
    is off unless asked for, in this API)."""
    t = req.thinking
    if t is None:
        return False
    kind = t.get("type")
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return True
    if kind != "enabled":
        raise APIError(400, f"thinking.type must be enabled, adaptive or disabled, got "
                            f"{kind!r}", param="thinking.type")
    budget = t.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
        raise APIError(400, f"thinking.budget_tokens must be an integer >= "
                            f"{MIN_THINKING_BUDGET}, got {budget!r}",
                       param="thinking.budget_tokens")
    return True


def conversation(req: _Conversation, limits: protocol.Limits):
    """(model, chat messages, tools spec, chat_template_kwargs) of a request."""
    model = protocol._check_model(req, limits)
    kwargs = protocol.check_template_kwargs(req.chat_template_kwargs)
    msgs = [ChatMessage(role="system", content=_system(req.system))] if req.system else []
    if not req.messages:
        raise APIError(400, "messages is empty", param="messages")
    for i, m in enumerate(req.messages):
        msgs.extend(_message(m, f"messages[{i}]"))
    return model, chat_messages(msgs), _tools(req), kwargs


def parse_messages(body: bytes, limits: protocol.Limits, headers=None,
                   priority_classes: dict[str, int] | None = None
                   ) -> tuple[MessagesRequest, protocol.ParsedRequest]:
    req = protocol.decode(body, MessagesRequest)
    model, messages, tools, kwargs = conversation(req, limits)
    thinking_switch(req)   # (validated here; applied by the handler, which knows the model)
    stops = req.stop_sequences
    if stops is not None and any(not s for s in stops):
        raise APIError(400, "stop_sequences must be non-empty strings", param="stop_sequences")
    guided = _output_format(req.output_config)
    if tools is not None and tools.forced:   # (a forced turn answers with a call, not text)
        guided = GuidedDecoding("json_schema", json.dumps(tools.call_schema()))
    user = (req.metadata or {}).get("user_id")
    sampling = protocol._Sampling(
        model=req.model, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        min_p=req.min_p, seed=req.seed, repetition_penalty=req.repetition_penalty,
        ignore_eos=req.ignore_eos, cache_salt=req.cache_salt, priority=req.priority,
        speculative=req.speculative, stop=stops,
        user=user if isinstance(user, str) else None, prompt_cache_key=req.prompt_cache_key)
    try:
        params = protocol._sampling_params(sampling, limits, req.max_tokens, "max_tokens", None,
                                           "logprobs", default_max_tokens=limits.max_model_len,
                                           guided=guided)
    except APIError as e:
        if e.param == "stop":
            e.param = "stop_sequences"
        raise
    meta = protocol.request_meta(sampling, headers or {}, priority_classes or {})
    parsed = protocol.ParsedRequest(
        prompts=None, messages=messages, params=params, fit_max_tokens=False,
        stream=req.stream, include_usage=False, return_metrics=False, logprobs=None,
        model=model, max_tokens_field="max_tokens",
        meta=msgspec.structs.replace(meta, lora=limits.adapter(model)), tools=tools,
        cache_salt=req.cache_salt, chat_template_kwargs=kwargs)
    return req, parsed


class _Format:
    """guided_fields.guided_decoding's view of output_config.format (chat's
    response_format)."""
    guided_regex = guided_choice = guided_grammar = None

    def __init__(self, response_format: dict):
        self.response_format = response_format


def _output_format(config: dict | None) -> GuidedDecoding | None:
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise APIError(400, "output_config.format must be {\"type\": \"json_schema\", "
                            "\"schema\": ...}", param="output_config.format.type")
    rf = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
    try:
        return guided_decoding(_Format(rf))
    except APIError as e:
        e.message = e.message.replace("response_format.json_schema", "output_config.format")
        e.param = (e.param or "").replace("response_format.json_schema",
                                          "output_config.format") or None
        raise


def _system(system) -> str:
    if isinstance(system, str):
        return system
    return "".join(_texts(system, "system", ("text",)))


def _texts(blocks: list, where: str, allowed: tuple[str, ...]) -> list[str]:
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") not in allowed:
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise APIError(400, f"{where}[{j}].type {kind!r} is not supported here "
                                f"({', '.join(allowed)})", param=f"{where}[{j}].type")
        if not isinstance(b.get("text"), str):
            raise APIError(400, f"{where}[{j}].text must be a string",
                           param=f"{where}[{j}].text")
        out.append(b["text"])
    return out


def _message(m: AnthropicMessage, where: str) -> list[ChatMessage]:
    if m.role not in ("user", "assistant"):
        raise APIError(400, f"{where}.role must be user or assistant, got {m.role!r}",
                       param=f"{where}.role")
    if isinstance(m.content, str):
        return [ChatMessage(role=m.role, content=m.content)]
    texts, calls, results = [], [], []
    for j, b in enumerate(m.content):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.extend(_texts([b], f"{where}.content", ("text",)))
        elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
            continue   # earlier thinking: chat templates leave it out of the prompt
        elif kind == "tool_use" and m.role == "assistant":
            if not isinstance(b.get("id"), str) or not b["id"]:
                raise APIError(400, f"{at}.id must be a non-empty string", param=f"{at}.id")
            if not isinstance(b.get("name"), str) or not b["name"]:
                raise APIError(400, f"{at}.name must be a non-empty string",
                               param=f"{at}.name")
            if not isinstance(b.get("input"), dict):
                raise APIError(400, f"{at}.input must be an object", param=f"{at}.input")
            calls.append({"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b["input"])}})
        elif kind == "tool_result" and m.role == "user":
            if not isinstance(b.get("tool_use_id"), str) or not b["tool_use_id"]:
                raise APIError(400, f"{at}.tool_use_id must be a non-empty string",
                               param=f"{at}.tool_use_id")
            content = b.get("content", "")
            if isinstance(content, list):
                content = "".join(_texts(content, f"{at}.content", ("text",)))
            elif not isinstance(content, str):
                raise APIError(400, f"{at}.content must be a string or text blocks",
                               param=f"{at}.content")
            results.append(ChatMessage(role="tool", tool_call_id=b["tool_use_id"],
                                       content=content))
        else:
            raise APIError(400, f"{at}.type {kind!r} is not supported in a {m.role} message",
                           param=f"{at}.type")
    out = results
    if texts or calls or not results:
        out = out + [ChatMessage(role=m.role, content="".join(texts) or None,
                                 tool_calls=calls or None)]
    return out


def _tools(req: _Conversation):
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom":
                kind = t.get("type") if isinstance(t, dict) else None
                raise APIError(400, f"tools[{i}].type {kind!r} is not supported: only client "
                                    "tools (name, description, input_schema) are",
                               param=f"tools[{i}].type")
            if "input_schema" not in t:
                raise APIError(400, f"tools[{i}].input_schema is required",
                               param=f"tools[{i}].input_schema")
            fn = {"name": t.get("name"), "parameters": t["input_schema"]}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            tools.append({"type": "function", "function": fn})
    choice, parallel = _tool_choice(req.tool_choice)
    try:
        return parse_tools(tools, choice, unsupported_keyword, parallel)
    except APIError as e:
        for old, new in ((".function.parameters", ".input_schema"), (".function.", ".")):
            e.message = e.message.replace(old, new)
            e.param = e.param.replace(old, new) if e.param else e.param
        raise


def _tool_choice(tc: dict | None) -> tuple[Any, bool | None]:
    if tc is None:
        return None, None
    kind = tc.get("type")
    parallel = False if tc.get("disable_parallel_tool_use") is True else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}, parallel
    raise APIError(400, 'tool_choice must be {"type": "auto" | "any" | "none"} or '
                        '{"type": "tool", "name": ...}', param="tool_choice")
