"""Preemption: what happens to the victims the policy chose. Pure (no asyncio, no torch).

A victim goes back to the waiting queue (the fair queue puts preempted requests first in
their class). `recompute` drops its KV (recomputed on re-admission); `swap` copies its
blocks to host slots first (the copies run in the runner before the next forward, so the
freed blocks may be reused at once) and back into fresh blocks on re-admission; `auto`
picks per victim by cost: copying out and back vs recomputing every computed token.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import structlog

from tokenloom.actors.scheduling.cost_model import StepCostModel
from tokenloom.actors.scheduling.kv_view import KVView
from tokenloom.actors.scheduling.policy import Decision
from tokenloom.actors.scheduling.request import Request, RequestStatus
from tokenloom.actors.scheduling.swap import SwapSpace

S = RequestStatus
log = structlog.get_logger("tokenloom.scheduler").bind(actor="scheduler")


class Preemptor:
    def __init__(self, mode: str, swap: SwapSpace | None, block_bytes: int,
                 cost: StepCostModel):
        self.configured_mode = mode
        self.swap = swap                     # None: swap preemption is off
        self.block_bytes = block_bytes       # KV bytes of one block (swap cost)
        self.cost = cost
        self.swap_seconds_per_block: float | None = None   # measured by the runner
        self.num_preemptions = 0
        self.num_swap_preemptions = 0

    def mode_fn(self, view: KVView) -> Callable[[Request], str] | None:
        """The policy's `preempt_mode` callback (None when swap space is off)."""
        if self.swap is None:
            return None
        return lambda victim: self.mode(victim, view.held(victim.request_id))

    def mode(self, victim: Request, held: int) -> str:
        """swap or recompute, for this victim."""
        if held == 0 or victim.num_computed_tokens == 0 or self.swap.num_free < held:
            return "recompute"
        if self.configured_mode == "swap":
            return "swap"
        per_block = self.swap_seconds_per_block
        if per_block is None:  # not measured yet: assume ~10 GB/s each way
            per_block = self.block_bytes / 10e9
        swap_cost = 2 * held * per_block
        return "swap" if swap_cost < self.cost.prefill_seconds(victim.num_computed_tokens) \
            else "recompute"

    def apply(self, d: Decision, view: KVView, running: list[Request],
              waiting: deque[Request]) -> list[tuple[str, list[int]]]:
        """Move the decision's victims back to waiting and queue their frees; returns the
        swap-outs (request, host slots) for the KV update, which resolves them to blocks."""
        swap_outs = []
        for req in d.preempted:
            slots = (self.swap.allocate(view.held(req.request_id))
                     if req.request_id in d.swapped else None)
            if slots is not None:
                swap_outs.append((req.request_id, slots))
            self._preempt(req, view, running, waiting, slots)
        return swap_outs

    def restart(self, req: Request, view: KVView, running: list[Request],
                waiting: deque[Request], reason: str) -> None:
        """Preempt a running request by recompute outside the policy (`reason`: why, in its
        trace), e.g. a longrope request whose KV must be computed again."""
        self._preempt(req, view, running, waiting, None, reason)

    def _preempt(self, req: Request, view: KVView, running: list[Request],
                 waiting: deque[Request], slots: list[int] | None,
                 reason: str | None = None) -> None:
        rid = req.request_id
        running.remove(req)
        req.transition(S.PREEMPTED)
        req.transition(S.WAITING_PREFILL)
        used_before = view.num_used_blocks
        held = view.held(rid)
        tokens = req.num_computed_tokens
        if slots is not None:
            req.swapped_slots = slots
            mode = "swap"
            self.num_swap_preemptions += 1
        else:
            mode = "recompute"
            req.num_computed_tokens = 0
        req.num_committed_blocks = 0
        req.num_skipped = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        view.release(rid)
        waiting.appendleft(req)
        record = {"mode": mode, "tokens_swapped" if mode == "swap" else
                  "tokens_discarded": tokens, "blocks": held,
                  "kv_used_blocks_before": used_before,
                  "kv_used_blocks_after": view.num_used_blocks}
        if reason is not None:
            record["reason"] = reason
        if req.trace is not None:
            req.trace.mark("preempted")
            req.trace.preemptions.append(record)
        log.info("preempted", request_id=rid, **record)

    def swap_ins(self, d: Decision) -> list[tuple[str, list[int]]]:
        """Swapped-out requests admitted this step: their host slots, to be copied into the
        blocks the same KV update grants them (before the forward); the slots are free again
        once the copy is queued (the runner runs it before anything else reuses them)."""
        out = []
        for req in d.admitted:
            if req.swapped_slots is not None:
                out.append((req.request_id, req.swapped_slots))
                self.swap.release(req.swapped_slots)
                req.swapped_slots = None
        return out

    def observe_swap(self, num_blocks: int, seconds: float) -> None:
        if num_blocks and seconds:
            per_block = seconds / num_blocks
            prev = self.swap_seconds_per_block
            self.swap_seconds_per_block = (per_block if prev is None
                                           else 0.8 * prev + 0.2 * per_block)
