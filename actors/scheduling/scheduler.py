"""The scheduler's synchronous core: every Request (waiting and running), what the next step
runs, and what a finished step's outputs do to the requests. No asyncio: the actor shell
(scheduler_actor.py) owns the inbox, the loop and the round trips to the KV manager and the
runner, and calls in here between them.

One iteration, as the shell drives it (one message each way between the scheduler and
the KV manager per step):

    plan = core.plan()                        # the policy's decision, forks, swaps
    update = core.kv_update(plan)             # -> KV manager; its KVGrant comes back
    core.take_grant(update, grant)            # the scheduler's view of the pool
    core.settle(plan, grant)                  # forks join, failures end, prefix hits apply
    step = core.build(plan.decision, grant, ...)   # the runner's batch
    ...
    core.process(step, out)                   # the step's tokens: stream, stop, commit

Concerns live in their own modules: policy.py (what runs), chunk_sizing.py (SLO prefill
budget), preemption.py (victims: swap or recompute), siblings.py (n > 1 forks),
step_observer.py (cost model, fair-share charges, skips, goodput, step times),
step_batch.py (decision + grant -> batch), kv_view.py (the pool as the KV manager last
reported it), and actors/output/output_processor.py (detokenization, stop strings and the
RequestOutputs streams are sent).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Callable

import structlog

from tokenloom.actors.messages import (
    ERROR_INTERNAL,
    ERROR_INVALID,
    AddRequest,
    ExecuteBatch,
    KVCommit,
    KVGrant,
    KVUpdate,
    LoRAStats,
    RequestOutput,
    SampledToken,
    SchedulerStats,
    StepOutput,
    TierQuery,
)
from tokenloom.actors.output.output_processor import OutputProcessor
from tokenloom.actors.scheduling import siblings
from tokenloom.actors.scheduling.chunk_sizing import ChunkSizer
from tokenloom.actors.scheduling.cost_model import StepCostModel
from tokenloom.actors.scheduling.fairness import FairShare
from tokenloom.actors.scheduling.kv_view import KVView
from tokenloom.actors.scheduling.lora_slots import AdapterSlots
from tokenloom.actors.scheduling.policy import AdmissionParams, Decision, PolicyLimits, schedule
from tokenloom.actors.scheduling.preemption import Preemptor
from tokenloom.actors.scheduling.prefix_tracker import PrefixTracker
from tokenloom.actors.scheduling.request import FinishReason, Request, RequestStatus
from tokenloom.actors.scheduling.step_batch import (
    InFlightStep,
    StepPlan,
    apply_prefix_hits,
    build_batch,
    kv_update,
    note_plans,
    start_works,
)
from tokenloom.actors.scheduling.step_observer import StepObserver
from tokenloom.actors.scheduling.swap import SwapSpace
from tokenloom.actors.scheduling.trace import RequestTrace, TraceHistory
from tokenloom.actors.speculation.controller import SpecController
from tokenloom.config.schema import SchedulerConfig

S = RequestStatus


class Scheduler:
    def __init__(self, limits: PolicyLimits, eos_token_ids: tuple[int, ...], max_model_len: int,
                 emit: Callable[[RequestOutput], None], prefix: PrefixTracker | None = None,
                 config: SchedulerConfig | None = None, swap: SwapSpace | None = None,
                 block_bytes: int = 0, outputs: OutputProcessor | None = None,
                 spec: SpecController | None = None, spec_lookahead: int = 0,
                 tiers=None, recompute_prior_s_per_token: float = 5e-4,
                 lora: AdapterSlots | None = None, long_rope_window: int | None = None):
        """`long_rope_window`: a longrope model's original window (a request longer than it
        rotates with the long factors throughout; one that grows past it is recomputed)."""
        self.log = structlog.get_logger("tokenloom.scheduler").bind(actor="scheduler")
        self.prefix = prefix or PrefixTracker("", limits.block_size, enabled=False)
        self.limits = limits
        self.config = cfg = config or SchedulerConfig(
            max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens)
        self.fair = FairShare(cfg.tenant_weights, cfg.aging_seconds)
        self.cost = StepCostModel()
        self.chunks = ChunkSizer(cfg, limits.max_num_batched_tokens, self.cost, limits.block_size)
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
        # The one registry of live requests on the engine side, and its two queues.
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pending_commits: list[KVCommit] = []
        self.pending_copies: list[tuple[int, int]] = []   # fork copy-on-write, this batch
        # Finished requests whose runner state can go: carried by the next batch.
        self.runner_finished: list[str] = []
        self._arrivals = 0
        self._step = 0
        # KV plan hysteresis: after a preemption admission waits for the resume watermark.
        self._admission_paused = False
        self._watermark = int(cfg.kv_watermark * limits.num_blocks)
        self._resume_watermark = int(cfg.kv_resume_watermark * limits.num_blocks)
        self.num_forks = 0
        self.num_steps = 0
        self.num_kv_plan_waits = 0
        # KV tiers (actors/kv/tiers): new arrivals to look up below the device pool before
        # they may be admitted, requests that ended before admission (their staging goes),
        # device blocks to copy down with the next batch. `tiers` (the TierManager) is told
        # how each restore turned out (its regret and the recompute prediction's error).
        self.tiers = tiers if self.prefix.enabled else None
        self.recompute_prior = recompute_prior_s_per_token
        self.tier_pending: list[Request] = []
        self.tier_cancels: list[str] = []
        self.pending_offloads: list = []
        self.tier_released = False   # a held request became admissible since the last plan
        # Multi-LoRA serving (None: off): the registry and the device slots' occupants.
        self.lora = lora
        self.long_rope_window = long_rope_window

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- arrivals and aborts ---------------------------------------------------------------
    def add(self, msg: AddRequest) -> None:
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
        window = self.long_rope_window
        req.rope_long = window is not None and req.num_prompt_tokens > window
        req.trace = RequestTrace(req.request_id, msg.arrival_time, msg.routed_time, msg.meta,
                                 tokenized=msg.tokenized_time)
        # A draft model knows nothing of the target's adapter: its proposals would be
        # drafted for the base model, so adapter requests do not speculate with one.
        if self.spec is not None and not (req.lora_name and self.spec.method == "draft"):
            req.spec = self.spec.new_state(msg.sampling_params.speculative)
            if req.spec is not None:
                req.trace.speculation = (self.spec.method, req.spec)
        self.traces.add(req.trace)
        if self.lora is not None:
            self.lora.arrived(req)
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.outputs.start(req)
        if self.tiers is not None and not req.wants_prompt_logprobs:
            req.tier_hold = True          # until the tiers have been looked up
            req.cached_tokens_by_tier = {}
            self.tier_pending.append(req)

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:  # aborts are idempotent
            self.finish(req, S.CANCELLED, FinishReason.ABORT)

    def set_lora_adapter(self, name: str, path: str | None) -> bool:
        """Register (path) or unregister (None) an adapter; whether it was known."""
        if self.lora is None:
            return False
        known = name in self.lora.paths
        if path is None:
            self.lora.unregister(name)
        else:
            self.lora.register(name, path)
        return known

    def cancel_all(self, why: str) -> None:
        for req in list(self.waiting) + list(self.running):
            self.finish(req, S.CANCELLED, FinishReason.ABORT, error=why,
                        error_kind=ERROR_INTERNAL)

    # -- planning --------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """The step's KV work: n > 1 siblings to fork from their sibling 0 (their blocks
        reserved, so the decision's grants still fit), and the policy's decision over the
        rest, applied to the queues: preemption victims out (their swap copies resolved),
        rejections ended, swap-ins and admissions in."""
        self.tier_released = False
        running = self._long_rope_gate()
        forks = self.fork_candidates()
        self.view.reserve(len(forks) * self.limits.num_groups)   # a copy per group each
        admissible = siblings.admissible(self.waiting, self.requests, self.prefix.enabled)
        if forks:   # (they join the running queue with the KV manager's answer)
            forking = {child for _, child, _ in forks}
            admissible = [r for r in admissible if r.request_id not in forking]
        if self.tiers is not None and any(r.tier_hold for r in admissible):
            admissible = [r for r in admissible if not r.tier_hold]
        slot_plan = None
        if self.lora is not None:
            slot_plan = self.lora.admissible(admissible, self.lora.touch(self.running))
            for req in slot_plan.unknown:
                self.finish(req, S.FINISHED, FinishReason.ERROR,
                            error=f"the LoRA adapter {req.lora_name!r} has been unloaded",
                            error_kind=ERROR_INVALID)
            admissible = slot_plan.admissible
        waiting = self.fair.order(admissible, time.monotonic())
        drafts = self.spec.plan_step(running) if self.spec is not None else None
        if drafts and self.long_rope_window is not None:
            drafts = self._short_rope_drafts(drafts)
        # Forked siblings join the running queue with the KV manager's answer: their
        # sequence slots are kept free too.
        limits = (self.limits if not forks else dataclasses.replace(
            self.limits, max_num_seqs=self.limits.max_num_seqs - len(forks)))
        d = schedule(running, waiting, self.view.num_free_blocks, self.view.held,
                     limits, self.view.freeable,
                     prefill_budget=self.chunks.prefill_budget(self.running, waiting, drafts),
                     admission=self._admission_params(),
                     preempt_mode=self.preemptor.mode_fn(self.view),
                     drafts=drafts, spec_lookahead=self.spec_lookahead,
                     table_blocks=self.view.table_blocks)
        swap_outs = self.preemptor.apply(d, self.view, self.running, self.waiting)
        if forks and d.preempted:   # a sibling 0 preempted now is not forked from
            victims = {r.request_id for r in d.preempted}
            forks = [f for f in forks if f[0] not in victims]
        if d.blocked is not None and d.blocked[1] == "kv":
            self.num_kv_plan_waits += 1
        if d.preempted:
            self._admission_paused = True
        for req, why in d.rejected:
            self.finish(req, S.FINISHED, FinishReason.ERROR, error=why, error_kind=ERROR_INVALID)
        swap_ins = self.preemptor.swap_ins(d)   # (their slots are released here)
        self._admit(d)
        if slot_plan is not None:
            self.lora.admit(d.admitted, slot_plan)
        return StepPlan(d, forks, swap_outs, swap_ins)

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

    def kv_update(self, plan: StepPlan | None) -> KVUpdate:
        """The step's one message to the KV manager: queued commits and frees, new
        arrivals' tier lookups, the plan's forks, grants, admissions and swaps (None: an
        idle update that only returns blocks and commits)."""
        update = kv_update(plan, self.view.take_frees(), self.pending_commits, self.running,
                           self.prefix.query)
        groups = self.limits.kv_groups
        if groups is not None and groups.hybrid:
            # Every running request's sliding groups drop what is behind their windows,
            # scheduled this step or not: the policy does not count those blocks back
            # before the KV manager reports them free, so a pool that only fits once they
            # are dropped would otherwise wait for a step that never comes.
            update.computed = {r.request_id: r.num_computed_tokens for r in self.running}
        self.pending_commits = []
        if self.tier_pending or self.tier_cancels:
            update.tier_queries = self._tier_queries()
            update.tier_cancels, self.tier_cancels = self.tier_cancels, []
        return update

    def _tier_queries(self) -> list[TierQuery]:
        """The pending arrivals' lookups, each with the prefill cost at the current load."""
        pending, self.tier_pending = self.tier_pending, []
        decodes = [r for r in self.running if r.is_decode]
        from tokenloom.actors.kv.tiers.planner import RecomputeCost
        cost = RecomputeCost(
            coef=None if not self.cost.knows_prefill else tuple(float(c) for c in self.cost.coef),
            decode_tokens=len(decodes),
            decode_reads=sum(r.num_computed_tokens for r in decodes) / 1e6,
            chunk_tokens=self.chunks.steady_budget(self.running),
            # Before the model is fitted: the prefill speed measured so far (the engine's
            # warm-up is one), else the configured prior.
            prior_s_per_token=self.observer.prefill_s_per_token or self.recompute_prior)
        now = time.monotonic()
        out = []
        for req in pending:
            if req.is_finished:
                continue
            if req.trace is not None:
                req.trace.mark("kv_tier_lookup", now)
            out.append(TierQuery(request_id=req.request_id, query=self.prefix.query(req),
                                 recompute=cost))
        return out

    def tier_ready(self, request_id: str, report) -> None:
        """A held request's tier fetch has ended: it may be admitted (its restore staged)."""
        req = self.requests.get(request_id)
        if req is None:
            return
        req.tier_hold = False
        self.tier_released = True
        if req.trace is not None:
            if report.fetch_seconds:
                req.trace.mark("kv_tier_ready")
            req.trace.tiers = {"plan": report.plan, "staged_tokens":
                               report.staged_blocks * self.limits.block_size,
                               "fetch_ms": round(report.fetch_seconds * 1e3, 3),
                               "failed": report.failed}

    def take_grant(self, update: KVUpdate, grant: KVGrant) -> None:
        """The KV manager's answer becomes the scheduler's view of the pool."""
        if grant.new_blocks is None:
            # Cannot happen while the view is a lower bound of what is free: fail loudly.
            raise AssertionError(f"KV manager refused a decision made from its own report: "
                                 f"{update.grants} {update.admissions}")
        self.view.update(grant)
        for report in grant.tier_ready:   # decided at once: admissible now
            self.tier_ready(report.request_id, report)
        self.pending_offloads.extend(grant.offloads)

    def settle(self, plan: StepPlan, grant: KVGrant) -> None:
        """After the grant: forked siblings join the running queue (from the next step);
        admitted requests start after their cached prefix; requests whose allocation failed
        for them alone end and leave the decision."""
        if plan.forks:
            self.take_forks(grant)
        d = plan.decision
        for rid, why in grant.failed.items():
            if (req := self.requests.get(rid)) is not None:
                self.finish(req, S.FINISHED, FinishReason.ERROR, error=why,
                            error_kind=ERROR_INTERNAL)
        for rid, plan in grant.tier_plans.items():
            req = self.requests.get(rid)
            if req is not None and req.trace is not None:
                tiers = req.trace.tiers if req.trace.tiers is not None else {}
                tiers["plan"] = plan
                tiers.setdefault("fetch_ms", 0.0)
                req.trace.tiers = tiers
        apply_prefix_hits(d, grant, self.limits.block_size)
        note_plans(d, time.monotonic())
        d.decodes = [w for w in d.decodes if not w.request.is_finished]
        d.prefills = [w for w in d.prefills if not w.request.is_finished]

    def build(self, d: Decision, grant: KVGrant, kv_seconds: float, continues: bool,
              t0: float) -> InFlightStep:
        """The runner's batch: the works with their block tables, the copies to apply
        first, and the requests whose runner state can go (`t0`: when planning began)."""
        if not d.empty:
            start_works(d, time.monotonic())
            self.observer.count_skips(d, self.running)
        self._step += 1
        finished, self.runner_finished = self.runner_finished, []
        copies, self.pending_copies = self.pending_copies, []
        offloads, self.pending_offloads = self.pending_offloads, []
        restores = [r for g in grant.admitted.values() for r in g.restores]
        batch, works, starts, epochs = build_batch(d, grant.tables, grant.group_tables,
                                                   ExecuteBatch(
            step=self._step, sequences=[], num_decodes=len(d.decodes), finished_ids=finished,
            block_copies=copies, swap_out=grant.swap_out, swap_in=grant.swap_in,
            kv_offloads=offloads, kv_restores=restores,
            lora_loads=self.lora.take_loads() if self.lora is not None else []), self.spec)
        serial = any(s.num_draft or s.propose for s in batch.sequences)
        return InFlightStep(d, batch, works, starts, epochs, time.perf_counter() - t0,
                            kv_seconds, continues, serial)

    def fork_candidates(self):
        """n > 1: siblings whose sibling 0 has computed the prompt, to start from its
        blocks (forked by the step's KV update, before its grants)."""
        return siblings.fork_candidates(self.waiting, self.requests, self.view,
                                        self.limits.max_num_seqs - len(self.running),
                                        self.prefix.enabled, self.limits.num_groups)

    def take_forks(self, grant: KVGrant) -> None:
        for child_id in grant.unforkable:
            if (child := self.requests.get(child_id)) is not None:
                child.fork_refused = True
        made, orphans = siblings.apply_forks(grant.forked, self.requests, self.waiting,
                                             self.running, self.limits.block_size)
        self.num_forks += made
        if self.lora is not None:
            # A forked sibling enters without admission: it runs in the slot of its adapter,
            # resident since sibling 0 (running with it) computed the shared prompt.
            for child_id in grant.forked:
                child = self.requests.get(child_id)
                if child is not None and child.lora_name is not None:
                    slot = self.lora.resident(child.lora_name)
                    assert slot is not None, f"{child_id}: its adapter left the device"
                    child.lora_slot = slot
        for child_id in orphans:   # ended before its fork landed: free its new table
            self.view.release(child_id)
        if self.tiers is not None:  # forked, not admitted: their tier lookups are moot
            self.tier_cancels.extend(grant.forked)
        self.pending_copies.extend(grant.copies)

    # -- processing a step's outputs -------------------------------------------------------
    def process(self, launched: InFlightStep, out: StepOutput, now: float) -> None:
        """The step's outputs: drafts rolled back, prefill progress traced, tokens
        appended and streamed (or requests ended), computed blocks committed."""
        t0 = time.perf_counter()
        self.num_steps += 1
        d = launched.decision
        works = launched.works
        if out.error is not None:
            for w in works:
                if not w.request.is_finished:
                    self.finish(w.request, S.FINISHED, FinishReason.ERROR, error=out.error,
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
        for p in out.prompt_logprobs:   # before the first token, which carries them out
            req = self.requests.get(p.request_id)
            if req is not None:
                req.add_prompt_logprobs(p.start, p.logprobs)
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
                self.pending_commits.append(commit)
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

    def _long_rope_gate(self) -> list[Request]:
        """The running requests the policy may schedule. A longrope request about to compute
        a position past the original window is recomputed with the long factors throughout,
        as transformers drops its cache at that point: its KV goes (a recompute
        preemption), its chain is hashed again under the long identity, and it re-enters
        the waiting queue first. One whose token is still being sampled by the step in
        flight waits a step for it (a skip) and is recomputed then."""
        window = self.long_rope_window
        if window is None:
            return self.running
        due = [r for r in self.running if not r.rope_long and r.num_computed_tokens >= window]
        if not due:
            return self.running
        for req in due:
            if not req.num_placeholders:   # (else its token comes with the step in flight)
                req.rope_long = True
                self.prefix.forget_hashes(req)
                self.preemptor.restart(req, self.view, self.running, self.waiting,
                                       "long_rope")
        return [r for r in self.running if r.rope_long or r.num_computed_tokens < window]

    def _short_rope_drafts(self, drafts: dict[str, int]) -> dict[str, int]:
        """Drafts a short-rope request verifies must stay within the original window (a
        position past it is computed only after the recompute)."""
        window = self.long_rope_window
        out = {}
        for rid, k in drafts.items():
            req = self.requests.get(rid)
            if req is not None and not req.rope_long:
                k = max(0, min(k, window - 1 - req.num_computed_tokens))
            out[rid] = k
        return out

    def _trace_prefill(self, req: Request, upto: int, now: float) -> None:
        """A completed step computed req's tokens before `upto`: trace prefill progress."""
        trace = req.trace
        if trace is not None and req.status == S.PREFILLING:
            trace.prefill_chunks += 1
            if upto >= req.num_prompt_tokens and not trace.has("prefill_finished"):
                trace.mark("prefill_finished", now)
                if trace.tiers is not None and trace.tiers.get("plan"):
                    self._tier_outcome(req, trace, now)

    def _tier_outcome(self, req: Request, trace, now: float) -> None:
        """The restore decision against what happened: the fetch's and the prefill's
        actual times, and the regret (actual minus the better alternative's prediction)."""
        plan = trace.tiers["plan"]
        admitted = next((t for name, t in reversed(trace.events) if name == "admitted"), None)
        if admitted is None:
            return
        prefill_s = now - admitted
        actual = trace.tiers["fetch_ms"] / 1e3 + prefill_s
        restored = plan["restore_tokens"] > 0
        alternative = (plan["predicted_all_recompute_ms"] if restored
                       else plan["predicted_all_restore_ms"]) / 1e3
        regret = actual - alternative if plan["available_tokens"] else None
        trace.tiers["actual_prefill_ms"] = round(prefill_s * 1e3, 3)
        trace.tiers["actual_ms"] = round(actual * 1e3, 3)
        trace.tiers["regret_ms"] = None if regret is None else round(regret * 1e3, 3)
        if self.tiers is not None:
            self.tiers.observe_outcome(plan["predicted_recompute_ms"] / 1e3, prefill_s, regret)

    def _sampled(self, req: Request, s: SampledToken, now: float) -> None:
        """A sampled token came back: append it, detokenize it, finish on a stop condition
        (a stop string included) or stream it."""
        if s.error is not None:   # e.g. a guided request whose grammar allows no token
            self.finish(req, S.FINISHED, FinishReason.ERROR, error=s.error,
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
            self.finish(req, S.FINISHED, FinishReason.ERROR, new_tokens=[s.token_id],
                        error=f"detokenization failed: {e!r}", error_kind=ERROR_INTERNAL)
            return
        reason = FinishReason.STOP if stopped else req.check_stop()
        if reason is not None:
            self.finish(req, S.FINISHED, reason, new_tokens=[s.token_id], new_logprobs=lps,
                        text=text)
            return
        if req.status == S.PREFILLING:
            req.transition(S.WAITING_DECODE)
        self.emit(self.outputs.token_output(req, s.token_id, text, lps))

    # -- finishing -----------------------------------------------------------------------
    def finish(self, req: Request, status: RequestStatus, reason: FinishReason,
               error: str | None = None, new_tokens: list[int] | None = None,
               new_logprobs=None, error_kind: str | None = None, text: str = "") -> None:
        """End req: out of the queues, blocks queued to be freed with the next KV update,
        runner state dropped with the next batch, final output emitted."""
        rid = req.request_id
        if req in self.running:  # (admitted this iteration, it may still say WAITING_PREFILL)
            self.running.remove(req)
        else:
            self.waiting.remove(req)
            if req.cached_tokens_by_tier is not None and req.first_scheduled_time is None:
                self.tier_cancels.append(rid)   # its tier staging (if any) goes
                if req in self.tier_pending:
                    self.tier_pending.remove(req)
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
            self.runner_finished.append(rid)
            req.on_runner = False
        out = self.outputs.final_output(req, reason, text=text, new_tokens=new_tokens,
                                        new_logprobs=new_logprobs, error=error,
                                        error_kind=error_kind)
        self.emit(out)
        if out.timings.trace is not None:
            self.log.info("trace", request_id=rid, trace=out.timings.trace)

    # -- observation ---------------------------------------------------------------------
    def stats(self, in_flight_steps: int, overlap: bool) -> SchedulerStats:
        p, o = self.preemptor, self.observer
        return SchedulerStats(
            waiting=len(self.waiting), running=len(self.running),
            in_flight_steps=in_flight_steps, overlap=overlap,
            num_steps=self.num_steps, num_forks=self.num_forks,
            num_preemptions=p.num_preemptions, num_swap_preemptions=p.num_swap_preemptions,
            num_free_blocks=self.view.num_free_blocks, max_decode_skip=o.max_decode_skip,
            admission_paused=self._admission_paused, prefill_budget=self.chunks.last_budget,
            cost_model=None if self.cost.coef is None else [float(c) for c in self.cost.coef],
            swap_free_slots=None if p.swap is None else p.swap.num_free,
            num_slo_evaluated=o.num_slo_evaluated, num_slo_good=o.num_slo_good,
            num_kv_plan_waits=self.num_kv_plan_waits, timings=o.timings(),
            spec=self.spec.stats() if self.spec is not None else None,
            lora=self._lora_stats())

    def _lora_stats(self) -> LoRAStats | None:
        slots = self.lora
        if slots is None:
            return None
        return LoRAStats(max_loras=slots.max_loras, registered=sorted(slots.paths),
                         resident=list(slots.names),
                         running=slots.running_adapters(self.running),
                         waiting=slots.running_adapters(self.waiting),
                         num_loads=slots.num_loads, num_evictions=slots.num_evictions,
                         num_slot_waits=slots.num_slot_waits,
                         requests_by_adapter=dict(slots.requests_by_adapter))
