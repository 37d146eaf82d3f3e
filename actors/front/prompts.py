"""A request's prompt as token ids, and its fit in the context window. Pure: the tokenizer
actor runs these for every request, and the HTTP render endpoints run the very same
functions, so the ids a router is told (and hashes into block keys) are the ids the engine
caches (daemon/openai/render.py)."""

from __future__ import annotations

import msgspec

from tokenloom.actors.messages import GenerateRequest
from tokenloom.actors.sampling_params import SamplingParams


class PromptError(ValueError):
    """A request the tokenizer refuses; `param` names the request field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def encode_prompt(tokenizer, req: GenerateRequest) -> list[int]:
    """The prompt token ids of `req`: its ids (checked against the vocabulary), its chat
    messages through the chat template (with the tools a template renders), or its text."""
    if req.prompt_token_ids is not None:
        ids = list(req.prompt_token_ids)
        vocab = len(tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"prompt token id {bad[0]} is outside the vocabulary "
                              f"[0, {vocab})", "prompt")
        return ids
    if req.messages is not None:
        try:
            extra = dict(req.chat_template_kwargs or {})
            if req.tools:
                extra["tools"] = req.tools
            return list(tokenizer.apply_chat_template(
                req.messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                **extra))
        except Exception as e:  # no template, or the template rejects these messages
            raise PromptError(f"cannot apply the chat template: {e}", "messages") from e
    return tokenizer.encode(req.prompt or "", add_special_tokens=True)


def fit_prompt(req: GenerateRequest, ids: list[int], max_model_len: int,
               max_prompt_logprobs_tokens: int | None = None) -> SamplingParams:
    """Validate the prompt against the context window (and, when it asks for prompt
    logprobs, against their bound; None: unbounded); returns the sampling params to use
    (max_tokens lowered to fit when the request asked for that)."""
    prompt_field = "messages" if req.messages is not None else "prompt"
    params = req.sampling_params
    if not ids:
        raise PromptError(f"{prompt_field} is empty", prompt_field)
    room = max_model_len - len(ids)
    if req.fit_max_tokens and room >= 1 and params.max_tokens > room:
        params = msgspec.structs.replace(params, max_tokens=room,
                                         min_tokens=min(params.min_tokens, room))
    if len(ids) + params.max_tokens > max_model_len:
        if room < 1:
            raise PromptError(
                f"{prompt_field} has {len(ids)} tokens, which leaves no room for output in "
                f"the context window of {max_model_len} tokens", prompt_field)
        raise PromptError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
            f"{len(ids) + params.max_tokens} exceeds the context window of "
            f"{max_model_len} tokens", "max_tokens")
    bound = max_prompt_logprobs_tokens
    if params.prompt_logprobs is not None and bound is not None and len(ids) > bound:
        raise PromptError(
            f"prompt_logprobs: the prompt has {len(ids)} tokens; prompt logprobs are "
            f"returned for at most {bound} (scheduler.max_prompt_logprobs_tokens)",
            "prompt_logprobs")
    return params
