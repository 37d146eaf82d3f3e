"""The scheduling policy: which tokens run in the next iteration. Pure: no asyncio, no torch.

Each iteration, under `max_num_seqs` and `max_num_batched_tokens`:
  1. running decodes first (one token each) — streams keep flowing;
  2. running prefills (the next chunk of a prompt already admitted);
  3. waiting requests, FCFS, each getting a chunk of whatever token budget is left.
A request that needs a new KV block when none is free preempts the most recently admitted
running request (recompute: it gives back its blocks and waits again with its tokens).

The policy reads a view of the KV pool (free blocks, blocks each request holds) and returns
a decision; the scheduler actor applies it and asks the KV manager for exactly the
`grants` it lists, in one atomic call. A decision always fits the view it was made from.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable, Sequence

from tokenloom.actors.request import Request


@dataclasses.dataclass(frozen=True)
class PolicyLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int


@dataclasses.dataclass
class ScheduledWork:
    request: Request
    num_tokens: int           # tokens computed this iteration
    resumed: bool             # first time on the runner since (re)admission


@dataclasses.dataclass
class Decision:
    decodes: list[ScheduledWork] = dataclasses.field(default_factory=list)
    prefills: list[ScheduledWork] = dataclasses.field(default_factory=list)
    admitted: list[Request] = dataclasses.field(default_factory=list)   # waiting -> running
    preempted: list[Request] = dataclasses.field(default_factory=list)  # running -> waiting
    rejected: list[tuple[Request, str]] = dataclasses.field(default_factory=list)
    grants: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (id, total tokens)

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.decodes) + sum(w.num_tokens for w in self.prefills)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def schedule(running: Sequence[Request], waiting: deque[Request] | Sequence[Request],
             num_free_blocks: int, held_blocks: Callable[[str], int],
             limits: PolicyLimits,
             freeable_blocks: Callable[[str], int] | None = None) -> Decision:
    """Decide the next iteration. Does not mutate its arguments.

    `held_blocks(id)` is the length of a request's block table; `freeable_blocks(id)` how
    many blocks preempting it would return to the pool (fewer than it holds when prefix
    blocks are shared); by default the same as held_blocks."""
    freeable = freeable_blocks or held_blocks
    d = Decision()
    budget = limits.max_num_batched_tokens
    free = num_free_blocks
    bs = limits.block_size
    # Victims come from the back of the running order (most recently admitted first).
    candidates = list(running)
    victims: set[str] = set()
    scheduled: set[str] = set()

    def need(req: Request, total_tokens: int) -> int:
        return max(0, blocks_for(total_tokens, bs) - held_blocks(req.request_id))

    def preempt_one(exclude: Request) -> bool:
        nonlocal free
        for victim in reversed(candidates):
            rid = victim.request_id
            if rid in victims or rid in scheduled or victim is exclude:
                continue
            victims.add(rid)
            d.preempted.append(victim)
            free += freeable(rid)
            return True
        return False

    def place(req: Request, num_tokens: int) -> bool:
        """Reserve blocks for req's next num_tokens, preempting others if needed."""
        nonlocal free
        total = req.num_computed_tokens + num_tokens
        while need(req, total) > free:
            if not preempt_one(exclude=req):
                return False
        free -= need(req, total)
        d.grants.append((req.request_id, total))
        scheduled.add(req.request_id)
        return True

    # 1. Decodes, in running order. They always fit the token budget (max_num_seqs <=
    # max_num_batched_tokens); only KV exhaustion can stop one, and then it is preempted.
    decodes = [r for r in running if r.is_decode]
    prefilling = [r for r in running if not r.is_decode]
    for req in decodes:
        if req.request_id in victims:
            continue
        if budget < 1 or not place(req, 1):
            if req.request_id not in victims:
                victims.add(req.request_id)
                d.preempted.append(req)
                free += freeable(req.request_id)
            continue
        budget -= 1
        d.decodes.append(ScheduledWork(req, 1, resumed=False))

    # 2. Running prefills continue their prompt with the next chunk.
    for req in prefilling:
        if req.request_id in victims or budget <= 0:
            continue
        n = min(req.num_remaining_tokens, budget)
        if not place(req, n):
            if req.request_id not in victims:
                victims.add(req.request_id)
                d.preempted.append(req)
                free += freeable(req.request_id)
            continue
        budget -= n
        d.prefills.append(ScheduledWork(req, n, resumed=False))

    # 3. Admit waiting requests FCFS while budget, sequence slots and blocks allow.
    # Never preempt running work to admit new work: admission only uses free blocks.
    num_running = len(running) - len(victims)
    for req in waiting:
        if budget <= 0 or num_running >= limits.max_num_seqs:
            break
        if blocks_for(req.num_tokens, bs) > limits.num_blocks:
            d.rejected.append((req, f"request needs {blocks_for(req.num_tokens, bs)} KV blocks "
                                    f"but the pool has only {limits.num_blocks}"))
            continue
        n = min(req.num_remaining_tokens, budget)
        total = req.num_computed_tokens + n
        if need(req, total) > free:
            break
        free -= need(req, total)
        d.grants.append((req.request_id, total))
        budget -= n
        num_running += 1
        d.admitted.append(req)
        d.prefills.append(ScheduledWork(req, n, resumed=True))
    return d
