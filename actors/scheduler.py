"""The scheduler actor: the engine loop. schedule() -> run() -> postprocess().

Owns every Request (waiting and running). Each iteration it orders the waiting queue
(class, fair share, age: fairness.py), sizes the prefill budget for the latency target
(cost_model.py), asks the pure policy what to run, gets the blocks for exactly that from the
KV manager in one atomic call, hands the batch to the runner, and turns sampled tokens into
RequestOutputs for the stream registry. Every request carries a trace (trace.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable

from tokenloom.actors.base import Actor, Control, resolve
from tokenloom.actors.cost_model import StepCostModel, attention_work
from tokenloom.actors.fairness import FairShare
from tokenloom.actors.messages import (ERROR_INTERNAL, ERROR_INVALID, AbortRequest, AddRequest,
                                       ExecuteBatch, KVAdmission, KVCommit, KVGrant, KVUpdate,
                                       NewSequence, RequestOutput, RequestTimings,
                                       ScheduledSequence, Shutdown, StepOutput)
from tokenloom.actors.policy import (AdmissionParams, Decision, PolicyLimits, ScheduledWork,
                                     schedule)
from tokenloom.actors.prefix_tracker import PrefixTracker
from tokenloom.actors.request import FinishReason, Request, RequestStatus
from tokenloom.actors.swap import SwapSpace
from tokenloom.actors.trace import RequestTrace, TraceHistory
from tokenloom.config.schema import SchedulerConfig

S = RequestStatus


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(self, limits: PolicyLimits, eos_token_ids: tuple[int, ...], max_model_len: int,
                 emit: Callable[[RequestOutput], None], prefix: PrefixTracker | None = None,
                 config: SchedulerConfig | None = None, swap: SwapSpace | None = None,
                 block_bytes: int = 0):
        super().__init__()
        self.prefix = prefix or PrefixTracker("", limits.block_size, enabled=False)
        self.limits = limits
        self.config = config or SchedulerConfig(max_num_seqs=limits.max_num_seqs,
                                                max_num_batched_tokens=limits.max_num_batched_tokens)
        cfg = self.config
        self.fair = FairShare(cfg.tenant_weights, cfg.aging_seconds)
        self.cost = StepCostModel()
        self.swap = swap                                   # None: swap preemption is off
        self.block_bytes = block_bytes                     # KV bytes of one block (swap cost)
        self.swap_seconds_per_block: float | None = None   # measured by the runner
        self.traces = TraceHistory(cfg.trace_history)
        self._arrivals = 0
        # KV plan hysteresis: after a preemption admission waits for the resume watermark.
        self._admission_paused = False
        self._watermark = int(cfg.kv_watermark * limits.num_blocks)
        self._resume_watermark = int(cfg.kv_resume_watermark * limits.num_blocks)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.emit = emit
        self.kv_inbox: asyncio.Queue | None = None       # wired by the engine
        self.runner_inbox: asyncio.Queue | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.tables: dict[str, list[int]] = {}            # mirror of granted block tables
        self.num_free_blocks = limits.num_blocks
        self._pending_frees: list[str] = []
        self._pending_commits: list[KVCommit] = []
        self._pending_copies: list[tuple[int, int]] = []  # copy-on-write for the runner
        self._swap_out: list[tuple[int, int]] = []         # (device block, host slot)
        self._swap_in: list[tuple[int, int]] = []          # (host slot, device block)
        self._exclusive: dict[str, int] = {}              # blocks each would free (last report)
        self._runner_finished: list[str] = []
        self._on_runner: set[str] = set()                 # requests the runner has state for
        self._step = 0
        self._stopping = False
        # Counters for metrics and tests.
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.num_forks = 0
        self.num_steps = 0
        self.last_step_time = time.monotonic()
        self.max_decode_skip = 0          # most consecutive iterations a running decode missed
        self._skips: dict[str, int] = {}  # running decode -> iterations missed in a row
        self.num_slo_evaluated = 0
        self.num_slo_good = 0
        self.last_prefill_budget: int | None = None
        self._last_slo_chunk = 0          # the previous SLO-sized prefill budget (ramp)

    # -- inbox handling ------------------------------------------------------------------
    def _handle(self, msg) -> None:
        match msg:
            case AddRequest():
                self._add(msg)
            case AbortRequest(request_id=rid):
                self._abort(rid)
            case Control(op="stats", reply=reply):
                resolve(reply, self.stats())
            case Control(op="idle", reply=reply):
                resolve(reply, not self.waiting and not self.running)
            case Control(op="trace", reply=reply, args=args):
                resolve(reply, self.trace(args["request_id"]))
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
                      max_model_len=self.max_model_len, cache_salt=msg.cache_salt,
                      group_id=msg.group_id, priority=msg.priority, tenant=msg.tenant,
                      arrival_seq=self._arrivals)
        req.trace = RequestTrace(req.request_id, msg.arrival_time, msg.routed_time,
                                 priority=msg.priority, tenant=msg.tenant)
        self.traces.add(req.trace)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def _abort(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is None or req.is_finished:
            return  # aborts are idempotent
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self._finish(req, S.CANCELLED, FinishReason.ABORT)

    def _finish(self, req: Request, status: RequestStatus, reason: FinishReason,
                error: str | None = None, new_tokens: list[int] | None = None,
                new_logprobs=None, error_kind: str | None = None) -> None:
        req.transition(status)
        req.finish_reason = reason
        req.error = error
        self.requests.pop(req.request_id, None)
        self._skips.pop(req.request_id, None)
        trace = req.trace
        if trace is not None:
            trace.finish_reason = reason.as_openai()
            if req.first_token_time is not None and reason in (FinishReason.STOP,
                                                                FinishReason.LENGTH):
                trace.mark("final_token", req.token_times[-1] if req.token_times else None)
        if req.swapped_slots is not None:
            self.swap.release(req.swapped_slots)
            req.swapped_slots = None
        if req.request_id in self.tables:
            self._release(req.request_id)
            if trace is not None:
                trace.mark("kv_blocks_released")
        self._observe_slo(req, reason)
        timings = self._timings(req)
        if req.request_id in self._on_runner:
            self._runner_finished.append(req.request_id)
            self._on_runner.discard(req.request_id)
        self.emit(RequestOutput(
            request_id=req.request_id, new_token_ids=new_tokens or [], new_logprobs=new_logprobs,
            num_prompt_tokens=req.num_prompt_tokens, finished=True,
            finish_reason=reason.as_openai(), error=error, error_kind=error_kind,
            timings=timings))
        if timings.trace is not None:
            self.log.info("trace", request_id=req.request_id, trace=timings.trace)

    def _timings(self, req: Request) -> RequestTimings:
        return RequestTimings(arrival=req.arrival_time, first_scheduled=req.first_scheduled_time,
                              first_token=req.first_token_time, finished=time.monotonic(),
                              token_times=list(req.token_times),
                              num_preemptions=req.num_preemptions,
                              num_cached_tokens=req.num_cached_tokens,
                              prefix_hit_blocks=req.prefix_hit_blocks,
                              prefix_miss_reason=req.prefix_miss_reason,
                              trace=req.trace.as_dict() if req.trace is not None else None)

    def _observe_slo(self, req: Request, reason: FinishReason) -> None:
        """Goodput: a request that finished normally within the TTFT and ITL objectives."""
        if reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return
        cfg = self.config
        self.num_slo_evaluated += 1
        ok = True
        if cfg.slo_ttft_ms > 0 and req.first_token_time is not None:
            ok = (req.first_token_time - req.arrival_time) * 1000 <= cfg.slo_ttft_ms
        times = req.token_times
        if ok and cfg.slo_itl_ms > 0 and len(times) > 1:
            ok = (times[-1] - times[0]) / (len(times) - 1) * 1000 <= cfg.slo_itl_ms
        self.num_slo_good += ok

    def trace(self, request_id: str) -> list[dict]:
        """The traces of `request_id` (or of its choices `{id}-0`, ...), JSON-ready."""
        return [t.as_dict() for t in self.traces.find(request_id)]

    async def _await(self, kind: type):
        """Wait for a reply of `kind`; other messages (adds, aborts) are handled meanwhile."""
        while True:
            msg = await self.inbox.get()
            if isinstance(msg, kind):
                return msg
            self._handle(msg)

    def _drain(self) -> None:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except asyncio.QueueEmpty:
                return
            self._handle(msg)

    # -- the loop ------------------------------------------------------------------------
    async def run(self) -> None:
        while not self._stopping:
            if not self.waiting and not self.running:
                if self._pending_frees:
                    await self._kv_update([])  # return blocks promptly even when idle
                self._handle(await self.inbox.get())
                self.last_step_time = time.monotonic()  # the stall clock starts with work
                continue
            self._drain()
            if not self.waiting and not self.running:
                continue
            await self.step()
        for req in list(self.waiting) + list(self.running):
            self._finish(req, S.CANCELLED, FinishReason.ABORT, error="engine shut down",
                         error_kind=ERROR_INTERNAL)

    async def _kv_update(self, grants: list[tuple[str, int]],
                         admissions: list[KVAdmission] = (),
                         forks: list[tuple[str, str, int]] = ()) -> KVGrant:
        report = [r.request_id for r in self.running] if self.prefix.enabled else []
        self.kv_inbox.put_nowait(KVUpdate(frees=self._pending_frees, grants=grants,
                                          commits=self._pending_commits,
                                          admissions=list(admissions), report=report,
                                          forks=list(forks)))
        self._pending_frees, self._pending_commits = [], []
        grant = await self._await(KVGrant)
        self.num_free_blocks = grant.num_free_blocks
        self._exclusive = grant.exclusive
        return grant

    def _release(self, rid: str) -> None:
        """Queue rid's blocks for the next KV update. The update applies frees before
        grants, so the policy may count them as free right away: all of them without
        prefix sharing, else the ones rid held alone at the last report (a lower bound)."""
        self._pending_frees.append(rid)
        table = self.tables.pop(rid, ())
        self.num_free_blocks += self._exclusive.get(rid, len(table)) if self.prefix.enabled \
            else len(table)

    def _freeable(self, rid: str) -> int:
        if not self.prefix.enabled:
            return len(self.tables.get(rid, ()))
        return self._exclusive.get(rid, 0)

    def _held(self, rid: str) -> int:
        return len(self.tables.get(rid, ()))

    async def step(self) -> None:
        t_start = time.monotonic()
        forks = self._fork_candidates()
        if forks:  # an extra round trip, only in the step after an n > 1 prompt completes
            self._apply_forks(await self._kv_update([], forks=forks))
        now = time.monotonic()
        waiting = self.fair.order(self._admissible(), now)
        decision = schedule(self.running, waiting, self.num_free_blocks, self._held,
                            self.limits, self._freeable,
                            prefill_budget=self._prefill_budget(waiting),
                            admission=self._admission_params(),
                            preempt_mode=self._preempt_mode if self.swap is not None else None)
        self._apply_preemptions(decision)
        for req, why in decision.rejected:
            self.waiting.remove(req)
            self._finish(req, S.FINISHED, FinishReason.ERROR, error=why, error_kind=ERROR_INVALID)
        # Admissions go separately: the KV manager may start them from a cached prefix. A
        # swapped-out request resumes from its own KV instead (a plain grant + swap-in).
        admitted = {r.request_id: r for r in decision.admitted if r.swapped_slots is None}
        grants = [g for g in decision.grants if g[0] not in admitted]
        admissions = [KVAdmission(request_id=w.request.request_id, planned_tokens=w.num_tokens,
                                  query=self.prefix.query(w.request))
                      for w in decision.prefills if w.request.request_id in admitted]
        grant = await self._kv_update(grants, admissions)
        if grant.new_blocks is None:
            # Cannot happen while the scheduler's view is a lower bound; fail loudly.
            raise AssertionError(f"KV manager refused a decision made from its own snapshot: "
                                 f"{decision.grants}")
        for rid, blocks in grant.new_blocks.items():
            self.tables.setdefault(rid, []).extend(blocks)
        self._apply_prefix_hits(decision, grant)
        self._apply_swap_ins(decision)
        self._note_plans(decision, time.monotonic())
        if decision.empty:
            if not self.running and self.waiting and not grant.freed:
                # Nothing fits, nothing runs, nothing was just freed: wait for news.
                self._handle(await self.inbox.get())
            return
        self._admit(decision)
        self._count_skips(decision)
        batch = self._build_batch(decision)
        self.runner_inbox.put_nowait(batch)
        out = await self._await(StepOutput)
        self._postprocess(decision, out)
        self._observe_step(decision, batch, out, time.monotonic() - t_start)

    # -- admission plan, chunk sizing, preemption mode -------------------------------------
    def _admission_params(self) -> AdmissionParams:
        """The watermark, raised after a preemption until the pool has recovered."""
        if self._admission_paused and self.num_free_blocks >= self._resume_watermark:
            self._admission_paused = False
        floor = self._resume_watermark if self._admission_paused else self._watermark
        return AdmissionParams(min_free_blocks=floor,
                               lookahead_tokens=self.config.admission_lookahead_tokens)

    def _prefill_budget(self, waiting: list[Request]) -> int | None:
        """SLO-driven chunking: the prefill tokens that keep this iteration's running decodes
        within the ITL target, per the fitted cost model; min_prefill_chunk while the model
        has not seen prefill iterations yet. None: the static budget (chunking "static", or
        nothing decoding to protect)."""
        cfg = self.config
        self.last_prefill_budget = None
        if cfg.chunking != "slo":
            return None
        decodes = [r for r in self.running if r.is_decode]
        if not decodes:
            return None
        if not self.cost.knows_prefill:
            # Streams are decoding but prefill costs are unknown yet: protect them with the
            # smallest chunk until the model has seen prefill iterations.
            self.last_prefill_budget = min(cfg.min_prefill_chunk,
                                           self.limits.max_num_batched_tokens - len(decodes))
            return self.last_prefill_budget
        d_attn = sum(attention_work(1, r.num_computed_tokens) for r in decodes)
        if cfg.target_itl_ms > 0:
            target = cfg.target_itl_ms / 1000
        else:
            target = 2.0 * self.cost.predict(len(decodes), d_attn)
        prefilling = [r for r in self.running if not r.is_decode]
        head = prefilling[0] if prefilling else (waiting[0] if waiting else None)
        if head is None:
            return None
        hi = self.limits.max_num_batched_tokens - len(decodes)
        lo = min(cfg.min_prefill_chunk, hi)
        budget = self.cost.max_prefill_tokens(target, len(decodes), d_attn,
                                              head.num_computed_tokens, lo, hi)
        # Ramp: at most double the previous SLO chunk, so one bad fit (noise) cannot turn
        # into one multi-second iteration before the model sees its mistake.
        budget = min(budget, max(lo, 2 * self._last_slo_chunk))
        self._last_slo_chunk = budget
        self.last_prefill_budget = budget
        return budget

    def _preempt_mode(self, victim: Request) -> str:
        """swap or recompute, for this victim (only called when swap space exists)."""
        held = len(self.tables.get(victim.request_id, ()))
        if held == 0 or victim.num_computed_tokens == 0 or self.swap.num_free < held:
            return "recompute"
        if self.config.preemption_mode == "swap":
            return "swap"
        # auto: copying out and back vs recomputing every computed token.
        per_block = self.swap_seconds_per_block
        if per_block is None:  # not measured yet: assume ~10 GB/s each way
            per_block = self.block_bytes / 10e9
        swap_cost = 2 * held * per_block
        return "swap" if swap_cost < self.cost.prefill_seconds(victim.num_computed_tokens) \
            else "recompute"

    def _note_plans(self, d: Decision, now: float) -> None:
        for req in d.admitted:
            if req.trace is not None:
                req.trace.plan = {**d.plans.get(req.request_id, {}), "decision": "admit"}
                if not req.trace.has("prefix_cache_lookup_done"):
                    req.trace.mark("prefix_cache_lookup_done", now)
                req.trace.mark("resumed" if req.trace.has("admitted") else "admitted", now)
        if d.blocked is not None:
            req, why, plan = d.blocked
            if req.trace is not None:
                req.trace.plan = {**plan, "decision": "wait", "reason": why}

    def _count_skips(self, d: Decision) -> None:
        """Invariant 3's measurement: iterations in a row a running decode was left out."""
        ran = {w.request.request_id for w in d.decodes}
        ran.update(w.request.request_id for w in d.prefills)  # swapped back in: one token
        for req in self.running:
            if not req.is_decode:
                continue
            rid = req.request_id
            if rid in ran:
                self._skips[rid] = 0
            else:
                n = self._skips.get(rid, 0) + 1
                self._skips[rid] = n
                if n > self.max_decode_skip:
                    self.max_decode_skip = n
                    if n > self.config.max_decode_skip:  # a broken promise: say so loudly
                        self.log.error("decode starved", request_id=rid, skipped=n,
                                       bound=self.config.max_decode_skip)

    def _observe_step(self, d: Decision, batch: ExecuteBatch, out: StepOutput,
                      seconds: float) -> None:
        """Feed the cost model (tokens, attention work -> iteration time) and charge each
        tenant the tokens computed for it (fair share)."""
        if out.error is not None:
            return
        tokens = 0
        work = 0.0
        for s in batch.sequences:
            n = len(s.token_ids)
            tokens += n
            work += attention_work(n, s.start_pos)
        self.cost.observe(tokens, work, seconds,
                          prefill_tokens=sum(w.num_tokens for w in d.prefills))
        for w in d.decodes + d.prefills:
            self.fair.charge(w.request.tenant, w.num_tokens)
        if out.swap_seconds and batch.swap_out:
            per_block = out.swap_seconds / (len(batch.swap_out) + len(batch.swap_in))
            prev = self.swap_seconds_per_block
            self.swap_seconds_per_block = per_block if prev is None else 0.8 * prev + 0.2 * per_block

    def _fork_candidates(self) -> list[tuple[str, str, int]]:
        """n > 1 siblings whose sibling 0 has computed the prompt: fork them from it (its
        full blocks shared, its partial last block copied) instead of admitting them."""
        if not self.prefix.enabled or not any(r.group_id for r in self.waiting):
            return []
        out, budget = [], self.num_free_blocks
        slots = self.limits.max_num_seqs - len(self.running)
        for r in self.waiting:
            leader = self.requests.get(r.group_id) if r.group_id else None
            if (leader is None or leader.request_id not in self.tables or len(out) >= slots
                    or budget < 1 or r.num_preemptions or r.num_tokens != r.num_prompt_tokens
                    or leader.num_computed_tokens < leader.num_prompt_tokens
                    or leader.token_ids[:leader.num_prompt_tokens] != r.token_ids):
                continue
            out.append((leader.request_id, r.request_id, r.num_prompt_tokens - 1))
            budget -= 1
        return out

    def _apply_forks(self, grant: KVGrant) -> None:
        bs = self.limits.block_size
        now = time.monotonic()
        for child_id, table in grant.forked.items():
            req = self.requests[child_id]
            leader = self.requests[req.group_id]
            self.waiting.remove(req)
            self.running.append(req)
            self.tables[child_id] = list(table)
            req.num_computed_tokens = req.num_prompt_tokens - 1  # only the last token to go
            full = req.num_computed_tokens // bs
            req.num_committed_blocks = min(leader.num_committed_blocks, full)
            req.num_cached_tokens, req.prefix_hit_blocks = full * bs, full
            req.prefix_miss_reason = "partial_block" if req.num_computed_tokens % bs else None
            req.first_scheduled_time = now
            req.transition(S.PREFILLING)
            self.num_forks += 1
        self._pending_copies.extend(grant.copies)

    def _admissible(self):
        """The waiting queue, less n > 1 siblings whose sibling 0 has not computed its
        prompt yet: admitted after it, they reuse its full prompt blocks from the prefix
        cache instead of computing the same prompt n times."""
        if not self.prefix.enabled or not any(r.group_id for r in self.waiting):
            return self.waiting
        return deque(r for r in self.waiting if not self._held_back(r))

    def _held_back(self, req: Request) -> bool:
        leader = self.requests.get(req.group_id) if req.group_id else None
        return leader is not None and leader.num_computed_tokens < leader.num_prompt_tokens

    def _apply_prefix_hits(self, d: Decision, grant: KVGrant) -> None:
        """Admitted requests start after their cached prefix: shrink their chunk to match."""
        for w in d.prefills:
            growth = grant.admitted.get(w.request.request_id)
            if growth is None:
                continue
            req = w.request
            self.tables[req.request_id] = list(growth.block_ids)
            cached = growth.num_cached_tokens
            req.num_computed_tokens = cached
            req.num_committed_blocks = cached // self.limits.block_size
            w.num_tokens = min(w.num_tokens, req.num_tokens - cached)
            if req.num_preemptions == 0 and growth.prefix is not None:
                req.num_cached_tokens = cached
                req.prefix_hit_blocks = growth.prefix.num_hit_blocks
                req.prefix_miss_reason = str(growth.prefix.miss_reason)

    def _apply_preemptions(self, d: Decision) -> None:
        """Victims go back to waiting (the fair queue puts preempted requests first in their
        class). Recompute drops their KV; swap copies their blocks to host slots first (the
        copies run before this step's forward, so the freed blocks may be reused at once)."""
        for req in d.preempted:
            rid = req.request_id
            self.running.remove(req)
            self._skips.pop(rid, None)
            req.transition(S.PREEMPTED)
            req.transition(S.WAITING_PREFILL)
            used_before = self.limits.num_blocks - self.num_free_blocks
            table = self.tables.get(rid, [])
            slots = self.swap.allocate(len(table)) if rid in d.swapped else None
            if slots is not None:
                self._swap_out.extend(zip(table, slots))
                req.swapped_slots = slots
                mode, tokens = "swap", req.num_computed_tokens
                self.num_swap_preemptions += 1
            else:
                mode, tokens = "recompute", req.num_computed_tokens
                req.num_computed_tokens = 0
            req.num_committed_blocks = 0
            req.num_preemptions += 1
            self.num_preemptions += 1
            self._release(rid)
            self.waiting.appendleft(req)
            self._admission_paused = True
            record = {"mode": mode, "tokens_swapped" if mode == "swap" else
                      "tokens_discarded": tokens, "blocks": len(table),
                      "kv_used_blocks_before": used_before,
                      "kv_used_blocks_after": self.limits.num_blocks - self.num_free_blocks}
            if req.trace is not None:
                req.trace.mark("preempted")
                req.trace.preemptions.append(record)
            self.log.info("preempted", request_id=rid, **record)

    def _apply_swap_ins(self, d: Decision) -> None:
        """Swapped-out requests admitted this step: copy their host slots into the blocks
        just granted (before the forward), then release the slots."""
        for req in d.admitted:
            slots = req.swapped_slots
            if slots is None:
                continue
            table = self.tables[req.request_id]
            self._swap_in.extend(zip(slots, table))
            self.swap.release(slots)
            req.swapped_slots = None

    def _admit(self, d: Decision) -> None:
        now = time.monotonic()
        for req in d.admitted:
            self.waiting.remove(req)
            self.running.append(req)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        for w in d.prefills:
            if w.request.status == S.WAITING_PREFILL:
                w.request.transition(S.PREFILLING)
                if w.request.trace is not None and not w.request.trace.has("prefill_started"):
                    w.request.trace.mark("prefill_started", now)
        for w in d.decodes:
            if w.request.status == S.WAITING_DECODE:
                w.request.transition(S.DECODING)

    def _build_batch(self, d: Decision) -> ExecuteBatch:
        seqs = []
        for w in d.decodes + d.prefills:
            req = w.request
            start = req.num_computed_tokens
            new = None
            if w.resumed or req.request_id not in self._on_runner:
                new = NewSequence(prompt_token_ids=req.token_ids[: req.num_prompt_tokens],
                                  output_token_ids=req.output_token_ids,
                                  sampling_params=req.sampling_params)
                self._on_runner.add(req.request_id)
            seqs.append(ScheduledSequence(
                request_id=req.request_id, token_ids=req.token_ids[start:start + w.num_tokens],
                start_pos=start, block_table=self.tables[req.request_id],
                sample=start + w.num_tokens == req.num_tokens, new=new))
        self._step += 1
        finished, self._runner_finished = self._runner_finished, []
        copies, self._pending_copies = self._pending_copies, []
        swap_out, self._swap_out = self._swap_out, []
        swap_in, self._swap_in = self._swap_in, []
        return ExecuteBatch(step=self._step, sequences=seqs, num_decodes=len(d.decodes),
                            finished_ids=finished, block_copies=copies, swap_out=swap_out,
                            swap_in=swap_in)

    def _postprocess(self, d: Decision, out: StepOutput) -> None:
        now = time.monotonic()
        self.num_steps += 1
        self.last_step_time = now
        if out.error is not None:
            for w in d.decodes + d.prefills:
                if not w.request.is_finished:
                    self.running.remove(w.request)
                    self._finish(w.request, S.FINISHED, FinishReason.ERROR, error=out.error,
                                 error_kind=ERROR_INTERNAL)
            return
        for w in d.decodes + d.prefills:
            if not w.request.is_finished:  # an abort may have landed during the step
                w.request.num_computed_tokens += w.num_tokens
                trace = w.request.trace
                if trace is not None and w.request.status == S.PREFILLING:
                    trace.prefill_chunks += 1
                if (trace is not None and w.request.status == S.PREFILLING
                        and w.request.num_computed_tokens >= w.request.num_prompt_tokens
                        and not trace.has("prefill_finished")):
                    trace.mark("prefill_finished", now)
                commit = self.prefix.commit(w.request)  # newly full blocks -> prefix cache
                if commit is not None:
                    self._pending_commits.append(commit)
        for s in out.sampled:
            req = self.requests.get(s.request_id)
            if req is None or req.is_finished:
                continue
            req.append_token(s.token_id, now)
            if req.trace is not None:
                req.trace.token(now)
            lps = [s.logprob] if s.logprob is not None else None
            reason = req.check_stop()
            if reason is not None:
                self.running.remove(req)
                self._finish(req, S.FINISHED, FinishReason(reason), new_tokens=[s.token_id],
                             new_logprobs=lps)
                continue
            if req.status == S.PREFILLING:
                req.transition(S.WAITING_DECODE)
            self.emit(RequestOutput(request_id=req.request_id, new_token_ids=[s.token_id],
                                    new_logprobs=lps, num_prompt_tokens=req.num_prompt_tokens))

    def stats(self) -> dict:
        return {"waiting": len(self.waiting), "running": len(self.running),
                "num_forks": self.num_forks,
                "num_preemptions": self.num_preemptions,
                "num_swap_preemptions": self.num_swap_preemptions,
                "num_steps": self.num_steps,
                "num_free_blocks": self.num_free_blocks,
                "max_decode_skip": self.max_decode_skip,
                "admission_paused": self._admission_paused,
                "prefill_budget": self.last_prefill_budget,
                "cost_model": (None if self.cost.coef is None
                               else [float(c) for c in self.cost.coef]),
                "swap_free_slots": None if self.swap is None else self.swap.num_free,
                "num_slo_evaluated": self.num_slo_evaluated,
                "num_slo_good": self.num_slo_good}

    def stalled_seconds(self, now: float | None = None) -> float:
        """Seconds the loop has gone without completing a step while it has work; 0 when
        idle or progressing. Read directly (not through the inbox) so that a wedged engine
        can still be detected."""
        if not self.waiting and not self.running:
            return 0.0
        now = time.monotonic() if now is None else now
        return max(0.0, now - self.last_step_time)
