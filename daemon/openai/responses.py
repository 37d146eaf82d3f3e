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
    content: str
    refusal: str | None


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
