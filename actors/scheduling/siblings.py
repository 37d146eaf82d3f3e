"""n > 1 siblings share their prompt's KV. Pure (no asyncio, no torch).

Sibling 0 computes the prompt; siblings 1..n-1 (`group_id` = sibling 0's id) are held back
from admission until it has, then forked from it by the KV manager (its full blocks
shared, its partial last block copied by the runner before the next forward): they only
compute the last prompt token themselves. Without prefix caching every sibling computes
its own prompt.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Mapping, Sequence

from tokenloom.actors.scheduling.kv_view import KVView
from tokenloom.actors.scheduling.request import Request, RequestStatus

S = RequestStatus


def _leader(req: Request, requests: Mapping[str, Request]) -> Request | None:
    return requests.get(req.group_id) if req.group_id else None


def admissible(waiting: deque[Request], requests: Mapping[str, Request],
               enabled: bool) -> Sequence[Request]:
    """The waiting queue, less siblings whose sibling 0 has not computed its prompt yet
    (admitted after it, they reuse its prompt blocks instead of computing the same prompt
    n times), less requests with tokens still in flight (never, by the loop's order)."""
    if not enabled or not any(r.group_id for r in waiting):
        return waiting
    return deque(r for r in waiting
                 if (leader := _leader(r, requests)) is None
                 or leader.num_computed_tokens >= leader.num_prompt_tokens)


def fork_candidates(waiting: Sequence[Request], requests: Mapping[str, Request],
                    view: KVView, free_slots: int, enabled: bool,
                    groups: int = 1) -> list[tuple[str, str, int]]:
    """(sibling 0, sibling, tokens to share) for siblings whose sibling 0 holds its computed
    prompt; at most one new block each per layer group (the copy of the partial block)."""
    if not enabled or not any(r.group_id for r in waiting):
        return []
    out, budget = [], view.num_free_blocks
    for r in waiting:
        leader = _leader(r, requests)
        if (leader is None or view.held(leader.request_id) == 0 or len(out) >= free_slots
                or budget < groups or r.num_preemptions or r.num_tokens != r.num_prompt_tokens
                or r.fork_refused
                or leader.num_computed_tokens < leader.num_prompt_tokens
                or leader.token_ids[:leader.num_prompt_tokens] != r.token_ids):
            continue
        out.append((leader.request_id, r.request_id, r.num_prompt_tokens - 1))
        budget -= groups
    return out


def apply_forks(forked: Mapping[str, list[int]], requests: Mapping[str, Request],
                waiting: deque[Request], running: list[Request],
                block_size: int) -> tuple[int, list[str]]:
    """Move the forked siblings from waiting to running, with their prompt but the last
    token computed. Returns how many, and the forked siblings that ended (aborted) during
    the round trip: their new tables must be freed."""
    now = time.monotonic()
    orphans = []
    for child_id in forked:
        req = requests.get(child_id)
        if req is None:
            orphans.append(child_id)
            continue
        leader = requests.get(req.group_id)  # it may have ended meanwhile: the blocks stay
        waiting.remove(req)
        running.append(req)
        req.num_computed_tokens = req.num_prompt_tokens - 1  # only the last token to go
        full = req.num_computed_tokens // block_size
        req.num_committed_blocks = min(leader.num_committed_blocks if leader else 0, full)
        req.num_cached_tokens, req.prefix_hit_blocks = full * block_size, full
        req.prefix_miss_reason = "partial_block" if req.num_computed_tokens % block_size else None
        req.first_scheduled_time = now
        req.transition(S.PREFILLING)
    return len(forked) - len(orphans), orphans
