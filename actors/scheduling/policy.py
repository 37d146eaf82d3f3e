"""The scheduling policy: which tokens run in the next iteration. Pure: no asyncio, no torch.

Each iteration, under `max_num_seqs` and `max_num_batched_tokens`:
  1. running decodes first (one token each), most important class first — streams keep
     flowing: a running decode is only ever left out when it is preempted (or, with
     sliding-window layer groups, for one step while the blocks its windows drop this
     step are not yet reported free: waiting beats losing its KV);
  2. running prefills (the next chunk of a prompt already admitted), by class;
  3. waiting requests in the order given (the scheduler orders them by class, fair share
     and age: see fairness.py), each getting a chunk of whatever token budget is left.
Steps 2 and 3 share `prefill_budget` tokens when the scheduler sizes chunks for a latency
target (SLO-driven chunking); decodes never count against it.

Admission follows a KV plan: a waiting request enters only if, after this iteration's
grants, the free blocks still cover its whole prompt, the projected growth of every running
request and of itself over the next `lookahead_tokens` tokens (bounded by each one's
max_tokens), and `min_free_blocks` (the watermark; the scheduler raises it after a
preemption until the pool recovers — hysteresis). With nothing running, only the chunk has
to fit, so a large prompt is never blocked forever. A prompt that can never fit is rejected.

A request that needs a new KV block when none is free preempts a victim chosen by
`victim_key` (least important class, least often preempted, cheapest to redo, latest
admitted). Each victim is recomputed later or, when `preempt_mode` says so, swapped out
to host memory and back.

The policy reads a view of the KV pool (free blocks, blocks each request holds) and returns
a decision; the scheduler actor applies it and asks the KV manager for exactly the
`grants` it lists, in one atomic call. A decision always fits the view it was made from.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable, Mapping, Sequence

from tokenloom.actors.kv.groups import KVGroups
from tokenloom.actors.scheduling.fairness import victim_key
from tokenloom.actors.scheduling.request import Request
from tokenloom.arith import cdiv


@dataclasses.dataclass(frozen=True)
class PolicyLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int
    # The model's layer groups (actors/kv/groups.py); None: one group (a block a position).
    kv_groups: KVGroups | None = None

    @property
    def num_groups(self) -> int:
        return 1 if self.kv_groups is None else self.kv_groups.num_groups

    def blocks(self, num_tokens: int, num_computed: int) -> int:
        """Blocks a request's tables hold covering `num_tokens` tokens when its next
        position to compute is `num_computed` (sliding groups hold only their window)."""
        if self.kv_groups is None:
            return cdiv(num_tokens, self.block_size)
        return self.kv_groups.blocks_for(num_tokens, num_computed, self.block_size)


@dataclasses.dataclass(frozen=True)
class AdmissionParams:
    """The KV plan's knobs for one iteration (the scheduler derives them from config)."""
    min_free_blocks: int = 0      # watermark left free after admitting (raised after preemption)
    lookahead_tokens: int = 0     # growth projected for each running request and the candidate


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
    swapped: set[str] = dataclasses.field(default_factory=set)          # preempted by swap
    rejected: list[tuple[Request, str]] = dataclasses.field(default_factory=list)
    grants: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (id, total tokens)
    plans: dict[str, dict] = dataclasses.field(default_factory=dict)    # admitted id -> KV plan
    # The first waiting request that could not enter, and why ("kv", "budget", "seqs").
    blocked: tuple[Request, str, dict] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.decodes) + sum(w.num_tokens for w in self.prefills)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


def remaining_output(req: Request) -> int:
    """Tokens the request may still generate (max_tokens, bounded by the context window)."""
    left = req.sampling_params.max_tokens - req.num_output_tokens
    if req.max_model_len is not None:
        left = min(left, req.max_model_len - req.num_tokens)
    return max(0, left)


def projected_tokens(req: Request, lookahead: int) -> int:
    """Tokens the request's table should hold soon: all its known tokens (the rest of the
    prompt included) plus `lookahead` more, or fewer when it must stop before that."""
    return req.num_tokens + min(lookahead, remaining_output(req))


def schedule(running: Sequence[Request], waiting: deque[Request] | Sequence[Request],
             num_free_blocks: int, held_blocks: Callable[[str], int],
             limits: PolicyLimits,
             freeable_blocks: Callable[[str], int] | None = None, *,
             prefill_budget: int | None = None,
             admission: AdmissionParams = AdmissionParams(),
             preempt_mode: Callable[[Request], str] | None = None,
             drafts: Mapping[str, int] | None = None, spec_lookahead: int = 0,
             table_blocks: Callable[[str], int] | None = None) -> Decision:
    """Decide the next iteration. Does not mutate its arguments.

    `held_blocks(id)` is the length of a request's block table; `freeable_blocks(id)` how
    many blocks preempting it would return to the pool (fewer than it holds when prefix
    blocks are shared); by default the same as held_blocks. `prefill_budget` caps the
    tokens of prefill chunks (running and admitted) this iteration; `preempt_mode(victim)`
    returns "swap" or "recompute" (default: recompute). `drafts[id]`: speculative tokens a
    decode verifies this step (it computes 1 + that many, fewer when the token budget must
    leave one token for every later decode); `spec_lookahead`: extra slots granted to
    decodes of speculating requests, where a draft model writes its proposals' KV.
    `table_blocks(id)`: with several layer groups, the length of a request's tables in
    position blocks (held_blocks then counts what its groups hold, fewer where a sliding
    group dropped blocks behind its window)."""
    return StepPlanner(running, num_free_blocks, held_blocks, limits,
                       freeable_blocks or held_blocks, preempt_mode,
                       table_blocks or held_blocks).schedule(
        waiting, prefill_budget, admission, drafts or {}, spec_lookahead)


class StepPlanner:
    """One iteration's plan, built in three passes over one pool view: `schedule()` reads
    decodes -> running prefills -> admissions. `free` is the pool's free blocks as the plan
    spends them (and preemption returns them); `budget` the token budget left."""

    def __init__(self, running: Sequence[Request], num_free_blocks: int,
                 held_blocks: Callable[[str], int], limits: PolicyLimits,
                 freeable_blocks: Callable[[str], int],
                 preempt_mode: Callable[[Request], str] | None,
                 table_blocks: Callable[[str], int] | None = None):
        self.running = running
        self.table_blocks = table_blocks or held_blocks
        self.free = num_free_blocks
        self.held = held_blocks
        self.freeable = freeable_blocks
        self.limits = limits
        self.preempt_mode = preempt_mode
        self.budget = limits.max_num_batched_tokens
        self.d = Decision()
        self.order = {r.request_id: i for i, r in enumerate(running)}
        self.victims: set[str] = set()
        self.scheduled: set[str] = set()
        self.table_tokens: dict[str, int] = {}   # tokens each scheduled table covers

    def schedule(self, waiting, prefill_budget: int | None, admission: AdmissionParams,
                 drafts: Mapping[str, int], spec_lookahead: int) -> Decision:
        self.decodes(drafts, spec_lookahead)
        if prefill_budget is not None:
            self.budget = min(self.budget, prefill_budget)
        self.prefills()
        self.admit(waiting, admission)
        return self.d

    # -- KV: what a table needs, and preemption to find it ---------------------------------
    def need(self, req: Request, total_tokens: int) -> int:
        """Blocks req's tables gain growing to `total_tokens`: a block per layer group for
        each position block not covered yet. (What a sliding group drops behind its window
        in the same update is not counted back: dropped blocks shared with a sibling or a
        prefix hit free nothing, and the rest shows in the next report.)"""
        limits = self.limits
        if limits.kv_groups is None:
            return max(0, cdiv(total_tokens, limits.block_size) - self.held(req.request_id))
        return limits.num_groups * max(0, cdiv(total_tokens, limits.block_size)
                                       - self.table_blocks(req.request_id))

    def evict(self, victim: Request) -> None:
        rid = victim.request_id
        self.victims.add(rid)
        self.d.preempted.append(victim)
        if self.preempt_mode is not None and self.preempt_mode(victim) == "swap":
            self.d.swapped.add(rid)
        self.free += self.freeable(rid)

    def preempt_one(self, exclude: Request) -> bool:
        eligible = [r for r in self.running if r.request_id not in self.victims
                    and r.request_id not in self.scheduled and r is not exclude
                    and not r.is_awaiting_output]
        if not eligible:
            return False
        self.evict(min(eligible, key=lambda r: victim_key(r, self.order[r.request_id])))
        return True

    def place(self, req: Request, num_tokens: int, extra: int = 0) -> bool:
        """Reserve blocks for req's next num_tokens (+ `extra` slots), preempting others
        if needed."""
        total = req.num_computed_tokens + num_tokens + extra
        while self.need(req, total) > self.free:
            if not self.preempt_one(exclude=req):
                return False
        self.free -= self.need(req, total)
        self.d.grants.append((req.request_id, total))
        self.scheduled.add(req.request_id)
        self.table_tokens[req.request_id] = total
        return True

    def fitting(self, req: Request, num_tokens: int) -> int:
        """With several layer groups: the most of req's next `num_tokens` whose blocks fit
        the free ones now (0: not one token). A long chunk a lone request cannot hold at
        once in every group still goes through in smaller ones, its sliding groups
        dropping what falls behind their windows as it goes."""
        limits = self.limits
        if limits.kv_groups is None:
            return num_tokens if self.need(req, req.num_computed_tokens + num_tokens) \
                <= self.free else 0
        blocks = self.table_blocks(req.request_id) + self.free // limits.num_groups
        return max(0, min(num_tokens, blocks * limits.block_size - req.num_computed_tokens))

    def drops_pending(self, req: Request) -> bool:
        """Its sliding groups hold blocks this update drops behind their windows (they show
        free in the next report)."""
        limits = self.limits
        if limits.kv_groups is None or not limits.kv_groups.hybrid:
            return False
        covered = self.table_blocks(req.request_id) * limits.block_size
        return self.held(req.request_id) > limits.blocks(covered, req.num_computed_tokens)

    def _by_class(self, r: Request):
        return (r.priority, self.order[r.request_id])

    # -- 1. decodes ------------------------------------------------------------------------
    def decodes(self, drafts: Mapping[str, int], spec_lookahead: int) -> None:
        """Most important first. They always fit the token budget (max_num_seqs <=
        max_num_batched_tokens); only KV exhaustion can stop one, and then it is preempted."""
        decodes = sorted((r for r in self.running if r.is_decode), key=self._by_class)
        for i, req in enumerate(decodes):
            if req.request_id in self.victims:
                continue
            later = len(decodes) - i - 1
            n = 1 + max(0, min(drafts.get(req.request_id, 0), self.budget - 1 - later))
            # (never past what it may still produce: a lone request must always fit the pool)
            extra = min(spec_lookahead, max(0, remaining_output(req) - n)) \
                if req.spec is not None and spec_lookahead else 0
            if self.budget < 1 or not self.place(req, n, extra):
                # (a request whose own dropped blocks will make room next step waits a
                # step rather than losing its KV)
                if req.request_id not in self.victims and not (
                        self.budget >= 1 and self.drops_pending(req)):
                    self.evict(req)
                continue
            self.budget -= n
            self.d.decodes.append(ScheduledWork(req, n, resumed=False))

    # -- 2. running prefills ---------------------------------------------------------------
    def prefills(self) -> None:
        """Running prefills continue their prompt with the next chunk. Requests whose last
        token is already being sampled (overlapped steps) have nothing left to schedule;
        they hold their blocks until that token comes back."""
        prefilling = sorted((r for r in self.running
                             if not r.is_decode and not r.is_awaiting_output),
                            key=self._by_class)
        for req in prefilling:
            if req.request_id in self.victims or self.budget <= 0:
                continue
            n = min(req.num_remaining_tokens, self.budget)
            if not self.place(req, n):
                fit = self.fitting(req, n) if self.limits.kv_groups is not None else 0
                if fit and self.place(req, fit):
                    n = fit
                else:
                    if req.request_id not in self.victims and not self.drops_pending(req):
                        self.evict(req)
                    continue
            self.budget -= n
            self.d.prefills.append(ScheduledWork(req, n, resumed=False))

    # -- 3. admissions ---------------------------------------------------------------------
    def admit(self, waiting, admission: AdmissionParams) -> None:
        """Waiting requests in the given order while budget, sequence slots and the KV plan
        allow. Never preempts running work to admit new work."""
        d, limits, bs = self.d, self.limits, self.limits.block_size
        live = [r for r in self.running if r.request_id not in self.victims]
        num_running = len(live)
        la = admission.lookahead_tokens

        def future_need(req: Request) -> int:
            have = max(self.held(req.request_id),
                       limits.blocks(self.table_tokens.get(req.request_id, 0),
                                     req.num_computed_tokens))
            projected = projected_tokens(req, la)
            return max(0, limits.blocks(projected, projected) - have)

        reserved = sum(future_need(r) for r in live)
        for req in waiting:
            if num_running >= limits.max_num_seqs:
                d.blocked = (req, "seqs", {})
                break
            if self.budget <= 0:
                d.blocked = (req, "budget", {})
                break
            # (its smallest footprint: a sliding group holds only its window at the end)
            prompt_blocks = limits.blocks(req.num_tokens, req.num_tokens)
            if prompt_blocks > limits.num_blocks:
                d.rejected.append((req, f"the prompt needs {prompt_blocks} KV blocks of {bs} "
                                        f"tokens ({req.num_tokens} tokens) but the KV pool has "
                                        f"only {limits.num_blocks} blocks "
                                        f"({limits.num_blocks * bs} tokens)"))
                continue
            n = min(req.num_remaining_tokens, self.budget)
            total = req.num_computed_tokens + n
            chunk_blocks = self.need(req, total)
            projected = projected_tokens(req, la)
            growth = limits.blocks(projected, projected) - max(
                self.held(req.request_id), limits.blocks(total, req.num_computed_tokens))
            plan = {"prompt_blocks": prompt_blocks, "chunk_blocks": chunk_blocks,
                    "projected_growth_blocks": max(0, growth),
                    "running_reserved_blocks": reserved, "free_blocks": self.free,
                    "watermark_blocks": admission.min_free_blocks}
            if num_running == 0 and chunk_blocks > self.free and limits.kv_groups is not None:
                # (alone, a chunk every group cannot hold at once goes in smaller ones)
                n = self.fitting(req, n)
                total = req.num_computed_tokens + n
                chunk_blocks = self.need(req, total)
            if num_running == 0:
                fits = n > 0 and chunk_blocks <= self.free  # alone: the chunk must fit
            else:
                fits = (self.free - chunk_blocks - max(0, growth) - reserved
                        >= admission.min_free_blocks)
            if not fits:
                d.blocked = (req, "kv", plan)
                break
            self.free -= chunk_blocks
            reserved += max(0, growth)
            d.grants.append((req.request_id, total))
            self.table_tokens[req.request_id] = total
            self.budget -= n
            num_running += 1
            d.admitted.append(req)
            d.plans[req.request_id] = plan
            d.prefills.append(ScheduledWork(req, n, resumed=True))
