"""When to speculate, and how far: the kill switch. Pure (no asyncio, no torch).

Speculation pays when a step that verifies k drafts costs less extra time than the tokens
it is expected to accept are worth. Both sides are measured:

- acceptance: per request and per draft position, a decayed count of how often draft j
  was accepted given draft j-1 was (positions are conditional: a draft after a rejected
  one is never looked at). Requests that do not speculate are still scored when prompt
  lookup proposes for them ("shadow" proposals, compared with the tokens the model then
  produced: the sampled token equals a draft exactly as often as rejection sampling would
  accept it). Expected accepted tokens with k drafts: a(k) = sum_j prod_{i<=j} r_i.
- cost: the scheduler's step-cost model (actors/scheduling/cost_model.py), fitted on every step's
  measured forward time. The step without drafts takes T0 for N decodes (rate N / T0);
  request i's k drafts add dT_i(k) (k more tokens, and their attention over its context).

The cost model is linear (per token, per sampled row, per attention unit), fitted on
whatever ran lately; a decode step is memory-bound at small batches (four more rows cost
almost nothing) and compute-bound at large ones (each row costs its full price), which no
single line fits at both ends. So predictions are calibrated by what was measured: per
decode-batch size bucket (powers of two), the ratio of measured to predicted step time,
kept apart for steps that verified drafts and steps that did not, scales the two sides.
A bucket with no speculative step yet uses the model as it is; the first step there
calibrates it.

Each request speculates with the k that maximises a_i(k) - (N / T0) * dT_i(k), if that is
above `min_gain` tokens per step (it raises the batch's tokens per second); the whole
batch stops speculating when the sum, less the draft model's own time, is not above
`min_gain` of N (large batches, low acceptance). A request that stopped is re-probed after
`reprobe_steps` decode steps: prompt lookup proposes once more and is scored in the shadow;
a draft model speculates for one step. `speculative: "on"` (per request or config mode)
skips the cost test; "off" never proposes.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tokenloom.actors.scheduling.cost_model import AttentionWork, StepCostModel, attention_work
from tokenloom.actors.scheduling.policy import remaining_output

DECAY = 0.95   # per observation: acceptance follows the text the request is producing now
WORKLOAD_DECAY = 0.995   # the engine-wide estimate, over many requests' observations
WORKLOAD_PRIOR = 8       # observations a new request's inherited estimate counts for
# One pseudo-observation per position, at the previous position's rate (0.5 for the
# first): without evidence a position is assumed as good as the one before it.
PRIOR_WEIGHT = 1.0


@dataclasses.dataclass
class SpecState:
    """One request's speculation: its acceptance estimate, its last decision and its trace
    counters."""
    mode: str                                   # "auto" | "on" | "off"
    accepted: list[float]                       # decayed counts per draft position
    tried: list[float]
    active: bool = False                        # speculated in its last decode step
    # The cost test said no (for it or for the batch): propose only every reprobe_steps
    # steps until it says yes again. (An empty proposal is no reason to back off: prompt
    # lookup may match at the next token.)
    backoff: bool = False
    idle_steps: int = 0                         # decode steps since it last proposed
    shadow: list[int] | None = None             # proposals scored against what comes next
    shadow_seen: int = 0
    # trace counters
    steps: int = 0
    drafted: int = 0
    num_accepted: int = 0
    drafted_per_pos: list[int] = dataclasses.field(default_factory=list)
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    decisions: dict[str, int] = dataclasses.field(default_factory=dict)
    decay: float = DECAY

    def rate(self, j: int) -> float:
        """P(draft j accepted | draft j-1 accepted)."""
        prior = 0.5 if j == 0 else self.rate(j - 1)
        return (self.accepted[j] + PRIOR_WEIGHT * prior) / (self.tried[j] + PRIOR_WEIGHT)

    def expected_accepted(self, k: int) -> float:
        total, p = 0.0, 1.0
        for j in range(k):
            p *= self.rate(j)
            total += p
        return total

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """Drafts 0..num_accepted-1 accepted, draft num_accepted (if any) rejected."""
        for j in range(len(self.tried)):
            self.accepted[j] *= self.decay
            self.tried[j] *= self.decay
        for j in range(min(num_draft, num_accepted + 1)):
            self.tried[j] += 1
            self.accepted[j] += j < num_accepted

    def note(self, decision: str) -> None:
        self.decisions[decision] = self.decisions.get(decision, 0) + 1
        if decision in ("does_not_pay", "batch_does_not_pay"):
            self.backoff = True
        elif decision in ("pays", "on", "probe"):
            self.backoff = False

    def as_dict(self, method: str) -> dict:
        return {"method": method, "mode": self.mode, "steps": self.steps,
                "drafted": self.drafted, "accepted": self.num_accepted,
                "drafted_per_position": list(self.drafted_per_pos),
                "accepted_per_position": list(self.accepted_per_pos),
                "acceptance_estimate": [round(self.rate(j), 3) for j in range(len(self.tried))],
                "decisions": dict(self.decisions)}


@dataclasses.dataclass
class Candidate:
    """A decode this step that could verify drafts."""
    request_id: str
    state: SpecState
    num_proposed: int        # drafts available
    max_drafts: int          # bounded by what the request may still produce
    context: int             # tokens its step attends to (its KV length)


@dataclasses.dataclass
class SpecTotals:
    """Engine-wide counters (vLLM's spec_decode metrics)."""
    num_drafts: int = 0                 # verification steps (one per speculating sequence)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    steps_killed: int = 0               # steps where speculation would not pay for anyone

    def add(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1


class SpecController:
    def __init__(self, method: str, k: int, mode: str = "auto", reprobe_steps: int = 16,
                 min_gain: float = 0.05, cost: StepCostModel | None = None):
        self.method = method            # "ngram" | "draft"
        self.k = k
        self.mode = mode                # config default for requests that say "auto"
        self.reprobe_steps = reprobe_steps
        self.min_gain = min_gain
        self.totals = SpecTotals()
        # Acceptance over all requests (slower decay): the prior of new requests.
        self.workload = SpecState(mode="auto", accepted=[0.0] * k, tried=[0.0] * k,
                                  decay=WORKLOAD_DECAY)
        self.draft_seconds = 0.0        # EMA of the draft model's time per step
        self.cost = cost or StepCostModel()   # the scheduler's, shared
        # decode-batch bucket -> [measured / predicted of plain steps, of speculative steps]
        self.calibration: dict[int, list[float | None]] = {}

    def new_state(self, request_mode: str) -> SpecState | None:
        """A request's state, or None when it never speculates."""
        mode = self.mode if request_mode == "auto" else request_mode
        if mode == "off":
            return None
        # A new request starts from what the workload's requests have shown lately
        # (weighted as WORKLOAD_PRIOR observations), not from a blind 0.5: otherwise every
        # request of a workload that never accepts pays to learn it again.
        w = self.workload
        accepted = [w.rate(j) * WORKLOAD_PRIOR if w.tried[j] else 0.0 for j in range(self.k)]
        tried = [float(WORKLOAD_PRIOR) if w.tried[j] else 0.0 for j in range(self.k)]
        return SpecState(mode=mode, accepted=accepted, tried=tried)

    # -- planning -------------------------------------------------------------------------
    def plan(self, candidates: Sequence[Candidate], num_decodes: int, decode_contexts: int,
             cost: StepCostModel) -> dict[str, int]:
        """Drafts to verify per request this step (absent: none). `num_decodes` and
        `decode_contexts`: the step's decodes and the sum of their contexts."""
        chosen: dict[str, int] = {}
        auto: list[tuple[float, str, int]] = []
        base_t = None
        plain_ratio, spec_ratio = self._ratios(num_decodes)
        if cost.ready and num_decodes:
            base_t = cost.predict(num_decodes, _decode_work(decode_contexts)) * plain_ratio
        for c in candidates:
            limit = min(self.k, c.num_proposed, c.max_drafts)
            if limit <= 0:
                c.state.note("no_proposal")
                continue
            if c.state.mode == "on":
                chosen[c.request_id] = limit
                c.state.note("on")
                continue
            if base_t is None or base_t <= 0:
                c.state.note("no_cost_model")
                continue
            rate = num_decodes / base_t
            best_k, best_gain = 0, 0.0
            for k in range(1, limit + 1):
                extra = max(0.0, _extra_seconds(cost, num_decodes, decode_contexts,
                                                c.context, k) * spec_ratio - base_t)
                gain = c.state.expected_accepted(k) - rate * extra
                if gain > best_gain:
                    best_k, best_gain = k, gain
            if best_k and best_gain > self.min_gain:
                auto.append((best_gain, c.request_id, best_k))
            elif not self._probe(c, chosen):
                c.state.note("does_not_pay")
        if auto:
            rate = num_decodes / base_t
            overhead = rate * self.draft_seconds if self.method == "draft" else 0.0
            if sum(g for g, _, _ in auto) - overhead > self.min_gain * num_decodes:
                for _, rid, k in auto:
                    chosen[rid] = k
            else:
                self.totals.steps_killed += 1
        by_id = {c.request_id: c for c in candidates}
        for _, rid, _ in auto:
            if rid in chosen:
                by_id[rid].state.note("pays")
            elif not self._probe(by_id[rid], chosen):
                by_id[rid].state.note("batch_does_not_pay")
        return chosen

    def _probe(self, c: Candidate, chosen: dict[str, int]) -> bool:
        """A draft-model request idle for `reprobe_steps` speculates one draft, so that its
        acceptance and the draft model's cost are measured again (prompt lookup is scored
        in the shadow instead, for free)."""
        if self.method != "draft" or c.state.idle_steps < self.reprobe_steps:
            return False
        chosen[c.request_id] = 1
        c.state.note("probe")
        return True

    def wants_proposals(self, state: SpecState | None, speculating: bool) -> bool:
        """Whether a request should propose after this step: every step unless the cost
        test told it to back off; then once per `reprobe_steps` steps (a probe)."""
        if state is None:
            return False
        if speculating or state.mode == "on" or not state.backoff:
            return True
        return (state.idle_steps + 1) % self.reprobe_steps == 0

    # -- the scheduler's side, over its Requests ------------------------------------------
    def plan_step(self, running: Sequence) -> dict[str, int]:
        """Drafts to verify this step per running request, from their proposals. Proposals
        left unused are scored in the shadow instead."""
        decodes = [r for r in running if r.is_decode]
        candidates = [Candidate(r.request_id, r.spec, len(r.draft_token_ids),
                                remaining_output(r) - 1, r.num_tokens)
                      for r in decodes if r.spec is not None and r.draft_token_ids
                      and r.num_placeholders == 0]
        if not candidates:
            return {}
        chosen = self.plan(candidates, len(decodes), sum(r.num_tokens for r in decodes),
                           self.cost)
        for r in decodes:
            if r.spec is not None and r.draft_token_ids and r.request_id not in chosen \
                    and r.spec.shadow is None:
                r.spec.shadow = list(r.draft_token_ids)
                r.spec.shadow_seen = 0
        return chosen

    def started(self, req, num_draft: int, is_decode: bool) -> int:
        """A work of req goes into the step (with `num_draft` drafts): its proposals are
        used up; returns how many tokens it should propose after the step."""
        state = req.spec
        req.draft_token_ids = []
        if state is None:
            return 0
        if is_decode:
            state.active = num_draft > 0
            state.idle_steps = 0 if num_draft else state.idle_steps + 1
        return self.k if self.wants_proposals(state, num_draft > 0) else 0

    # -- outcomes -------------------------------------------------------------------------
    def observe(self, state: SpecState, num_draft: int, num_accepted: int) -> None:
        state.observe(num_draft, num_accepted)
        self.workload.observe(num_draft, num_accepted)
        state.steps += 1
        state.drafted += num_draft
        state.num_accepted += num_accepted
        for lst in (state.drafted_per_pos, state.accepted_per_pos):
            if len(lst) < num_draft:
                lst.extend([0] * (num_draft - len(lst)))
        for j in range(num_draft):
            state.drafted_per_pos[j] += 1
            state.accepted_per_pos[j] += j < num_accepted
        self.totals.add(num_draft, num_accepted)

    def stats(self):
        from tokenloom.actors.messages import SpecStats
        t = self.totals
        return SpecStats(method=self.method, num_speculative_tokens=self.k,
                         num_drafts=t.num_drafts, num_draft_tokens=t.num_draft_tokens,
                         num_accepted_tokens=t.num_accepted_tokens,
                         accepted_per_position=list(t.accepted_per_pos),
                         steps_killed=t.steps_killed)

    def calibrate(self, num_decodes: int, speculative: bool, predicted: float,
                  measured: float) -> None:
        """A step's measured forward time against the cost model's prediction for it."""
        if num_decodes <= 0 or predicted <= 0 or measured <= 0:
            return
        slot = self.calibration.setdefault(_bucket(num_decodes), [None, None])
        ratio = measured / predicted
        old = slot[speculative]
        slot[speculative] = ratio if old is None else 0.8 * old + 0.2 * ratio

    def _ratios(self, num_decodes: int) -> tuple[float, float]:
        slot = self.calibration.get(_bucket(num_decodes), [None, None])
        plain = slot[0] if slot[0] is not None else 1.0
        return plain, slot[1] if slot[1] is not None else plain

    def observe_draft_time(self, seconds: float) -> None:
        self.draft_seconds = seconds if not self.draft_seconds else (
            0.8 * self.draft_seconds + 0.2 * seconds)

    def score_shadow(self, state: SpecState, token_id: int) -> None:
        """A token the model produced while shadow proposals were pending: score the
        proposal at its position (the first mismatch ends the shadow run)."""
        shadow = state.shadow
        if shadow is None:
            return
        j = state.shadow_seen
        hit = shadow[j] == token_id
        if not hit or j + 1 == len(shadow):
            state.observe(len(shadow), j + hit)
            self.workload.observe(len(shadow), j + hit)
            state.shadow = None
            state.shadow_seen = 0
        else:
            state.shadow_seen = j + 1


def _bucket(num_decodes: int) -> int:
    """1, 2, 4, 8, ...: the power of two at or above num_decodes."""
    return 1 << max(0, num_decodes - 1).bit_length()


def _decode_work(contexts: int) -> AttentionWork:
    """Attention work of one-token decodes whose contexts (KV lengths) sum to `contexts`:
    each reads its context and forms as many query-key pairs."""
    return AttentionWork(contexts / 1e6, contexts / 1e6)


def _extra_seconds(cost: StepCostModel, num_decodes: int, contexts: int, context: int,
                   k: int) -> float:
    """The step's predicted time when one decode at `context` also verifies k drafts."""
    start = context - 1
    work = (_decode_work(contexts) + attention_work(1 + k, start)
            + attention_work(1, start) * -1)
    return cost.predict(num_decodes + k, work, rows=num_decodes + k)
