"""The tokenizer actor: text or chat messages -> prompt token ids -> the scheduler.

Validation that needs the tokens (empty prompt, prompt + max_tokens beyond the context
window) happens here, so a bad request ends with an error output before it costs anything.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from tokenloom.actors.base import Actor
from tokenloom.actors.messages import AddRequest, GenerateRequest, RequestOutput, Shutdown


class TokenizerActor(Actor):
    name = "tokenizer"

    def __init__(self, tokenizer, max_model_len: int, emit: Callable[[RequestOutput], None]):
        super().__init__()
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.emit = emit
        self.next_inbox: asyncio.Queue | None = None  # the scheduler (later: the router)

    def encode(self, req: GenerateRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
            vocab = len(self.tokenizer)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
            return ids
        if req.messages is not None:
            return list(self.tokenizer.apply_chat_template(
                req.messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        return self.tokenizer.encode(req.prompt or "", add_special_tokens=True)

    def check(self, req: GenerateRequest, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty")
        total = len(ids) + req.sampling_params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({req.sampling_params.max_tokens}) = "
                f"{total} exceeds the context window of {self.max_model_len} tokens")

    def handle(self, req: GenerateRequest) -> None:
        try:
            ids = self.encode(req)
            self.check(req, ids)
        except Exception as e:  # a bad request ends only itself
            self.emit(RequestOutput(request_id=req.request_id, new_token_ids=[], finished=True,
                                    finish_reason="error", error=str(e)))
            return
        self.next_inbox.put_nowait(AddRequest(
            request_id=req.request_id, prompt_token_ids=ids, sampling_params=req.sampling_params,
            arrival_time=req.arrival_time or time.monotonic()))

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
