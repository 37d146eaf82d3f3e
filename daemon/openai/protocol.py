"""OpenAI request bodies as msgspec Structs, validated into engine requests.

Contract: `parse_completion(body, limits)` / `parse_chat(body, limits)` either return a
`ParsedRequest` (prompts + SamplingParams + options) or raise `APIError` whose `param` names
the field at fault, in the body's own spelling (`max_completion_tokens`, `messages[1].role`).
Decoding (JSON syntax, types, required fields) is msgspec's; ranges and cross-field rules are
checked here and by `SamplingParams`. Unknown fields are ignored, as vLLM does.

Extensions beyond OpenAI, as in vLLM: top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, cache_salt, priority, guided_regex, guided_choice,
guided_grammar (structured output, like `response_format`), and tokenloom's `return_metrics`
and `speculative` ("auto" | "on" | "off": this request's speculative decoding).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

import msgspec

from tokenloom.actors.messages import RequestMeta
from tokenloom.actors.sampling_params import MAX_LOGPROBS, GuidedDecoding, SamplingParams
from tokenloom.daemon.errors import APIError
from tokenloom.daemon.openai.guided_fields import guided_decoding, unsupported_keyword
from tokenloom.daemon.openai.prompt_inputs import (
    ChatMessage,
    chat_messages,
    completion_prompts,
)
from tokenloom.daemon.openai.tools import ToolSpec, parse_tools


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints."""
    model: str | None = None    # None: the served model (one model is served, as in vLLM)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's prompt-caching hint: requests with the same key share a prefix. With worker
    # processes it is the routing affinity key (docs/workers-and-routing.md).
    prompt_cache_key: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    cache_salt: str | None = None
    # OpenAI's `metadata`: up to 16 string pairs the client labels the request with (kept in
    # its trace: RequestMeta.labels).
    metadata: dict[str, str] | None = None
    priority: int | str | None = None   # a number (lower runs first) or a class name
    return_metrics: bool = False
    speculative: str | None = None      # "auto" | "on" | "off" (speculative decoding)
    # Structured output (vLLM's names): the output matches a regex, is one of the strings,
    # or follows an EBNF grammar (xgrammar's dialect, root rule `root`).
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema"}
    # llm-d's prefill/decode protocol (vLLM's field): {"do_remote_decode": true} asks this
    # daemon to prefill and keep the KV for a decode daemon; {"do_remote_prefill": true,
    # "remote_block_ids", "remote_host", "remote_port", ...} pulls it (docs/disaggregation.md).
    kv_transfer_params: dict | None = None


class CompletionRequest(_Sampling, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]; msgspec unions allow one array type,
    # so the list is checked by hand (see `prompt_inputs.completion_prompts`).
    prompt: str | list[Any]
    logprobs: int | None = None
    # echo: the prompt before each choice's text (and, with logprobs, its tokens' logprobs
    # before the choice's); prompt_logprobs (vLLM's extra): each choice's `prompt_logprobs`.
    echo: bool = False
    prompt_logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None   # false: at most one call per answer
    # vLLM's: extra variables for the chat template, e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None   # vLLM's body may carry it; names are what count here


@dataclasses.dataclass(frozen=True)
class Limits:
    max_n: int
    served_name: str
    model_names: frozenset[str]             # the served name and the aliases accepted
    max_model_len: int
    max_tokens: int = 0                     # server.max_tokens: most per choice (0: no cap)
    max_logprobs: int = MAX_LOGPROBS        # server.max_logprobs
    # LoRA adapters a request may name in `model` (the engine's live name -> directory
    # map: adapters come and go at run time); None: [lora] is off.
    lora_adapters: Mapping[str, str] | None = None
    # Whether the server has a proposer (speculative.method is not "off"): without one a
    # request's `speculative: "on"` is refused rather than silently not speculating.
    speculation: bool = True

    def adapter(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names, or None (the base model)."""
        if model is None or model in self.model_names or not self.lora_adapters:
            return None
        return model if model in self.lora_adapters else None

    def accepts(self, model: str) -> bool:
        return model in self.model_names or model in (self.lora_adapters or ())


@dataclasses.dataclass
class ParsedRequest:
    prompts: list[str | list[int]] | None       # completions: one entry per prompt
    messages: list[dict] | None                 # chat: the conversation
    params: SamplingParams
    fit_max_tokens: bool                        # max_tokens unset: fill the context window
    stream: bool
    include_usage: bool
    return_metrics: bool
    logprobs: int | None                        # None: no logprobs in the response
    model: str
    max_tokens_field: str = "max_tokens"        # how the body spelled it (for error params)
    # Salt, priority, tenant and routing affinity, from the body and headers (request_meta).
    meta: RequestMeta = RequestMeta()
    tools: ToolSpec | None = None               # chat: tools and tool_choice (tools.py)
    # stream_options.continuous_usage_stats (with include_usage): every chunk carries its
    # choice's usage so far, as vLLM streams it.
    continuous_usage: bool = False
    cache_salt: str | None = None               # as the body gave it (the render endpoints)
    # Completions' prompt echo and prompt logprobs (see _prompt_options).
    echo: bool = False
    prompt_logprobs: int | None = None          # the body's prompt_logprobs (vLLM's field)
    prompt_only: bool = False                   # max_tokens 0: no generated text or tokens
    prompt_logprobs_field: str = "prompt_logprobs"   # the field a refusal names
    kv_transfer: dict | None = None             # the body's kv_transfer_params
    chat_template_kwargs: dict | None = None    # chat: extra chat template variables
    # chat: the model's thinking and how this prompt leaves it (daemon/openai/reasoning.py);
    # None: answers are not split.
    thinking: Any = None


# -- decoding ----------------------------------------------------------------------------
_PATH = re.compile(r" - at `\$\.?(.*)`$")


def decode(body: bytes, kind: type[msgspec.Struct]):
    """JSON bytes -> `kind`, or APIError naming the field (msgspec's path, `$.` removed)."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _PATH.search(msg)
        param = m.group(1) if m else None
        missing = re.match(r"Object missing required field `(\w+)`", msg)
        if missing:
            field = missing.group(1)
            param = f"{param}.{field}" if param else field
        where = f" (field `{param}`)" if param and not missing else ""
        raise APIError(400, _PATH.sub("", msg) + where, param=param) from None
    except msgspec.DecodeError as e:
        if isinstance(e.__cause__, UnicodeDecodeError) or "UTF-8" in str(e):
            raise APIError(400, f"the request body is not valid UTF-8: {e}") from None
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


# -- validation --------------------------------------------------------------------------
def _check_model(req, limits: Limits) -> str:
    """The model the request names; absent, the served one (vLLM and llama.cpp accept its
    omission when one model is served)."""
    if req.model is None:
        return limits.served_name
    if not limits.accepts(req.model):
        adapters = sorted(limits.lora_adapters or ())
        raise APIError(404, f"the model `{req.model}` does not exist (served: "
                            f"{limits.served_name}"
                            + (f"; LoRA adapters: {', '.join(adapters)}" if adapters else "")
                            + ")",
                       param="model", code="model_not_found")
    return req.model


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if any(not s for s in stops):
        raise APIError(400, "stop strings must be non-empty", param="stop")
    return tuple(stops)


def _sampling_params(req: _Sampling, limits: Limits, max_tokens: int | None,
                     max_tokens_field: str, logprobs: int | None, logprobs_field: str,
                     default_max_tokens: int, guided: GuidedDecoding | None = None
                     ) -> SamplingParams:
    def need(ok: bool, param: str, message: str) -> None:
        if not ok:
            raise APIError(400, f"{param} {message}", param=param)

    if max_tokens is not None:
        need(max_tokens >= 1, max_tokens_field, f"must be at least 1, got {max_tokens}")
        need(not limits.max_tokens or max_tokens <= limits.max_tokens, max_tokens_field,
             f"must be at most {limits.max_tokens} (server.max_tokens), got {max_tokens}")
    elif limits.max_tokens:
        default_max_tokens = min(default_max_tokens, limits.max_tokens)
    if req.temperature is not None:
        need(req.temperature >= 0, "temperature", f"must be >= 0, got {req.temperature}")
    if req.top_p is not None:
        need(0 < req.top_p <= 1, "top_p", f"must be in (0, 1], got {req.top_p}")
    need(1 <= req.n <= limits.max_n, "n", f"must be in [1, {limits.max_n}], got {req.n}")
    if logprobs is not None:
        need(0 <= logprobs <= limits.max_logprobs, logprobs_field,
             f"must be in [0, {limits.max_logprobs}], got {logprobs}")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if req.cache_salt is not None:
        need(bool(req.cache_salt), "cache_salt", "must be a non-empty string")
    if isinstance(req.priority, int):
        need(-(2**31) <= req.priority < 2**31, "priority", "must be a 32-bit integer")
    fields = dict(n=req.n, max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
                  min_tokens=req.min_tokens, seed=req.seed, stop=_stops(req.stop),
                  stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                  logprobs=logprobs, guided=guided)
    if req.speculative == "on" and not limits.speculation:
        raise APIError(400, 'speculative is "on" but this server has no proposer '
                       '(speculative.method = "off"); start it with --set '
                       'speculative.method=ngram (prompt lookup) or method=draft',
                       param="speculative")
    if guided is not None:
        # Drafts are verified without grammar masks: constrained requests never speculate.
        need(req.speculative in (None, "auto", "off"), "speculative",
             f"must be auto or off with structured output, got {req.speculative!r}")
        need(not req.ignore_eos, "ignore_eos", "cannot be true with structured output "
             "(a finished constraint allows only EOS)")
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "speculative"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        # SamplingParams names the field first ("min_tokens must be ..."); map our renames.
        param = str(e).split(" ", 1)[0]
        param = {"max_tokens": max_tokens_field, "logprobs": logprobs_field}.get(param, param)
        raise APIError(400, str(e), param=param) from None


def request_meta(req: _Sampling, headers, priority_classes: dict[str, int]) -> RequestMeta:
    """The request's metadata from its body and headers: the prefix-cache salt, the
    priority (body, else X-Priority), the fair-share tenant (X-Tenant, else `user`) and the
    routing affinity key (`prompt_cache_key`, else X-Session-Id, else the tenant)."""
    tenant = resolve_tenant(req.user, headers.get("X-Tenant"))
    labels = req.metadata
    if labels is not None:
        if len(labels) > 16:
            raise APIError(400, f"metadata has {len(labels)} keys; at most 16 are allowed",
                           param="metadata")
        for key, value in labels.items():
            if len(key) > 64 or len(value) > 512:
                raise APIError(400, f"metadata key {key[:64]!r}: keys are at most 64 "
                                    f"characters and values at most 512", param="metadata")
    return RequestMeta(
        cache_salt=req.cache_salt, labels=labels or None,
        priority=resolve_priority(req.priority, headers.get("X-Priority"), priority_classes),
        tenant=tenant,
        affinity=resolve_affinity(req.prompt_cache_key, headers.get("X-Session-Id"), tenant))


def parse_completion(body: bytes, limits: Limits, headers=None,
                     priority_classes: dict[str, int] | None = None) -> ParsedRequest:
    """`headers` (a mapping) and `priority_classes` (scheduler.priority_classes) give the
    request's metadata (`request_meta`); None: none."""
    req = decode(body, CompletionRequest)
    model = _check_model(req, limits)
    prompts = completion_prompts(req.prompt)
    prompt_k, prompt_only, max_tokens = _prompt_options(req, limits)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    # OpenAI's default for the legacy endpoint is 16 tokens.
    params = _sampling_params(req, limits, max_tokens, "max_tokens", req.logprobs, "logprobs",
                              default_max_tokens=16, guided=guided_decoding(req))
    if prompt_k is not None:
        params = msgspec.structs.replace(params, prompt_logprobs=prompt_k)
    return ParsedRequest(prompts=prompts, messages=None, params=params, fit_max_tokens=False,
                         stream=req.stream, include_usage=_include_usage(req),
                         return_metrics=req.return_metrics, logprobs=req.logprobs,
                         model=model,
                         meta=msgspec.structs.replace(
                             request_meta(req, headers or {}, priority_classes or {}),
                             lora=limits.adapter(model)),
                         continuous_usage=_continuous_usage(req), cache_salt=req.cache_salt,
                         echo=req.echo, prompt_logprobs=req.prompt_logprobs,
                         prompt_only=prompt_only,
                         prompt_logprobs_field=("prompt_logprobs"
                                                if req.prompt_logprobs is not None else "echo"),
                         kv_transfer=req.kv_transfer_params)


def _prompt_options(req: CompletionRequest, limits: Limits) -> tuple[int | None, bool, int | None]:
    """(the engine's prompt_logprobs, prompt only, the max_tokens to generate). The engine
    computes prompt logprobs for `prompt_logprobs`, and for `echo` with `logprobs` (the
    echoed tokens' logprobs; top-k the larger of the two). `max_tokens` 0 (vLLM) with echo
    or prompt_logprobs returns the prompt only: one token is generated and dropped."""
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= limits.max_logprobs:
        raise APIError(400, f"prompt_logprobs must be in [0, {limits.max_logprobs}], got "
                            f"{req.prompt_logprobs}", param="prompt_logprobs")
    ks = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    prompt_k = max(ks) if ks else None
    if prompt_k is not None and prompt_k > limits.max_logprobs:
        prompt_k = None   # an out-of-range logprobs is refused by _sampling_params
    if req.max_tokens == 0 and (req.echo or req.prompt_logprobs is not None):
        return prompt_k, True, 1
    return prompt_k, False, req.max_tokens


# apply_chat_template's own parameters: chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "processor_kwargs"))


def check_template_kwargs(kwargs: dict | None, param: str = "chat_template_kwargs"
                          ) -> dict | None:
    """The chat template's extra variables, or APIError naming the one that is not one."""
    for key in kwargs or ():
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise APIError(400, f"{param}.{key[:64]} is not a chat template variable this "
                                "server passes (it is reserved or not an identifier)",
                           param=f"{param}.{key[:64]}")
    return kwargs or None


def parse_chat(body: bytes, limits: Limits, headers=None,
               priority_classes: dict[str, int] | None = None) -> ParsedRequest:
    req = decode(body, ChatCompletionRequest)
    model = _check_model(req, limits)
    kwargs = check_template_kwargs(req.chat_template_kwargs)
    messages = chat_messages(req.messages)
    tools = parse_tools(req.tools, req.tool_choice, unsupported_keyword,
                        req.parallel_tool_calls)
    max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, field = req.max_tokens, "max_tokens"
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # Unset max tokens: whatever the context window leaves (the tokenizer fits it).
    guided = guided_decoding(req)
    if tools is not None and tools.forced:
        if guided is not None:
            raise APIError(400, "a forced tool_choice cannot be combined with another output "
                                "constraint", param="tool_choice")
        # The answer is in the call format: one call, or an array of calls when parallel
        # calls are allowed (daemon/openai/tools.py).
        guided = GuidedDecoding("json_schema", json.dumps(tools.call_schema()))
    params = _sampling_params(req, limits, max_tokens, field, logprobs, "top_logprobs",
                              default_max_tokens=limits.max_model_len, guided=guided)
    return ParsedRequest(prompts=None, messages=messages, params=params,
                         fit_max_tokens=max_tokens is None, stream=req.stream,
                         include_usage=_include_usage(req), return_metrics=req.return_metrics,
                         logprobs=logprobs, model=model, max_tokens_field=field,
                         meta=msgspec.structs.replace(
                             request_meta(req, headers or {}, priority_classes or {}),
                             lora=limits.adapter(model)),
                         tools=tools, continuous_usage=_continuous_usage(req),
                         cache_salt=req.cache_salt, kv_transfer=req.kv_transfer_params,
                         chat_template_kwargs=kwargs)


def resolve_priority(body_value: int | str | None, header: str | None,
                     classes: dict[str, int]) -> int:
    """The request's priority number: the body's `priority` (a number, or a class name from
    scheduler.priority_classes), else the X-Priority header (same forms), else 0."""
    if body_value is not None:
        value, param = body_value, "priority"
    elif header is not None:
        value, param = header.strip(), "X-Priority"
        if value.lstrip("-").isdigit():
            value = int(value)
    else:
        return 0
    if isinstance(value, int) and not isinstance(value, bool):
        if not -(2**31) <= value < 2**31:
            raise APIError(400, f"{param} must be a 32-bit integer, got {value}", param=param)
        return value
    if value in classes:
        return classes[value]
    names = ", ".join(sorted(classes)) or "none configured"
    raise APIError(400, f"{param} must be an integer or a priority class ({names}), got "
                        f"{value!r}", param=param)


def resolve_tenant(user: str | None, header: str | None) -> str | None:
    """The fair-share tenant: the X-Tenant header (set by a gateway), else `user`."""
    if header:
        return header.strip()[:256]
    return user[:256] if user else None


def resolve_affinity(prompt_cache_key: str | None, session: str | None,
                     tenant: str | None) -> str | None:
    """The key whose requests the router keeps on one worker when costs tie:
    `prompt_cache_key`, else the X-Session-Id header, else the tenant (`user`)."""
    key = prompt_cache_key or (session.strip() if session else None) or tenant
    return key[:256] if key else None


def _include_usage(req: _Sampling) -> bool:
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true",
                       param="stream_options")
    return bool(req.stream_options and req.stream_options.include_usage)


def _continuous_usage(req: _Sampling) -> bool:
    # As vLLM: continuous usage stats only with include_usage.
    o = req.stream_options
    return bool(req.stream and o and o.include_usage and o.continuous_usage_stats)
