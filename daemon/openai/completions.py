"""POST /v1/completions: the legacy completions endpoint's response shapes."""

from __future__ import annotations

from aiohttp import web

from tokenloom.daemon import sse
from tokenloom.daemon.openai import protocol
from tokenloom.daemon.openai.endpoints import check_serving, read_body
from tokenloom.daemon.openai.formatter import Formatter
from tokenloom.daemon.openai.generation import Choice, Delta
from tokenloom.daemon.openai.handlers import serve
from tokenloom.daemon.state import STATE


class CompletionFormatter(Formatter):
    object = "text_completion"
    endpoint = "completions"
    chunk_object = "text_completion"

    def __init__(self, state, request_id: str, parsed: protocol.ParsedRequest):
        super().__init__(state, request_id, parsed)
        self._offsets: dict[int, int] = {}   # per choice: text_offset of its next token

    def logprobs(self, index: int, lps) -> dict | None:
        if self.parsed.logprobs is None:
            return None
        tokens, token_logprobs, tops, offsets = [], [], [], []
        offset = self._offsets.get(index, 0)
        for lp in lps:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            token_logprobs.append(lp.logprob)
            top = {self.token_text(t): v for t, v in (lp.top or ())}
            top.setdefault(text, lp.logprob)
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def choice(self, c: Choice, lps: dict | None) -> dict:
        return {"index": c.index, "text": c.full_text, "logprobs": lps,
                "finish_reason": c.finish_reason}

    def delta_fields(self, d: Delta) -> dict:
        return {"text": d.text}

    def frame_body(self, d: Delta) -> bytes:
        return b'"text":' + sse.encode(d.text)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    check_serving(state)
    parsed = protocol.parse_completion(await read_body(request, state), state.limits,
                                       request.headers, state.config.scheduler.priority_classes)
    return await serve(request, state, parsed, CompletionFormatter, "cmpl")
