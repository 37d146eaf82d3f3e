"""n > 1 and several prompts: one HTTP request (or `LLM.generate` call) becomes one engine
request per choice. The HTTP layer and the offline `LLM` submit the same sibling requests and
consume the same outputs. Pure: no asyncio, no torch.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgspec

from tokenloom.actors.messages import GenerateRequest, RequestMeta
from tokenloom.actors.sampling_params import SamplingParams


def choice_request_id(request_id: str, index: int, num_choices: int) -> str:
    """Choice `index` of a request with `num_choices` choices runs as `<id>-<index>`; a
    single choice keeps the request's own id."""
    return request_id if num_choices == 1 else f"{request_id}-{index}"


def fan_out(request_id: str, prompts: Sequence[str | list[int] | None],
            params: SamplingParams, meta: RequestMeta = RequestMeta(),
            **common: Any) -> list[GenerateRequest]:
    """One engine request per choice, in OpenAI's order: choice index = prompt × n + i.

    Siblings of one prompt must differ: each gets its own seed stream (seed + i). Siblings
    1..n-1 name sibling 0 as `meta.group_id`: they wait until its prompt is computed, then
    reuse its prompt blocks (actors/scheduling/siblings.py) instead of computing it n times.
    `common` fills the other GenerateRequest fields (messages, arrival_time...). With
    prompt logprobs every sibling computes its prompt (a forked sibling computes none, so
    it would have none to return)."""
    n = params.n
    group = params.prompt_logprobs is None
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
                meta=msgspec.structs.replace(meta, group_id=choice_request_id(
                    request_id, p * n, total)) if i > 0 and group else meta,
                **common))
    return out
