"""The scheduler actor: the engine loop. schedule() -> launch -> process().

A thin async shell around the synchronous core (scheduler.py, which owns every Request and
decides each step): this module owns the inbox, the loop, the steps in flight and the round
trips. Each iteration `_schedule` plans the next step (`Scheduler.plan`: the policy, under
the fair-share order, the SLO chunk budget and the KV plan), sends the KV manager the
step's one update (frees, commits, tier lookups, forks, grants, admissions, swaps) and
awaits its one answer (`_kv_round_trip`), and builds the runner's batch (`Scheduler.build`).
With `scheduler.overlap` (the default) it does that while the previous step runs, then
processes the previous step's outputs — one step ahead, as SGLang's overlap scheduler and
vLLM's async scheduling do:

- a running request is assumed to produce one token in the step in flight: the next step
  feeds it as a PLACEHOLDER that the runner fills from its own sample, and the request's
  `num_computed_tokens` advances when a step is launched, not when it returns;
- a request that finishes in step N (EOS, stop token, stop string) has its token of step
  N+1 discarded; its blocks go back with the next KV update (the runner executes steps in
  order, so nothing reuses them before N+1 is done); max_tokens and the context window are
  known ahead, so such requests are not scheduled past their last token.

With overlap off the same code runs serially: launch, wait for the output, process it
(`process_oldest_now` is the rule).

Speculative decoding (actors/speculation/controller.py decides, the runner proposes and
verifies): a speculating decode is scheduled as its last token plus k drafts; when its output
comes, the positions of rejected drafts are rolled back (num_computed_tokens) and prefix
blocks are committed only with verified tokens. A step that verifies or asks for proposals is
processed before the next step is planned, since how many tokens it yields is unknown.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from tokenloom.actors.base import Actor, resolve
from tokenloom.actors.messages import (
    AbortRequest,
    AddRequest,
    ForgetRequests,
    GetSchedulerStats,
    GetTrace,
    IsIdle,
    KVGrant,
    OffloadKV,
    SchedulerStats,
    SetLoRAAdapter,
    Shutdown,
    StepOutput,
    TierReady,
)
from tokenloom.actors.scheduling.scheduler import Scheduler
from tokenloom.actors.scheduling.step_batch import InFlightStep, StepPlan, process_oldest_now


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(self, core: Scheduler, *, inbox: asyncio.Queue, kv_inbox: asyncio.Queue,
                 kv_replies: asyncio.Queue, runner):
        """Drives `core`. `kv_inbox` / `kv_replies`: the KV manager's inbox and the queue
        its one answer per update comes back on; `runner`: the runner actor (its send())."""
        super().__init__(inbox)
        self.core = core
        self.overlap = core.config.overlap
        self.kv_inbox = kv_inbox
        self.kv_replies = kv_replies
        self.runner_actor = runner
        self.in_flight: deque[InFlightStep] = deque()
        self._step_outputs: dict[int, StepOutput] = {}
        self._stopping = False
        self._busy = False            # the previous iteration processed or launched a step
        self.last_step_time = time.monotonic()

    @property
    def _has_work(self) -> bool:
        return self.core.has_work or bool(self.in_flight)

    # -- inbox ---------------------------------------------------------------------------
    def _handle(self, msg) -> None:
        match msg:
            case AddRequest():
                self.core.add(msg)
            case AbortRequest(request_id=rid):
                self.core.abort(rid)
            case StepOutput():
                self._step_outputs[msg.step] = msg
            case TierReady(request_id=rid, report=report):
                self.core.tier_ready(rid, report)
            case GetSchedulerStats(reply=reply):
                resolve(reply, self.stats())
            case IsIdle(reply=reply):
                resolve(reply, not self._has_work)
            case SetLoRAAdapter(reply=reply, name=name, path=path):
                resolve(reply, self.core.set_lora_adapter(name, path))
            case GetTrace(reply=reply, request_id=rid):
                resolve(reply, [t.as_dict() for t in self.core.traces.find(rid)])
            case Shutdown():
                self._stopping = True
            case _:
                self.log.warning("unexpected message", type=type(msg).__name__)

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except asyncio.QueueEmpty:
                return
            self._handle(msg)

    # -- the loop ------------------------------------------------------------------------
    async def run(self) -> None:
        while not self._stopping:
            await self._receive()
            if not self._stopping and self._has_work:
                await self.step()
        while self.in_flight:  # let the runner finish what it was given
            await self._process(self.in_flight.popleft())
        self.core.cancel_all("engine shut down")

    async def _receive(self) -> None:
        """Handle what has arrived; block for a message only when nothing is queued,
        running or in flight."""
        core = self.core
        if not self._has_work:
            if core.view.has_pending_frees or core.pending_commits:
                await self._kv_round_trip(None)  # return blocks promptly even when idle
            if not core.has_work:  # (a request may have come meanwhile)
                if core.runner_finished:  # no next batch to carry them: tell the runner now
                    self.runner_actor.send(ForgetRequests(request_ids=core.runner_finished))
                    core.runner_finished = []
                if core.pending_offloads:  # the same for blocks bound for the KV tiers
                    self.runner_actor.send(OffloadKV(offloads=core.pending_offloads))
                    core.pending_offloads = []
                self._busy = False
                self._handle(await self.inbox.get())
                self.last_step_time = time.monotonic()  # the stall clock starts with work
        self._drain_inbox()

    async def step(self) -> None:
        """Plan and launch the next step; then process the oldest step in flight — with
        overlap, the previous one, while the new one runs. A step that speculates is
        processed before the next is planned (its requests' token counts are unknown)."""
        if any(step.serial for step in self.in_flight):
            while self.in_flight:
                await self._process(self.in_flight.popleft())
        launched = await self._schedule()
        if launched is not None:
            self.runner_actor.send(launched.batch)
            self.in_flight.append(launched)
        if process_oldest_now(len(self.in_flight), launched is not None, self.overlap):
            await self._process(self.in_flight.popleft())

    # -- planning ------------------------------------------------------------------------
    async def _schedule(self) -> InFlightStep | None:
        """plan -> one KV round trip -> build: the policy's decision from the scheduler's
        view of the pool, the KV manager's one atomic answer, then the runner's batch."""
        core = self.core
        t0 = time.perf_counter()
        continues = self._busy or bool(self.in_flight)
        plan = core.plan()
        t_kv = time.perf_counter()
        grant = await self._kv_round_trip(plan)
        kv_seconds = time.perf_counter() - t_kv
        core.settle(plan, grant)
        d = plan.decision
        if d.empty:
            if not (grant.swap_out or grant.swap_in or core.pending_copies
                    or core.pending_offloads):
                if (not core.running and core.waiting and not grant.freed
                        and not self.in_flight and not core.view.has_pending_frees
                        and not core.tier_released):
                    self._handle(await self.inbox.get())  # nothing fits or runs: wait
                return None
            # The copies this iteration resolved (fork copy-on-write, swaps) still have to
            # run, in this order, before a later forward reuses the blocks: a batch with no
            # sequences carries them. (Carried over to a later batch, they were once applied
            # after that batch's own copies, and a fork's copy landed in a block a swap-in
            # had just refilled.)
        return core.build(d, grant, kv_seconds, continues, t0)

    async def _kv_round_trip(self, plan: StepPlan | None) -> KVGrant:
        """The step's one message to the KV manager and its one answer, which becomes the
        scheduler's view of the pool. Nothing else is handled meanwhile: adds, aborts and
        step outputs wait in the inbox for the next receive."""
        update = self.core.kv_update(plan)
        self.kv_inbox.put_nowait(update)
        grant = await self.kv_replies.get()
        self.core.take_grant(update, grant)
        return grant

    # -- processing a step's outputs -------------------------------------------------------
    async def _process(self, launched: InFlightStep) -> None:
        step = launched.batch.step
        while step not in self._step_outputs:
            self._handle(await self.inbox.get())
        out = self._step_outputs.pop(step)
        now = time.monotonic()
        self.last_step_time = now
        self._busy = True
        self.core.process(launched, out, now)

    # -- observation ---------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return self.core.stats(len(self.in_flight), self.overlap)

    def stalled_seconds(self, now: float | None = None) -> float:
        """Seconds the loop has gone without completing a step while it has work; 0 when
        idle or progressing. Read directly (not through the inbox) so that a wedged engine
        can still be detected."""
        if not self._has_work:
            return 0.0
        now = time.monotonic() if now is None else now
        return max(0.0, now - self.last_step_time)
