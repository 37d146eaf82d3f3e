"""The scheduler actor: the engine loop. schedule() -> launch -> process().

Owns every Request (waiting and running). Each iteration `_schedule` plans the next step
(`_plan`: the policy, under the fair-share order, the SLO chunk budget and the KV plan),
gets exactly the blocks it needs from the KV manager in one atomic round trip (`_grant`),
and builds the runner's batch (`_build`). With `scheduler.overlap` (the default) it does
that while the previous step runs, then processes the previous step's outputs — one step
ahead, as SGLang's overlap scheduler and vLLM's async scheduling do:

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
verifies): a speculating decode is scheduled as its last token plus k drafts; when its output comes,
the positions of rejected drafts are rolled back (num_computed_tokens) and prefix blocks
are committed only with verified tokens. A step that verifies or asks for proposals is
processed before the next step is planned, since how many tokens it yields is unknown.

Concerns live in their own modules: policy.py (what runs), chunk_sizing.py (SLO prefill
budget), preemption.py (victims: swap or recompute), siblings.py (n > 1 forks),
step_observer.py (cost model, fair-share charges, skips, goodput, step times),
step_batch.py (decision + grant -> batch), kv_view.py (the pool as the KV manager last
reported it), and actors/output/output_processor.py (detokenization, stop strings and the
RequestOutputs streams are sent).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable

from tokenloom.actors.base import Actor, resolve
from tokenloom.actors.messages import (
    ERROR_INTERNAL,
    ERROR_INVALID,
    AbortRequest,
    AddRequest,
    ExecuteBatch,
    ForgetRequests,
    GetSchedulerStats,
    GetTrace,
    IsIdle,
    KVCommit,
    KVGrant,
    RequestOutput,
    SampledToken,
    SchedulerStats,
    Shutdown,
    StepOutput,
)
from tokenloom.actors.output.output_processor import OutputProcessor
from tokenloom.actors.scheduling import siblings
from tokenloom.actors.scheduling.chunk_sizing import ChunkSizer
from tokenloom.actors.scheduling.cost_model import StepCostModel
from tokenloom.actors.scheduling.fairness import FairShare
from tokenloom.actors.scheduling.kv_view import KVView
from tokenloom.actors.scheduling.policy import AdmissionParams, Decision, PolicyLimits, schedule
from tokenloom.actors.scheduling.preemption import Preemptor
from tokenloom.actors.scheduling.prefix_tracker import PrefixTracker
from tokenloom.actors.scheduling.request import FinishReason, Request, RequestStatus
from tokenloom.actors.scheduling.step_batch import (
    InFlightStep,
    apply_prefix_hits,
    build_batch,
    kv_update,
    note_plans,
    process_oldest_now,
    start_works,
)
from tokenloom.actors.scheduling.step_observer import StepObserver
from tokenloom.actors.scheduling.swap import SwapSpace
from tokenloom.actors.scheduling.trace import RequestTrace, TraceHistory
from tokenloom.actors.speculation.controller import SpecController
from tokenloom.config.schema import SchedulerConfig

S = RequestStatus


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(self, limits: PolicyLimits, eos_token_ids: tuple[int, ...], max_model_len: int,
                 emit: Callable[[RequestOutput], None], prefix: PrefixTracker | None = None,
                 config: SchedulerConfig | None = None, swap: SwapSpace | None = None,
                 block_bytes: int = 0, outputs: OutputProcessor | None = None,
                 spec: SpecController | None = None, spec_lookahead: int = 0):
        super().__init__()
        self.prefix = prefix or PrefixTracker("", limits.block_size, enabled=False)
        self.limits = limits
        self.config = cfg = config or SchedulerConfig(
            max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens)
        self.overlap = cfg.overlap
        self.fair = FairShare(cfg.tenant_weights, cfg.aging_seconds)
        self.cost = StepCostModel()
        self.chunks = ChunkSizer(cfg, limits.max_num_batched_tokens, self.cost)
        self.preemptor = Preemptor(cfg.preemption_mode, swap, block_bytes, self.cost)
        self.observer = StepObserver(cfg, self.cost, self.fair)
        self.outputs = outputs if outputs is not None else OutputProcessor(None)
        # Speculative decoding (None: off): proposals, the kill switch, acceptance counts.
        self.spec = spec
        self.spec_lookahead = spec_lookahead
        if spec is not None:
            spec.cost = self.cost
        self.traces = TraceHistory(cfg.trace_history)
        self.view = KVView(limits.num_blocks)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.emit = emit
        self.kv_inbox: asyncio.Queue | None = None      # wired by the engine
        self.runner_actor = None                        # wired by the engine (its send())
        # The one registry of live requests on the engine side, and its two queues.
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.in_flight: deque[InFlightStep] = deque()
        self._step_outputs: dict[int, StepOutput] = {}
        self._pending_commits: list[KVCommit] = []
        self._pending_copies: list[tuple[int, int]] = []   # fork copy-on-write, this batch
        self._runner_finished: list[str] = []
        self._arrivals = 0
        self._step = 0
        self._stopping = False
        self._busy = False            # the previous iteration processed or launched a step
        # KV plan hysteresis: after a preemption admission waits for the resume watermark.
        self._admission_paused = False
        self._watermark = int(cfg.kv_watermark * limits.num_blocks)
        self._resume_watermark = int(cfg.kv_resume_watermark * limits.num_blocks)
        self.num_forks = 0
        self.num_steps = 0
        self.num_kv_plan_waits = 0
        self.last_step_time = time.monotonic()

    # -- inbox ---------------------------------------------------------------------------
    def _handle(self, msg) -> None:
        match msg:
            case AddRequest():
                self._add(msg)
            case AbortRequest(request_id=rid):
                req = self.requests.get(rid)
                if req is not None:  # aborts are idempotent
                    self._finish(req, S.CANCELLED, FinishReason.ABORT)
            case StepOutput():
                self._step_outputs[msg.step] = msg
            case GetSchedulerStats(reply=reply):
                resolve(reply, self.stats())
            case IsIdle(reply=reply):
                resolve(reply, not self.waiting and not self.running and not self.in_flight)
            case GetTrace(reply=reply, request_id=rid):
                resolve(reply, [t.as_dict() for t in self.traces.find(rid)])
            case Shutdown():
                self._stopping = True
            case _:
                self.log.warning("unexpected message", type=type(msg).__name__)

    def _add(self, msg: AddRequest) -> None:
        if msg.request_id in self.requests:
            self.emit(RequestOutput(request_id=msg.request_id, new_token_ids=[], finished=True,
                                    finish_reason="error", error="duplicate request id",
                                    error_kind=ERROR_INVALID))
            return
        self._arrivals += 1
        req = Request(msg.request_id, msg.prompt_token_ids, msg.sampling_params,
                      eos_token_ids=self.eos_token_ids, arrival_time=msg.arrival_time,
                      max_model_len=self.max_model_len, meta=msg.meta,
                      arrival_seq=self._arrivals)
        req.trace = RequestTrace(req.request_id, msg.arrival_time, msg.routed_time, msg.meta,
                                 tokenized=msg.tokenized_time)
        if self.spec is not None:
            req.spec = self.spec.new_state(msg.sampling_params.speculative)
            if req.spec is not None:
                req.trace.speculation = (self.spec.method, req.spec)
        self.traces.add(req.trace)
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.outputs.start(req)

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
            if not self._stopping and (self.waiting or self.running or self.in_flight):
                await self.step()
        while self.in_flight:  # let the runner finish what it was given
            await self._process(self.in_flight.popleft())
        for req in list(self.waiting) + list(self.running):
            self._finish(req, S.CANCELLED, FinishReason.ABORT, error="engine shut down",
                         error_kind=ERROR_INTERNAL)

    async def _receive(self) -> None:
        """Handle what has arrived; block for a message only when nothing is queued,
        running or in flight."""
        if not self.waiting and not self.running and not self.in_flight:
            if self.view.has_pending_frees or self._pending_commits:
                await self._kv_update(None)  # return blocks promptly even when idle
            if not self.waiting and not self.running:  # (a request may have come meanwhile)
                if self._runner_finished:  # no next batch to carry them: tell the runner now
                    self.runner_actor.send(ForgetRequests(request_ids=self._runner_finished))
                    self._runner_finished = []
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
        """plan -> grant -> build: the policy's decision from the scheduler's view of the
        pool, the KV manager's one atomic answer, then the runner's batch."""
        t0 = time.perf_counter()
        continues = self._busy or bool(self.in_flight)
        await self._fork_siblings()
        d, swap_outs, swap_ins = self._plan()
        t_kv = time.perf_counter()
        grant = await self._grant(d, swap_outs, swap_ins)
        kv_seconds = time.perf_counter() - t_kv
        if d.empty:
            if not (grant.swap_out or grant.swap_in or self._pending_copies):
                if (not self.running and self.waiting and not grant.freed
                        and not self.in_flight and not self.view.has_pending_frees):
                    self._handle(await self.inbox.get())  # nothing fits or runs: wait
                return None
            # The copies this iteration resolved (fork copy-on-write, swaps) still have to
            # run, in this order, before a later forward reuses the blocks: a batch with no
            # sequences carries them. (Carried over to a later batch, they were once applied
            # after that batch's own copies, and a fork's copy landed in a block a swap-in
            # had just refilled.)
        return self._build(d, grant, kv_seconds, continues, t0)

    def _plan(self) -> tuple[Decision, list, list]:
        """The policy's decision, applied to the queues: preemption victims out (their swap
        copies resolved), rejections ended, swap-ins and admissions in."""
        waiting = self.fair.order(siblings.admissible(self.waiting, self.requests,
                                                      self.prefix.enabled), time.monotonic())
        drafts = self.spec.plan_step(self.running) if self.spec is not None else None
        d = schedule(self.running, waiting, self.view.num_free_blocks, self.view.held,
                     self.limits, self.view.freeable,
                     prefill_budget=self.chunks.prefill_budget(self.running, waiting, drafts),
                     admission=self._admission_params(),
                     preempt_mode=self.preemptor.mode_fn(self.view),
                     drafts=drafts, spec_lookahead=self.spec_lookahead)
        swap_outs = self.preemptor.apply(d, self.view, self.running, self.waiting)
        if d.blocked is not None and d.blocked[1] == "kv":
            self.num_kv_plan_waits += 1
        if d.preempted:
            self._admission_paused = True
        for req, why in d.rejected:
            self._finish(req, S.FINISHED, FinishReason.ERROR, error=why, error_kind=ERROR_INVALID)
        swap_ins = self.preemptor.swap_ins(d)   # (their slots are released here)
        self._admit(d)
        return d, swap_outs, swap_ins

    async def _grant(self, d: Decision, swap_outs, swap_ins) -> KVGrant:
        """The decision's blocks in one round trip; admitted requests start after their
        cached prefix. Requests ended meanwhile (aborts handled during the round trip, or
        an allocation that failed for them alone) leave the decision."""
        grant = await self._kv_update(d, swap_outs=swap_outs, swap_ins=swap_ins)
        for rid, why in grant.failed.items():
            if (req := self.requests.get(rid)) is not None:
                self._finish(req, S.FINISHED, FinishReason.ERROR, error=why,
                             error_kind=ERROR_INTERNAL)
        apply_prefix_hits(d, grant, self.limits.block_size)
        note_plans(d, time.monotonic())
        d.decodes = [w for w in d.decodes if not w.request.is_finished]
        d.prefills = [w for w in d.prefills if not w.request.is_finished]
        return grant

    def _build(self, d: Decision, grant: KVGrant, kv_seconds: float, continues: bool,
               t0: float) -> InFlightStep:
        """The runner's batch: the works with their block tables, the copies to apply
        first, and the requests whose runner state can go (`t0`: when planning began)."""
        if not d.empty:
            start_works(d, time.monotonic())
            self.observer.count_skips(d, self.running)
        self._step += 1
        finished, self._runner_finished = self._runner_finished, []
        copies, self._pending_copies = self._pending_copies, []
        batch, works, starts, epochs = build_batch(d, grant.tables, ExecuteBatch(
            step=self._step, sequences=[], num_decodes=len(d.decodes), finished_ids=finished,
            block_copies=copies, swap_out=grant.swap_out, swap_in=grant.swap_in), self.spec)
        serial = any(s.num_draft or s.propose for s in batch.sequences)
        return InFlightStep(d, batch, works, starts, epochs, time.perf_counter() - t0,
                            kv_seconds, continues, serial)

    async def _fork_siblings(self) -> None:
        """n > 1: siblings whose sibling 0 has computed the prompt start from its blocks.
        An extra KV round trip, only in the step after such a prompt completes."""
        forks = siblings.fork_candidates(self.waiting, self.requests, self.view,
                                         self.limits.max_num_seqs - len(self.running),
                                         self.prefix.enabled)
        if not forks:
            return
        grant = await self._kv_update(None, forks=forks)
        made, orphans = siblings.apply_forks(grant.forked, self.requests, self.waiting,
                                             self.running, self.limits.block_size)
        self.num_forks += made
        for child_id in orphans:   # aborted during the round trip: free its new table
            self.view.release(child_id)
        self._pending_copies.extend(grant.copies)

    def _admission_params(self) -> AdmissionParams:
        """The watermark, raised after a preemption until the pool has recovered."""
        if self._admission_paused and self.view.num_free_blocks >= self._resume_watermark:
            self._admission_paused = False
        floor = self._resume_watermark if self._admission_paused else self._watermark
        return AdmissionParams(min_free_blocks=floor,
                               lookahead_tokens=self.config.admission_lookahead_tokens)

    def _admit(self, d: Decision) -> None:
        now = time.monotonic()
        for req in d.admitted:
            self.waiting.remove(req)
            self.running.append(req)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now

    async def _kv_update(self, d: Decision | None, *, forks=(), swap_outs=(),
                         swap_ins=()) -> KVGrant:
        """One round trip to the KV manager: queued commits and frees, the decision's
        grants and admissions (or forks); the answer becomes the scheduler's view."""
        update = kv_update(d, self.view.take_frees(), self._pending_commits, self.running,
                           self.prefix.query, forks, swap_outs, swap_ins)
        self.kv_inbox.put_nowait(update)
        self._pending_commits = []
        grant = await self._reply(KVGrant)
        if grant.new_blocks is None:
            # Cannot happen while the view is a lower bound of what is free: fail loudly.
            raise AssertionError(f"KV manager refused a decision made from its own report: "
                                 f"{update.grants} {update.admissions}")
        self.view.update(grant)
        return grant

    async def _reply(self, kind: type):
        """Wait for a reply of `kind`; adds, aborts and step outputs are handled meanwhile."""
        while True:
            msg = await self.inbox.get()
            if isinstance(msg, kind):
                return msg
            self._handle(msg)

    # -- processing a step's outputs -------------------------------------------------------
    async def _process(self, launched: InFlightStep) -> None:
        out = self._step_outputs.pop(launched.batch.step, None)
        if out is None:
            out = await self._reply_step(launched.batch.step)
        t0 = time.perf_counter()
        now = time.monotonic()
        self.num_steps += 1
        self.last_step_time = now
        self._busy = True
        d = launched.decision
        works = launched.works
        if out.error is not None:
            for w in works:
                if not w.request.is_finished:
                    self._finish(w.request, S.FINISHED, FinishReason.ERROR, error=out.error,
                                 error_kind=ERROR_INTERNAL)
            return
        predicted = self.observer.observe_step(d, launched.batch, out.compute_seconds)
        if self.spec is not None and not d.prefills:
            self.spec.calibrate(len(d.decodes), any(s.num_draft for s in launched.batch.sequences),
                                predicted, out.compute_seconds)
        self.preemptor.observe_swap(len(launched.batch.swap_out) + len(launched.batch.swap_in),
                                    out.swap_seconds)
        spec = {r.request_id: r for r in out.spec}
        computed = []
        for w, start, epoch in zip(works, launched.starts, launched.epochs):
            req = w.request
            if req.is_finished or req.num_preemptions != epoch:
                continue  # ended or preempted since: its KV is gone or elsewhere
            upto = start + w.num_tokens
            result = spec.get(req.request_id)
            if result is not None and result.num_draft:
                # Rejected drafts' KV is not the request's: roll their positions back (the
                # blocks stay in its table and are overwritten by the tokens to come).
                rejected = result.num_draft - result.num_accepted
                req.num_computed_tokens -= rejected
                upto -= rejected
                self.spec.observe(req.spec, result.num_draft, result.num_accepted)
            computed.append((req, upto))
            self._trace_prefill(req, upto, now)
        for s in out.sampled:
            req = self.requests.get(s.request_id)
            if req is not None:
                self._sampled(req, s, now)
        # After the tokens are appended: an accepted draft's block is hashed with it. A
        # request that finished just now still commits (the KV manager applies commits
        # before frees).
        for req, upto in computed:
            # (tokens after a stop that ended it mid-verification are not its tokens)
            commit = self.prefix.commit(req, min(upto, len(req.token_ids)))
            if commit is not None:
                self._pending_commits.append(commit)
        if self.spec is not None:
            if out.draft_seconds:
                self.spec.observe_draft_time(out.draft_seconds)
            for result in out.spec:
                req = self.requests.get(result.request_id)
                if req is not None and req.spec is not None:
                    req.draft_token_ids = result.proposals
        host = launched.host_seconds + time.perf_counter() - t0
        exposed = out.idle_seconds if launched.continues else 0.0
        self.observer.observe_times(out.compute_seconds, host, exposed, launched.kv_seconds,
                                    len(works))

    async def _reply_step(self, step: int) -> StepOutput:
        while step not in self._step_outputs:
            self._handle(await self.inbox.get())
        return self._step_outputs.pop(step)

    def _trace_prefill(self, req: Request, upto: int, now: float) -> None:
        """A completed step computed req's tokens before `upto`: trace prefill progress."""
        trace = req.trace
        if trace is not None and req.status == S.PREFILLING:
            trace.prefill_chunks += 1
            if upto >= req.num_prompt_tokens and not trace.has("prefill_finished"):
                trace.mark("prefill_finished", now)

    def _sampled(self, req: Request, s: SampledToken, now: float) -> None:
        """A sampled token came back: append it, detokenize it, finish on a stop condition
        (a stop string included) or stream it."""
        if s.error is not None:   # e.g. a guided request whose grammar allows no token
            self._finish(req, S.FINISHED, FinishReason.ERROR, error=s.error,
                         error_kind=ERROR_INVALID)
            return
        req.append_token(s.token_id, now)
        if req.spec is not None and req.spec.shadow is not None:
            self.spec.score_shadow(req.spec, s.token_id)
        if req.trace is not None:
            req.trace.token(now)
        lps = [s.logprob] if s.logprob is not None else None
        try:
            text, stopped = self.outputs.text(req, (s.token_id,))
        except Exception as e:  # noqa: BLE001 - a detokenizer failure ends only its request
            self.log.error("detokenization failed", request_id=req.request_id, error=repr(e))
            self._finish(req, S.FINISHED, FinishReason.ERROR, new_tokens=[s.token_id],
                         error=f"detokenization failed: {e!r}", error_kind=ERROR_INTERNAL)
            return
        reason = FinishReason.STOP if stopped else req.check_stop()
        if reason is not None:
            self._finish(req, S.FINISHED, reason, new_tokens=[s.token_id], new_logprobs=lps,
                         text=text)
            return
        if req.status == S.PREFILLING:
            req.transition(S.WAITING_DECODE)
        self.emit(self.outputs.token_output(req, s.token_id, text, lps))

    # -- finishing -----------------------------------------------------------------------
    def _finish(self, req: Request, status: RequestStatus, reason: FinishReason,
                error: str | None = None, new_tokens: list[int] | None = None,
                new_logprobs=None, error_kind: str | None = None, text: str = "") -> None:
        """End req: out of the queues, blocks queued to be freed with the next KV update,
        runner state dropped with the next batch, final output emitted."""
        rid = req.request_id
        if req in self.running:  # (admitted this iteration, it may still say WAITING_PREFILL)
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.transition(status)
        req.finish_reason = reason
        req.error = error
        self.requests.pop(rid, None)
        self.observer.observe_finished(req, reason)
        trace = req.trace
        if trace is not None:
            trace.finish_reason = reason.as_openai()
            if req.first_token_time is not None and reason in (FinishReason.STOP,
                                                                FinishReason.LENGTH):
                trace.mark("final_token", req.token_times[-1] if req.token_times else None)
        if req.swapped_slots is not None:
            self.preemptor.swap.release(req.swapped_slots)
            req.swapped_slots = None
        if req.first_scheduled_time is not None:  # it may hold blocks
            if trace is not None and self.view.held(rid):
                trace.mark("kv_blocks_released")
            self.view.release(rid)
        if req.on_runner:
            self._runner_finished.append(rid)
            req.on_runner = False
        out = self.outputs.final_output(req, reason, text=text, new_tokens=new_tokens,
                                        new_logprobs=new_logprobs, error=error,
                                        error_kind=error_kind)
        self.emit(out)
        if out.timings.trace is not None:
            self.log.info("trace", request_id=rid, trace=out.timings.trace)

    # -- observation ---------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        p, o = self.preemptor, self.observer
        return SchedulerStats(
            waiting=len(self.waiting), running=len(self.running),
            in_flight_steps=len(self.in_flight), overlap=self.overlap,
            num_steps=self.num_steps, num_forks=self.num_forks,
            num_preemptions=p.num_preemptions, num_swap_preemptions=p.num_swap_preemptions,
            num_free_blocks=self.view.num_free_blocks, max_decode_skip=o.max_decode_skip,
            admission_paused=self._admission_paused, prefill_budget=self.chunks.last_budget,
            cost_model=None if self.cost.coef is None else [float(c) for c in self.cost.coef],
            swap_free_slots=None if p.swap is None else p.swap.num_free,
            num_slo_evaluated=o.num_slo_evaluated, num_slo_good=o.num_slo_good,
            num_kv_plan_waits=self.num_kv_plan_waits, timings=o.timings(),
            spec=self.spec.stats() if self.spec is not None else None)

    def stalled_seconds(self, now: float | None = None) -> float:
        """Seconds the loop has gone without completing a step while it has work; 0 when
        idle or progressing. Read directly (not through the inbox) so that a wedged engine
        can still be detected."""
        if not self.waiting and not self.running and not self.in_flight:
            return 0.0
        now = time.monotonic() if now is None else now
        return max(0.0, now - self.last_step_time)

