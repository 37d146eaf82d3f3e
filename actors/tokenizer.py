"""The tokenizer actor: text or chat messages -> prompt token ids -> the scheduler.

Validation that needs the tokens (empty prompt, prompt + max_tokens beyond the context
window) happens here, so a bad request ends with an error output before it costs anything.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import msgspec

from tokenloom.actors.base import Actor
from tokenloom.actors.messages import (ERROR_INVALID, AddRequest, GenerateRequest, RequestOutput,
                                       Shutdown)


class PromptError(ValueError):
    """A request the tokenizer refuses; `param` names the request field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class TokenizerActor(Actor):
    name = "tokenizer"

    def __init__(self, tokenizer, max_model_len: int, emit: Callable[[RequestOutput], None]):
        super().__init__()
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.emit = emit
        self.next_inbox: asyncio.Queue | None = None  # the router

    def encode(self, req: GenerateRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
            vocab = len(self.tokenizer)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise PromptError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})",
                                  "prompt")
            return ids
        if req.messages is not None:
            try:
                return list(self.tokenizer.apply_chat_template(
                    req.messages, add_generation_prompt=True, tokenize=True, return_dict=False))
            except Exception as e:  # no template, or the template rejects these messages
                raise PromptError(f"cannot apply the chat template: {e}", "messages") from e
        return self.tokenizer.encode(req.prompt or "", add_special_tokens=True)

    def check(self, req: GenerateRequest, ids: list[int]):
        """Validate the prompt against the context window; returns the sampling params to
        use (max_tokens lowered to fit when the request asked for that)."""
        prompt_field = "messages" if req.messages is not None else "prompt"
        params = req.sampling_params
        if not ids:
            raise PromptError(f"{prompt_field} is empty", prompt_field)
        room = self.max_model_len - len(ids)
        if req.fit_max_tokens and room >= 1 and params.max_tokens > room:
            params = msgspec.structs.replace(params, max_tokens=room,
                                             min_tokens=min(params.min_tokens, room))
        if len(ids) + params.max_tokens > self.max_model_len:
            if room < 1:
                raise PromptError(
                    f"{prompt_field} has {len(ids)} tokens, which leaves no room for output in "
                    f"the context window of {self.max_model_len} tokens", prompt_field)
            raise PromptError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(ids) + params.max_tokens} exceeds the context window of "
                f"{self.max_model_len} tokens", "max_tokens")
        return params

    def handle(self, req: GenerateRequest) -> None:
        try:
            ids = self.encode(req)
            params = self.check(req, ids)
        except Exception as e:  # a bad request ends only itself
            param = e.param if isinstance(e, PromptError) else None
            self.log.info("request rejected", request_id=req.request_id, error=str(e))
            self.emit(RequestOutput(request_id=req.request_id, new_token_ids=[], finished=True,
                                    finish_reason="error", error=str(e), error_kind=ERROR_INVALID,
                                    error_param=param))
            return
        self.next_inbox.put_nowait(AddRequest(
            request_id=req.request_id, prompt_token_ids=ids, sampling_params=params,
            arrival_time=req.arrival_time or time.monotonic(), cache_salt=req.cache_salt,
            group_id=req.group_id, priority=req.priority, tenant=req.tenant))

    async def run(self) -> None:
        while True:
            msg = await self.inbox.get()
            match msg:
                case GenerateRequest():
                    self.handle(msg)
                case Shutdown():
                    return
                case _:
                    self.next_inbox.put_nowait(msg)  # aborts etc. keep their order with adds
