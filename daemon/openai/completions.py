"""POST /v1/completions: the legacy completions endpoint's response shapes."""

from __future__ import annotations

import dataclasses

from aiohttp import web

from tokenloom.daemon import sse
from tokenloom.daemon.openai import protocol
from tokenloom.daemon.openai.endpoints import check_serving, read_body
from tokenloom.daemon.openai.formatter import Formatter
from tokenloom.daemon.openai.generation import Choice, Delta
from tokenloom.daemon.openai.handlers import serve
from tokenloom.daemon.state import STATE


class CompletionFormatter(Formatter):
    """Echo (OpenAI's, as vLLM serves it): a choice's text starts with its prompt's text and,
    with `logprobs`, its logprobs object with the prompt's tokens (the first one's logprob
    and top_logprobs null), text offsets running on into the generated tokens. max_tokens 0
    returns the prompt alone. Streamed, the prompt goes with each choice's first chunk.
    `prompt_logprobs` (vLLM's extra) gives each whole choice a `prompt_logprobs` list: null,
    then per prompt token {token id: {"logprob", "rank", "decoded_token"}} for the token and
    the top-k (not in stream chunks, as in vLLM)."""
    object = "text_completion"
    endpoint = "completions"
    chunk_object = "text_completion"

    def __init__(self, state, request_id: str, parsed: protocol.ParsedRequest):
        super().__init__(state, request_id, parsed)
        self._offsets: dict[int, int] = {}   # per choice: text_offset of its next token
        self._echoed: set[int] = set()       # choices whose stream has sent the prompt
        self._echo_prompt: tuple | None = None   # the chunk being built echoes these tokens

    def logprobs(self, index: int, lps, prompt: tuple | None = None) -> dict | None:
        """`prompt`: (token ids, logprobs with None first), echoed before `lps`."""
        if self.parsed.logprobs is None:
            return None
        k = self.parsed.logprobs
        tokens, token_logprobs, tops, offsets = [], [], [], []
        offset = self._offsets.get(index, 0)
        entries = list(zip(*prompt)) if prompt is not None else []
        entries += [(lp.token_id, lp) for lp in lps]
        for token_id, lp in entries:
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if lp is None:   # the prompt's first token: nothing precedes it
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(lp.logprob)
            top = {self.token_text(t): v for t, v in (lp.top or ())[:k]}
            top.setdefault(text, lp.logprob)
            tops.append(top)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def _prompt_text(self, index: int) -> str:
        prompt = self.parsed.prompts[index // self.parsed.params.n]
        return prompt if isinstance(prompt, str) else self.state.engine.tokenizer.decode(prompt)

    def choice_logprobs(self, c: Choice) -> dict | None:
        prompt = None
        if self.parsed.echo and c.prompt_logprobs is not None:
            prompt = (c.prompt_token_ids, c.prompt_logprobs)
        return self.logprobs(c.index, c.logprobs, prompt)

    def choice(self, c: Choice, lps: dict | None) -> dict:
        text = self._prompt_text(c.index) + c.full_text if self.parsed.echo else c.full_text
        out = {"index": c.index, "text": text, "logprobs": lps,
               "finish_reason": c.finish_reason}
        if self.parsed.prompt_logprobs is not None:
            out["prompt_logprobs"] = self._vllm_prompt_logprobs(c)
        return out

    def _vllm_prompt_logprobs(self, c: Choice) -> list | None:
        if c.prompt_logprobs is None:
            return None
        k = self.parsed.prompt_logprobs
        out: list = []
        for lp in c.prompt_logprobs:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                        "decoded_token": self.token_text(lp.token_id)}}
            for rank, (t, v) in enumerate((lp.top or ())[:k], 1):
                entry.setdefault(str(t), {"logprob": v, "rank": rank,
                                          "decoded_token": self.token_text(t)})
            out.append(entry)
        return out

    # -- streams: the prompt goes with each choice's first chunk -------------------------
    def _first(self, d: Delta) -> bool:
        return self.parsed.echo and d.index not in self._echoed

    def chunk_frame(self, d: Delta, final_of) -> bytes:
        if self._first(d):
            return sse.frame(self.chunk(d, final_of))
        return super().chunk_frame(d, final_of)

    def chunk(self, d: Delta, final_of) -> dict:
        if self._first(d):
            self._echoed.add(d.index)
            d = dataclasses.replace(d, text=self._prompt_text(d.index) + d.text)
            if d.prompt_logprobs is not None and self.parsed.logprobs is not None:
                self._echo_prompt = (d.prompt_token_ids, d.prompt_logprobs)
        return super().chunk(d, final_of)

    def delta_logprobs(self, d: Delta) -> dict | None:
        prompt, self._echo_prompt = self._echo_prompt, None
        if prompt is None and not d.logprobs:
            return None
        return self.logprobs(d.index, d.logprobs, prompt)

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
