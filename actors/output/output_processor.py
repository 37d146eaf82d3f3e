"""Output processing inside the engine: sampled tokens in, RequestOutputs with text out.

One stage between the scheduler and the streams. It owns, per request, the incremental
detokenizer (with the prompt's last tokens as context) and the stop strings, so a request
that hits a stop string finishes as STOP inside the engine, in the step that produced it:
its blocks are freed with the next KV update, with no abort round trip through the front

Pure apart from the tokenizer: no asyncio, no torch.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgspec

from tokenloom.actors.output.detokenizer import IncrementalDetokenizer
from tokenloom.actors.scheduling.request import Request


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
