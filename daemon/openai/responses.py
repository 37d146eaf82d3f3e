"""Response bodies as msgspec Structs: what the handlers send, and what /openapi.json says.

Errors, /v1/models, /tokenize, /detokenize and /ready are built from these types directly.
Completion and chat responses are assembled as dicts on the hot path (openai_api._Formatter,
including the byte-spliced stream chunks); their shapes are these types, which the tests
check by decoding real responses into them (tests/daemon/openai/test_openapi.py) and by
schemathesis's response-schema conformance.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokenloom.actors.messages import WorkerStatus


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorDetail


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    # With echo the prompt's tokens come first: the very first has null logprobs.
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct, kw_only=True):
    """vLLM's shape of one token's prompt logprob."""
    logprob: float
    rank: int | None
    decoded_token: str


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    # Only with vLLM's `prompt_logprobs`: null, then {token id: PromptLogprob} per token.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[CompletionChoice]
    usage: Usage
    metrics: dict[str, Any] | None = None      # only with "return_metrics": true


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob]
    refusal: str | None


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None
    refusal: str | None
    # With a reasoning parser (server.reasoning_parser): the model's thinking, apart from
    # the answer in `content` (vLLM's field).
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChatChoice]
    usage: Usage
    metrics: dict[str, Any] | None = None


class Model(msgspec.Struct, kw_only=True):
    id: str
    object: str
    created: int
    owned_by: str
    root: str | None
    parent: str | None
    max_model_len: int | None


class ModelList(msgspec.Struct, kw_only=True):
    object: str
    data: list[Model]


class TokenizeResponse(msgspec.Struct, kw_only=True):
    tokens: list[int]
    count: int
    max_model_len: int


class StreamOptionsEcho(msgspec.Struct, kw_only=True):
    include_usage: bool
    continuous_usage_stats: bool


class RenderedPrompt(msgspec.Struct, kw_only=True):
    """One prompt of /v1/completions/render or /v1/chat/completions/render: vLLM's
    GenerateRequest shape (what its render endpoints answer), of which a router reads
    `token_ids`. `features` (multimodal) and `kv_transfer_params` are always null here."""
    request_id: str
    token_ids: list[int]
    features: None = None
    sampling_params: dict[str, Any]
    model: str
    stream: bool
    stream_options: StreamOptionsEcho | None
    cache_salt: str | None
    priority: int
    kv_transfer_params: None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class HealthResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    """/health with worker processes ("degraded" while one is down and restarting), or
    with a KV tier failing (`kv_tiers`: tier -> reason; requests fall back to recompute)."""
    status: str
    workers: list[WorkerStatus]
    kv_tiers: dict[str, str] = {}
    # Disaggregation: handoffs in flight by state, blocks under lease, outcomes, bytes moved.
    handoffs: dict | None = None


class ReadyResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    status: str
    workers_up: int | None = None       # with worker processes: how many serve
    workers: int | None = None
    roles_up: dict[str, int] | None = None   # disaggregation: workers up per role


# -- the agent APIs (documentation types: the handlers build these shapes as dicts) ----------
class ResponseUsage(msgspec.Struct, kw_only=True):
    """The Responses API's usage: input tokens (cached_tokens: prefix-cache hits) and
    output tokens (reasoning_tokens: spent thinking)."""
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(msgspec.Struct, kw_only=True):
    """POST /v1/responses: a response (daemon/openai/responses_api.py). `output` holds
    `reasoning`, `message` and `function_call` items."""
    id: str
    object: str
    created_at: int
    status: str
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = False
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []


class MessageUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None
    cache_read_input_tokens: int | None


class MessageObject(msgspec.Struct, kw_only=True):
    """POST /v1/messages: an Anthropic message (daemon/openai/messages_api.py). `content`
    holds `thinking`, `text` and `tool_use` blocks."""
    id: str
    type: str
    role: str
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage
