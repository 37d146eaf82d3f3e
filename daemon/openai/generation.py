"""One HTTP request's choices, driven through the engine: outputs in, text deltas out.

A request with several prompts and/or `n` > 1 becomes one engine request per choice (choice
`index` = prompt_index * n + i, as OpenAI numbers them). Their outputs share one queue, so a
single consumer turns them into `Delta`s in arrival order, with per-choice accounting.
Detokenization and stop strings happen inside the engine (actors/output/output_processor.py): a
stop string ends the engine request with finish_reason "stop", like EOS.

Contract:
- `start()` returns once every choice is admitted (the router's acknowledgement), or raises
  APIError for the first refusal (bad prompt: 400, waiting queue full: 429) after aborting
  the others. So a handler can pick the HTTP status before sending anything.
- `deltas()` yields until every choice has finished; the last Delta of a choice carries its
  finish_reason. An engine failure mid-way raises APIError(500).
- `close()` (always call it; idempotent) aborts whatever has not finished — this is how a
  client disconnect frees KV blocks — and closes the streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator

from tokenloom.actors.engine_client import EngineClient
from tokenloom.actors.front.fan_out import fan_out
from tokenloom.actors.messages import (
    ERROR_INVALID,
    ERROR_OVERLOADED,
    GenerateRequest,
    RequestMeta,
    RequestOutput,
    RequestTimings,
    TokenLogprob,
)
from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.daemon.errors import APIError


@dataclasses.dataclass
class Delta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    # On the delta whose output carried them (the first token's): the prompt's token ids
    # and logprobs (SamplingParams.prompt_logprobs), for echo and prompt_logprobs.
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclasses.dataclass
class Choice:
    index: int
    request_id: str
    text: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    num_prompt_tokens: int = 0
    max_tokens: int = 0                 # as admitted (the router's acknowledgement)
    finish_reason: str | None = None    # set once the choice is over for the client
    timings: RequestTimings | None = None
    closed: bool = False                # the engine stream has ended
    prompt_token_ids: list[int] | None = None   # with prompt logprobs (see Delta)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    exported_prompt: list[int] | None = None   # kv_transfer_params.do_remote_decode

    @property
    def full_text(self) -> str:
        return "".join(self.text)


class Generation:
    def __init__(self, engine: EngineClient, request_id: str,
                 prompts: list[str | list[int] | None], messages: list[dict] | None,
                 params: SamplingParams, fit_max_tokens: bool, meta: RequestMeta = RequestMeta(),
                 metrics=None, log=None, tools: list[dict] | None = None,
                 prompt_only: bool = False, chat_template_kwargs: dict | None = None):
        """`prompt_only` (completions' max_tokens 0): the engine's generated tokens are
        dropped; the choices carry their finish reason and prompt data only.
        `chat_template_kwargs`: the chat template's extra variables (with `messages`)."""
        self.engine = engine
        self.request_id = request_id
        self.metrics = metrics
        self.log = log
        self.arrival = time.monotonic()
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.choices: dict[str, Choice] = {}
        self.n = params.n
        self.prompt_only = prompt_only
        self._requests: list[GenerateRequest] = fan_out(
            request_id, prompts, params, arrival_time=self.arrival, messages=messages,
            fit_max_tokens=fit_max_tokens, meta=meta, tools=tools,
            chat_template_kwargs=chat_template_kwargs)
        for index, req in enumerate(self._requests):
            self.choices[req.request_id] = Choice(index, req.request_id)
        self._by_index = {c.index: c for c in self.choices.values()}
        self._open: set[str] = set()
        self._early: list[RequestOutput] = []

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        for req in self._requests:
            self.engine.submit(req, self.queue)
            self._open.add(req.request_id)
        unacknowledged = set(self._open)
        while unacknowledged:
            out = await self.queue.get()
            unacknowledged.discard(out.request_id)
            self._note_admission(self.choices[out.request_id], out)
            if out.finished and out.finish_reason == "error":
                self._open.discard(out.request_id)
                self.close()
                raise _engine_error(out)
            if out.new_token_ids or out.finished:
                self._early.append(out)

    def close(self) -> int:
        """Abort every choice still running; returns how many were aborted."""
        aborted = 0
        for rid in self._open:
            self.engine.abort(rid)
            self.engine.streams.close(rid)
            c = self.choices[rid]
            if c.finish_reason is None:
                aborted += 1
                if self.metrics is not None:
                    self.metrics.observe_finished(c.num_prompt_tokens, len(c.token_ids),
                                                  "abort", None, c.max_tokens)
        self._open.clear()
        return aborted

    async def deltas(self) -> AsyncIterator[Delta]:
        early, self._early = self._early, []
        for out in early:
            delta = self._process(out)
            if delta is not None:
                yield delta
        while self._open:
            delta = self._process(await self.queue.get())
            if delta is not None:
                yield delta

    async def run_to_end(self) -> list[Choice]:
        async for _ in self.deltas():
            pass
        return self.results()

    def results(self) -> list[Choice]:
        return sorted(self.choices.values(), key=lambda c: c.index)

    # -- one output ----------------------------------------------------------------------
    def _process(self, out: RequestOutput) -> Delta | None:
        c = self.choices.get(out.request_id)
        if c is None or c.closed:
            return None
        self._note_admission(c, out)
        if out.finished:
            c.closed = True
            c.timings = out.timings
            self._open.discard(out.request_id)
            if out.finish_reason == "error" or (out.finish_reason == "abort" and out.error):
                self.close()
                raise _engine_error(out)
            c.finish_reason = out.finish_reason
        if out.prompt_logprobs is not None:
            c.prompt_token_ids, c.prompt_logprobs = out.prompt_token_ids, out.prompt_logprobs
        elif out.finished and out.prompt_token_ids is not None:
            c.exported_prompt = out.prompt_token_ids
        new, text = out.new_token_ids, out.text
        lps = list(out.new_logprobs or ())
        if self.prompt_only:
            new, text, lps = [], "", []
        c.token_ids.extend(new)
        c.logprobs.extend(lps)
        if text:
            c.text.append(text)
        if out.finished:
            self._observe(c)
        if not (text or new or c.finish_reason or out.prompt_logprobs is not None):
            return None
        return Delta(c.index, text, list(new), lps, c.finish_reason, out.prompt_token_ids,
                     out.prompt_logprobs)

    @staticmethod
    def _note_admission(c: Choice, out: RequestOutput) -> None:
        """What the engine admitted the choice with: its prompt length, and max_tokens as
        the tokenizer actor fitted it to the context window."""
        if out.num_prompt_tokens:
            c.num_prompt_tokens = out.num_prompt_tokens
        if out.max_tokens:
            c.max_tokens = out.max_tokens

    def _observe(self, c: Choice) -> None:
        if self.metrics is not None:
            self.metrics.observe_finished(c.num_prompt_tokens, len(c.token_ids),
                                          c.finish_reason, c.timings, c.max_tokens)
            first = c.index // self.n * self.n
            siblings = [self._by_index[i] for i in range(first, first + self.n)]
            if all(s.closed and s.finish_reason is not None for s in siblings):
                self.metrics.observe_prompt_done(self.n, max(len(s.token_ids) for s in siblings))
        if self.log is not None:
            self.log.info("choice finished", request_id=c.request_id, index=c.index,
                          finish_reason=c.finish_reason, prompt_tokens=c.num_prompt_tokens,
                          completion_tokens=len(c.token_ids))

    # -- the opt-in per-request metrics --------------------------------------------------
    def request_metrics(self) -> dict:
        """Seconds, measured from when the HTTP request arrived. With several choices:
        queue time and TTFT of the earliest, decode time from the first token of any
        choice to the last token of all, preemptions and cached tokens summed."""
        ts = [c.timings for c in self.choices.values() if c.timings is not None]

        def earliest(attr):
            vals = [getattr(t, attr) for t in ts if getattr(t, attr) is not None]
            return min(vals) if vals else None

        first_sched, first_tok = earliest("first_scheduled"), earliest("first_token")
        last_tok = max((t.token_times[-1] for t in ts if t.token_times), default=None)
        finished = max((t.finished for t in ts if t.finished is not None), default=None)
        rel = lambda x: None if x is None else round(x - self.arrival, 6)  # noqa: E731
        return {
            "queue_time": rel(first_sched),
            "time_to_first_token": rel(first_tok),
            "decode_time": (None if first_tok is None or last_tok is None
                            else round(last_tok - first_tok, 6)),
            "e2e_time": rel(finished if finished is not None else time.monotonic()),
            "cached_tokens": self.cached_tokens(),
            "num_preemptions": sum(t.num_preemptions for t in ts),
            # Per choice: prefix-cache blocks that hit and why the first miss happened.
            "prefix_cache": [{"index": c.index, "hit_blocks": c.timings.prefix_hit_blocks,
                              "cached_tokens": c.timings.num_cached_tokens,
                              "first_miss_reason": c.timings.prefix_miss_reason,
                              **({"cached_tokens_by_tier": c.timings.cached_tokens_by_tier}
                                 if c.timings.cached_tokens_by_tier is not None else {})}
                             for c in sorted(self.choices.values(), key=lambda c: c.index)
                             if c.timings is not None],
            # Per choice: the scheduler's trace (events, decode gaps, preemptions, KV plan).
            "trace": [c.timings.trace
                      for c in sorted(self.choices.values(), key=lambda c: c.index)
                      if c.timings is not None and c.timings.trace is not None],
        }

    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, counted once per prompt (like
        prompt_tokens): the best of its choices, full blocks only."""
        by_prompt: dict[int, int] = {}
        for c in self.choices.values():
            if c.timings is not None:
                p = c.index // self.n
                by_prompt[p] = max(by_prompt.get(p, 0), c.timings.num_cached_tokens)
        return sum(by_prompt.values())

    def choice_usage(self, index: int) -> dict:
        """Choice `index`'s counts so far: its prompt's tokens and its own output tokens (a
        streamed chunk's `usage` with continuous_usage_stats, as vLLM counts it)."""
        c = self._by_index[index]
        done = len(c.token_ids)
        return {"prompt_tokens": c.num_prompt_tokens, "completion_tokens": done,
                "total_tokens": c.num_prompt_tokens + done}

    def usage(self) -> dict:
        # A prompt's tokens count once however many choices it has.
        by_prompt: dict[int, int] = {}
        for c in self.choices.values():
            by_prompt.setdefault(c.index // self.n, c.num_prompt_tokens)
        prompt = sum(by_prompt.values())
        completion = sum(len(c.token_ids) for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens()}}


def _engine_error(out: RequestOutput) -> APIError:
    message = out.error or f"request ended: {out.finish_reason}"
    if out.error_kind == ERROR_INVALID:
        return APIError(400, message, param=out.error_param)
    if out.error_kind == ERROR_OVERLOADED:
        return APIError(429, message)
    if out.finish_reason == "abort":
        return APIError(503, message)
    return APIError(500, message)
