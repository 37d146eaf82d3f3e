"""The scheduler actor: the engine loop. schedule() -> run() -> postprocess().

Owns every Request (waiting and running). Each iteration it asks the pure policy what to
run, gets the blocks for exactly that from the KV manager in one atomic call, hands the
batch to the runner, and turns sampled tokens into RequestOutputs for the stream registry.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable

from tokenloom.actors.base import Actor, Control, resolve
from tokenloom.actors.messages import (ERROR_INTERNAL, ERROR_INVALID, AbortRequest, AddRequest,
                                       ExecuteBatch, KVAdmission, KVCommit, KVGrant, KVUpdate,
                                       NewSequence, RequestOutput, RequestTimings,
                                       ScheduledSequence, Shutdown, StepOutput)
from tokenloom.actors.policy import Decision, PolicyLimits, ScheduledWork, schedule
from tokenloom.actors.prefix_tracker import PrefixTracker
from tokenloom.actors.request import FinishReason, Request, RequestStatus

S = RequestStatus


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(self, limits: PolicyLimits, eos_token_ids: tuple[int, ...], max_model_len: int,
                 emit: Callable[[RequestOutput], None], prefix: PrefixTracker | None = None):
        super().__init__()
        self.prefix = prefix or PrefixTracker("", limits.block_size, enabled=False)
        self.limits = limits
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
        self._exclusive: dict[str, int] = {}              # blocks each would free (last report)
        self._runner_finished: list[str] = []
        self._on_runner: set[str] = set()                 # requests the runner has state for
        self._step = 0
        self._stopping = False
        # Counters for metrics and tests.
        self.num_preemptions = 0
        self.num_forks = 0
        self.num_steps = 0
        self.last_step_time = time.monotonic()

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
        req = Request(msg.request_id, msg.prompt_token_ids, msg.sampling_params,
                      eos_token_ids=self.eos_token_ids, arrival_time=msg.arrival_time,
                      max_model_len=self.max_model_len, cache_salt=msg.cache_salt,
                      group_id=msg.group_id)
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
        if req.request_id in self.tables:
            self._release(req.request_id)
        if req.request_id in self._on_runner:
            self._runner_finished.append(req.request_id)
            self._on_runner.discard(req.request_id)
        self.emit(RequestOutput(
            request_id=req.request_id, new_token_ids=new_tokens or [], new_logprobs=new_logprobs,
            num_prompt_tokens=req.num_prompt_tokens, finished=True,
            finish_reason=reason.as_openai(), error=error, error_kind=error_kind,
            timings=self._timings(req)))

    def _timings(self, req: Request) -> RequestTimings:
        return RequestTimings(arrival=req.arrival_time, first_scheduled=req.first_scheduled_time,
                              first_token=req.first_token_time, finished=time.monotonic(),
                              token_times=list(req.token_times),
                              num_preemptions=req.num_preemptions,
                              num_cached_tokens=req.num_cached_tokens,
                              prefix_hit_blocks=req.prefix_hit_blocks,
                              prefix_miss_reason=req.prefix_miss_reason)

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
        forks = self._fork_candidates()
        if forks:  # an extra round trip, only in the step after an n > 1 prompt completes
            self._apply_forks(await self._kv_update([], forks=forks))
        decision = schedule(self.running, self._admissible(), self.num_free_blocks, self._held,
                            self.limits, self._freeable)
        self._apply_preemptions(decision)
        for req, why in decision.rejected:
            self.waiting.remove(req)
            self._finish(req, S.FINISHED, FinishReason.ERROR, error=why, error_kind=ERROR_INVALID)
        # Admissions go separately: the KV manager may start them from a cached prefix.
        admitted = {r.request_id: r for r in decision.admitted}
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
        if decision.empty:
            if not self.running and self.waiting and not grant.freed:
                # Nothing fits, nothing runs, nothing was just freed: wait for news.
                self._handle(await self.inbox.get())
            return
        self._admit(decision)
        batch = self._build_batch(decision)
        self.runner_inbox.put_nowait(batch)
        out = await self._await(StepOutput)
        self._postprocess(decision, out)

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
        # Victims were chosen latest-admitted first; appendleft in that order puts the
        # earliest-admitted victim at the head of the waiting queue.
        for req in d.preempted:
            self.running.remove(req)
            req.transition(S.PREEMPTED)
            req.transition(S.WAITING_PREFILL)
            req.num_computed_tokens = 0
            req.num_committed_blocks = 0
            req.num_preemptions += 1
            self.num_preemptions += 1
            self._release(req.request_id)
            self.waiting.appendleft(req)
            self.log.info("preempted", request_id=req.request_id, tokens=req.num_tokens)

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
        return ExecuteBatch(step=self._step, sequences=seqs, num_decodes=len(d.decodes),
                            finished_ids=finished, block_copies=copies)

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
                commit = self.prefix.commit(w.request)  # newly full blocks -> prefix cache
                if commit is not None:
                    self._pending_commits.append(commit)
        for s in out.sampled:
            req = self.requests.get(s.request_id)
            if req is None or req.is_finished:
                continue
            req.append_token(s.token_id, now)
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
                "num_preemptions": self.num_preemptions, "num_steps": self.num_steps,
                "num_free_blocks": self.num_free_blocks}
