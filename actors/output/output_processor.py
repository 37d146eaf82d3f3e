"""Output processing inside the engine: sampled tokens in, RequestOutputs with text out
(vLLM's meaning: the scheduler decides what happened to a request; this builds what its
stream is sent).

One stage between the scheduler and the streams. It owns, per request, the incremental
detokenizer (with the prompt's last tokens as context) and the stop strings, so a request
that hits a stop string finishes as STOP inside the engine, in the step that produced it:
its blocks are freed with the next KV update, with no abort round trip through the front

Pure apart from the tokenizer: no asyncio, no torch.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from tokenloom.actors.messages import RequestOutput, RequestTimings, TokenLogprob
from tokenloom.actors.output.detokenizer import IncrementalDetokenizer
from tokenloom.actors.scheduling.request import FinishReason, Request


class OutputProcessor:
    """Detokenization and stop strings for the scheduler's requests. Each request carries
    its own IncrementalDetokenizer (`Request.detokenizer`, made by `start`), so there is no
    registry here to keep in step with the scheduler's. Contract: `text(req, ids)` returns
    the new final text of `ids` and whether a stop string matched (then the request must
    finish as STOP; the text ends before the stop string); `final_text(req)` flushes what
    was held back when the request ends for another reason."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def start(self, req: Request) -> None:
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer, req.token_ids[: req.num_prompt_tokens],
                stop=req.sampling_params.stop)

    @staticmethod
    def text(req: Request, token_ids: Sequence[int]) -> tuple[str, bool]:
        d = req.detokenizer
        if d is None:
            return "", False
        delta = d.add(token_ids)
        return delta, d.stopped is not None

    @staticmethod
    def final_text(req: Request) -> str:
        d = req.detokenizer
        if d is None or d.stopped is not None:
            return ""
        return d.finish()

    # -- the outputs a request's stream is sent ------------------------------------------
    @staticmethod
    def token_output(req: Request, token_id: int, text: str,
                     logprobs: list[TokenLogprob] | None) -> RequestOutput:
        """A streamed token (the request goes on)."""
        return RequestOutput(request_id=req.request_id, new_token_ids=[token_id], text=text,
                             new_logprobs=logprobs, num_prompt_tokens=req.num_prompt_tokens,
                             **prompt_fields(req))

    def final_output(self, req: Request, reason: FinishReason, *, text: str = "",
                     new_tokens: list[int] | None = None,
                     new_logprobs: list[TokenLogprob] | None = None,
                     error: str | None = None, error_kind: str | None = None) -> RequestOutput:
        """The last output of a finished request: its last token(s) and text (what was held
        back flushed when it ended normally), the finish reason or error, and its timings
        with the trace."""
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            text += self.final_text(req)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new_tokens or [], text=text,
            new_logprobs=new_logprobs, num_prompt_tokens=req.num_prompt_tokens,
            finished=True, finish_reason=reason.as_openai(), error=error,
            error_kind=error_kind, timings=request_timings(req),
            **{**exported_prompt(req), **(prompt_fields(req) if new_tokens else {})})


def prompt_fields(req: Request) -> dict:
    """The prompt logprobs and token ids, on the output with the request's first token
    (once every prompt position's logprob is in: the step that samples it computed the
    prompt's last chunk)."""
    lps = req.prompt_logprobs
    if lps is None or req.prompt_logprobs_sent or req.wants_prompt_logprobs:
        return {}
    req.prompt_logprobs_sent = True
    req.prompt_logprobs = None   # (the output holds them now)
    return {"prompt_logprobs": [None, *lps],
            "prompt_token_ids": req.token_ids[:req.num_prompt_tokens]}


def exported_prompt(req: Request) -> dict:
    """A handoff's prefill half (RequestMeta.kv_export) tells its caller which prompt it
    exported, so the caller can name the blocks (their hashes) to the decode side."""
    if not req.meta.kv_export:
        return {}
    return {"prompt_token_ids": req.token_ids[:req.num_prompt_tokens]}


def request_timings(req: Request) -> RequestTimings:
    return RequestTimings(arrival=req.arrival_time, first_scheduled=req.first_scheduled_time,
                          first_token=req.first_token_time, finished=time.monotonic(),
                          token_times=list(req.token_times),
                          num_preemptions=req.num_preemptions,
                          num_cached_tokens=req.num_cached_tokens,
                          prefix_hit_blocks=req.prefix_hit_blocks,
                          prefix_miss_reason=req.prefix_miss_reason,
                          cached_tokens_by_tier=req.cached_tokens_by_tier,
                          trace=req.trace.as_dict() if req.trace is not None else None)
