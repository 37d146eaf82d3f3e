"""From a policy decision to the KV manager's request and from its answer to the runner's
batch. Pure (no asyncio, no torch): the scheduler's bookkeeping around one step.

- `StepPlan`, `kv_update`: the one KV request of an iteration (frees, forks, grants,
  admissions, commits...);
- `InFlightStep`, `process_oldest_now`: a launched step, and the overlap rule;

- `apply_prefix_hits`: admitted requests start after their cached prefix;
- `note_plans`, `start_works`: the trace's admission events and the status transitions;
- `build_batch`: the ScheduledSequences, each request's computed tokens advanced to the end
  of its work and a placeholder counted for each token it will sample (see
  scheduler_actor.py on overlap).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple

from tokenloom.actors.messages import (
    PLACEHOLDER,
    ExecuteBatch,
    KVAdmission,
    KVCommit,
    KVGrant,
    KVUpdate,
    NewSequence,
    ScheduledSequence,
)
from tokenloom.actors.scheduling.policy import Decision
from tokenloom.actors.scheduling.request import Request, RequestStatus

S = RequestStatus


@dataclasses.dataclass
class InFlightStep:
    """A step handed to the runner, until its output has been processed."""
    decision: Decision
    batch: ExecuteBatch
    works: list                       # the decision's works in batch order
    starts: list[int]                 # each work's first position
    epochs: list[int]                 # each work's request's num_preemptions at launch
    host_seconds: float               # planning + KV round trip
    kv_seconds: float
    continues: bool                   # planned while the runner had work (not after idling)
    # It verifies drafts or asks for proposals: the next step is planned only after its
    # output (how many tokens each request gained, and the proposals) is known.
    serial: bool = False


def process_oldest_now(num_in_flight: int, launched: bool, overlap: bool) -> bool:
    """The overlap rule: after launching (or not) a step, process the oldest step in flight
    now unless it is the only one and the runner has a new one to run meanwhile. With
    overlap on, at most one step waits in flight while the next is planned; off, every
    step is processed as soon as it is launched (the serial loop)."""
    if not num_in_flight:
        return False
    return num_in_flight > 1 or not launched or not overlap


class StepPlan(NamedTuple):
    """What one iteration asks of the KV manager, besides frees and commits: the policy's
    decision, n > 1 forks `(sibling 0, sibling, tokens)`, and the swap copies
    `(request, host slots)` the decision's preemptions and resumptions resolved."""
    decision: Decision
    forks: list[tuple[str, str, int]]
    swap_outs: list[tuple[str, list[int]]]
    swap_ins: list[tuple[str, list[int]]]


def kv_update(plan: StepPlan | None, frees: list[str], commits: list[KVCommit],
              running: list[Request], query) -> KVUpdate:
    """The iteration's one KV request. New admissions may start from a cached prefix
    (`query(request)`: its PrefixQuery); a request swapped back in resumes from its own KV
    instead (a plain grant plus the swap-in copies). The reply reports every running table."""
    grants, admissions, tables_for = [], [], []
    forks, swap_outs, swap_ins = (), (), ()
    if plan is not None:
        d, forks, swap_outs, swap_ins = plan
        swapped_in = {rid for rid, _ in swap_ins}
        admitted = {r.request_id for r in d.admitted} - swapped_in
        grants = [g for g in d.grants if g[0] not in admitted]
        admissions = [KVAdmission(request_id=w.request.request_id, planned_tokens=w.num_tokens,
                                  query=query(w.request))
                      for w in d.prefills if w.request.request_id in admitted]
        tables_for = [w.request.request_id for w in d.decodes + d.prefills]
    return KVUpdate(frees=frees, grants=grants, commits=commits, admissions=admissions,
                    report=[r.request_id for r in running], tables_for=tables_for,
                    forks=list(forks), swap_outs=list(swap_outs), swap_ins=list(swap_ins))


def apply_prefix_hits(d: Decision, grant: KVGrant, block_size: int) -> None:
    """Admitted requests start after their cached prefix: shrink their chunk to match."""
    for w in d.prefills:
        growth = grant.admitted.get(w.request.request_id)
        if growth is None:
            continue
        req = w.request
        cached = growth.num_cached_tokens
        restored = len(growth.restores)
        req.num_computed_tokens = cached
        # Restored blocks are not in the device's prefix cache yet: commit them after the step.
        req.num_committed_blocks = cached // block_size - restored
        w.num_tokens = min(w.num_tokens, req.num_tokens - cached)
        if req.num_preemptions == 0 and growth.prefix is not None:
            req.num_cached_tokens = cached
            req.prefix_hit_blocks = growth.prefix.num_hit_blocks
            req.prefix_miss_reason = str(growth.prefix.miss_reason)
            if req.cached_tokens_by_tier is not None:   # (KV tiers on)
                by_tier = {"device": (cached // block_size - restored) * block_size}
                for tier in growth.restored_tiers:
                    by_tier[tier] = by_tier.get(tier, 0) + block_size
                req.cached_tokens_by_tier = by_tier
                if req.trace is not None and req.trace.tiers is not None:
                    req.trace.tiers["restored"] = {t: n for t, n in by_tier.items()
                                                   if t != "device"}


def note_plans(d: Decision, now: float) -> None:
    """The KV plan of each admission (and of the first request left waiting) in its trace."""
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
            if why == "kv":
                req.trace.kv_refusals += 1


def start_works(d: Decision, now: float) -> None:
    """Status transitions of the works this step runs (after the trace's admission)."""
    for w in d.prefills:
        if w.request.status == S.WAITING_PREFILL:
            w.request.transition(S.PREFILLING)
            if w.request.trace is not None and not w.request.trace.has("prefill_started"):
                w.request.trace.mark("prefill_started", now)
    for w in d.decodes:
        if w.request.status == S.WAITING_DECODE:
            w.request.transition(S.DECODING)


def build_batch(d: Decision, tables: Mapping[str, list[int]],
                group_tables: Mapping[str, list[list[int]]], batch: ExecuteBatch,
                spec=None) -> tuple[ExecuteBatch, list, list[int], list[int]]:
    """Fill `batch` with the decision's works and the block tables the KV manager
    reported (`group_tables`: those of layer groups 1.., where the model has several):
    plain decodes first, then speculative decodes (their last token and drafts,
    laid out like a chunk), then prefill chunks. Advances each request's computed tokens
    to the end of its work (the step is as good as done for planning the next one; a
    speculative work's rejected drafts are rolled back when its output comes) and counts
    a placeholder for each token it will sample. `spec`: the SpecController, when
    speculation is on. Returns the batch, the works in batch order, each work's first
    position and each work's request's preemption count (to recognise requests preempted
    while the step runs)."""
    speculative = [w for w in d.decodes if w.num_tokens > 1]
    plain = [w for w in d.decodes if w.num_tokens == 1]
    works = plain + speculative + d.prefills
    batch.num_decodes = len(plain)
    num_decode_works = len(d.decodes)
    starts, epochs = [], []
    for i, w in enumerate(works):
        req = w.request
        start, end = req.num_computed_tokens, req.num_computed_tokens + w.num_tokens
        num_draft = 0
        is_decode = i < num_decode_works
        if is_decode and w.num_tokens > 1:
            num_draft = w.num_tokens - 1
            ids = req.token_ids[start:start + 1] + req.draft_token_ids[:num_draft]
            sample = True
        else:
            ids = req.token_ids[start:end]
            if len(ids) < w.num_tokens:  # the token the step in flight is sampling
                ids.append(PLACEHOLDER)
            sample = end == req.num_tokens
        assert len(ids) == w.num_tokens, f"{req}: {w.num_tokens} tokens scheduled"
        propose = 0
        if spec is not None and sample:
            propose = spec.started(req, num_draft, is_decode)
        new = None
        if w.resumed or not req.on_runner:
            new = NewSequence(prompt_token_ids=req.token_ids[: req.num_prompt_tokens],
                              output_token_ids=req.output_token_ids,
                              sampling_params=req.sampling_params)
            req.on_runner = True
        batch.sequences.append(ScheduledSequence(
            request_id=req.request_id, token_ids=ids, start_pos=start,
            block_table=tables[req.request_id], sample=sample, new=new,
            group_tables=group_tables.get(req.request_id),
            num_draft=num_draft, propose=propose,
            prompt_logprobs=req.wants_prompt_logprobs and start < req.num_prompt_tokens - 1,
            lora_slot=req.lora_slot))
        starts.append(start)
        epochs.append(req.num_preemptions)
        req.num_computed_tokens = end
        req.num_placeholders += sample
    return batch, works, starts, epochs
