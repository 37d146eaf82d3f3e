"""The OpenAI Responses API's request body, validated into the chat conversation it is.

`parse_responses(body, limits, ...)` returns (the decoded request, its input as chat messages
without `instructions`, a ParsedRequest) or raises APIError whose `param` names the field
as this API spells it (`input[2].call_id`, `tools[0].name`, `text.format.schema`,
`max_output_tokens`). A Responses request is a chat completion with one choice: `input` (a
string, or items: messages, `function_call`, `function_call_output`; earlier `reasoning`
items are accepted and left out of the prompt, as chat templates leave out earlier
thinking) becomes chat messages, `instructions` the system message before them, function
`tools` and `tool_choice` chat's, `text.format` chat's response_format (structured output;
a turn whose tool_choice forces a call answers with the call, so its text.format waits for
a turn that answers in text), so the prompt is the one chat builds for the same
conversation.

Extensions beyond OpenAI, as in vLLM and on the chat endpoint: top_k, min_p,
repetition_penalty, presence/frequency penalties, seed, ignore_eos, min_tokens, cache_salt,
priority, speculative, chat_template_kwargs.
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

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class ReasoningOptions(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class TextOptions(msgspec.Struct, kw_only=True):
    format: dict[str, Any] | None = None     # {"type": "text" | "json_object" | "json_schema"}
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    # A string, or a list of input items (documented in openapi.py); checked by hand.
    input: str | list[Any]
    model: str | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    # Stateless by default, as vLLM: only store=true keeps the response (responses_store.py).
    store: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    truncation: str | None = None        # "disabled" (the default) | "auto"
    include: list[str] | None = None
    background: bool = False
    max_tool_calls: int | None = None
    # Extensions (vLLM's and the chat endpoint's).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    cache_salt: str | None = None
    priority: int | str | None = None
    speculative: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def parse_responses(body: bytes, limits: protocol.Limits, headers=None,
                    priority_classes: dict[str, int] | None = None,
                    previous: tuple = ()) -> tuple[ResponsesRequest, list, protocol.ParsedRequest]:
    """`previous`: the conversation of the response named by previous_response_id
    (ChatMessages), put before this input."""
    req = protocol.decode(body, ResponsesRequest)
    return req, *parse_decoded(req, limits, headers, priority_classes, previous)


def parse_decoded(req: ResponsesRequest, limits: protocol.Limits, headers=None,
                  priority_classes: dict[str, int] | None = None, previous: tuple = ()
                  ) -> tuple[list, protocol.ParsedRequest]:
    model = protocol._check_model(req, limits)
    if req.background:
        raise APIError(400, "background responses are not supported", param="background")
    if req.truncation not in (None, "disabled", "auto"):
        raise APIError(400, f"truncation must be disabled or auto, got {req.truncation!r}",
                       param="truncation")
    if req.reasoning is not None and req.reasoning.effort not in (None, *EFFORTS):
        raise APIError(400, f"reasoning.effort must be one of {', '.join(EFFORTS)}, got "
                            f"{req.reasoning.effort!r}", param="reasoning.effort")
    kwargs = protocol.check_template_kwargs(req.chat_template_kwargs)
    conversation = [*previous, *input_messages(req.input)]
    system = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    messages = chat_messages([*system, *conversation], param="input")
    tools = _tools(req)
    guided = _text_format(req)
    if tools is not None and tools.forced:
        # A forced turn answers with a call: text.format is for the turns that answer in
        # text (agents send both on every turn).
        guided = GuidedDecoding("json_schema", json.dumps(tools.call_schema()))
    sampling = protocol._Sampling(
        model=req.model, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        min_p=req.min_p, seed=req.seed, repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, cache_salt=req.cache_salt,
        priority=req.priority, speculative=req.speculative, user=req.user,
        prompt_cache_key=req.prompt_cache_key, metadata=req.metadata)
    params = protocol._sampling_params(
        sampling, limits, req.max_output_tokens, "max_output_tokens", None, "logprobs",
        default_max_tokens=limits.max_model_len, guided=guided)
    meta = protocol.request_meta(sampling, headers or {}, priority_classes or {})
    parsed = protocol.ParsedRequest(
        prompts=None, messages=messages, params=params,
        fit_max_tokens=req.max_output_tokens is None, stream=req.stream, include_usage=False,
        return_metrics=False, logprobs=None, model=model, max_tokens_field="max_output_tokens",
        meta=msgspec.structs.replace(meta, lora=limits.adapter(model)), tools=tools,
        cache_salt=req.cache_salt, chat_template_kwargs=kwargs)
    return conversation, parsed


def input_messages(items) -> list[ChatMessage]:
    """The input items as chat messages: consecutive function calls become one assistant
    message's tool calls, each function_call_output a tool message."""
    if isinstance(items, str):
        if not items:
            raise APIError(400, "input is empty", param="input")
        return [ChatMessage(role="user", content=items)]
    if not items:
        raise APIError(400, "input is empty", param="input")
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise APIError(400, f"{where}.role must be one of {', '.join(_ROLES)}, got "
                                    f"{role!r}", param=f"{where}.role")
            out.append(ChatMessage(role=role, content=_text(item.get("content"),
                                                            f"{where}.content")))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where, empty=True)}}
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_calls \
                    and not last.content:
                last.tool_calls.append(call)
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            out.append(ChatMessage(role="tool", tool_call_id=_string(item, "call_id", where),
                                   content=_text(item.get("output"), f"{where}.output")))
        elif kind == "reasoning":
            continue   # earlier thinking: chat templates leave it out of the prompt
        else:
            raise APIError(400, f"{where}.type {kind!r} is not supported (message, "
                                "function_call, function_call_output, reasoning)",
                           param=f"{where}.type")
    if not out:
        raise APIError(400, "input has no message", param="input")
    return out


def _string(item: dict, key: str, where: str, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not empty):
        raise APIError(400, f"{where}.{key} must be a {'' if empty else 'non-empty '}string",
                       param=f"{where}.{key}")
    return value


def _text(content, param: str) -> str:
    """A message's (or a call output's) content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param} must be a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"only text parts are supported, got {kind!r}",
                           param=f"{param}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _tools(req: ResponsesRequest):
    """Function tools (Responses' flat shape) and tool_choice, through chat's validation."""
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise APIError(400, f"tools[{i}].type {kind!r} is not supported: only function "
                                    "tools are", param=f"tools[{i}].type")
            fn = {k: t[k] for k in ("name", "description", "parameters")
                  if t.get(k) is not None}
            tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice must be none, auto, required or "
                                '{"type": "function", "name": ...}', param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    try:
        return parse_tools(tools, choice, unsupported_keyword, req.parallel_tool_calls)
    except APIError as e:
        raise _renamed(e, (".function.", ".")) from None


class _Format:
    """guided_fields.guided_decoding's view of text.format (as chat's response_format)."""
    guided_regex = guided_choice = guided_grammar = None

    def __init__(self, response_format: dict | None):
        self.response_format = response_format


def _text_format(req: ResponsesRequest) -> GuidedDecoding | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return None
    rf = dict(fmt)
    if fmt.get("type") == "json_schema":
        rf = {"type": "json_schema", "json_schema": {"name": fmt.get("name"),
                                                     "schema": fmt.get("schema")}}
    try:
        return guided_decoding(_Format(rf))
    except APIError as e:
        raise _renamed(e, ("response_format.json_schema", "text.format"),
                       ("response_format", "text.format")) from None


def _renamed(e: APIError, *renames: tuple[str, str]) -> APIError:
    """`e` with chat's field names turned into this API's."""
    for old, new in renames:
        e.message = e.message.replace(old, new)
        if e.param is not None:
            e.param = e.param.replace(old, new)
    return e
