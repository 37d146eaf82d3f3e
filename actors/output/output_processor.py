"""Output processing inside the engine: sampled tokens in, RequestOutputs with text out.

One stage between the scheduler and the streams. It owns, per request, the incremental
detokenizer (with the prompt's last tokens as context) and the stop strings, so a request
that hits a stop string finishes as STOP inside the engine, in the step that produced it:
its blocks are freed with the next KV update, with no abort round trip through the front
end. It also owns n > 1 fan-out (`fan_out`): the HTTP layer and the offline `LLM` submit
the same sibling requests and consume the same deltas.

Pure apart from the tokenizer: no asyncio, no torch.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgspec

from tokenloom.actors.output.detokenizer import IncrementalDetokenizer
from tokenloom.actors.messages import GenerateRequest
from tokenloom.actors.scheduling.request import Request
from tokenloom.actors.sampling_params import SamplingParams


def choice_request_id(request_id: str, index: int, num_choices: int) -> str:
    """Choice `index` of a request with `num_choices` choices runs as `<id>-<index>`; a
    single choice keeps the request's own id."""
    return request_id if num_choices == 1 else f"{request_id}-{index}"


def fan_out(request_id: str, prompts: Sequence[str | list[int] | None],
            params: SamplingParams, **common: Any) -> list[GenerateRequest]:
    """One engine request per choice, in OpenAI's order: choice index = prompt × n + i.

    Siblings of one prompt must differ: each gets its own seed stream (seed + i). Siblings
    1..n-1 name sibling 0 as `group_id`: they wait until its prompt is computed, then reuse
    its prompt blocks (see scheduler_siblings.py) instead of computing it n times.
    `common` fills the other GenerateRequest fields (messages, arrival_time, cache_salt...)."""
    n = params.n
    total = len(prompts) * n
    sibling = msgspec.structs.replace(params, n=1) if n > 1 else params
    out = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            index = p * n + i
            sp = sibling if params.seed is None or i == 0 else msgspec.structs.replace(
                sibling, seed=params.seed + i)
            out.append(GenerateRequest(
                request_id=choice_request_id(request_id, index, total), sampling_params=sp,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=list(prompt) if isinstance(prompt, list) else None,
                group_id=choice_request_id(request_id, p * n, total) if i > 0 else None,
                **common))
    return out


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
