"""The pure scheduling policy: unit tests of schedule(), then property tests that drive it with a
small simulator over a real KVCacheManager (no torch, no asyncio).

The simulator applies each Decision the way SchedulerActor.step does: preemptions first (back to
the front of waiting, computed tokens reset, blocks freed), then one atomic allocate() of exactly
the decision's grants, then admission, then the "forward pass" (computed tokens advance; a
sequence whose known tokens are all computed samples one fake token). Unlike the actor, it frees
a finished request's blocks at once rather than at the next KV update.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.actors.kv_manager import KVCacheManager
from tokenloom.actors.policy import (AdmissionParams, Decision, PolicyLimits, blocks_for,
                                     schedule)
from tokenloom.actors.request import FinishReason, Request, RequestStatus
from tokenloom.actors.sampling_params import SamplingParams

S = RequestStatus
SAMPLED = 7  # the fake token every "forward pass" samples; never EOS (there is none)


def make_request(rid: str, prompt_len: int, max_tokens: int = 16) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=())


def prefilling(rid: str, prompt_len: int, computed: int) -> Request:
    req = make_request(rid, prompt_len)
    req.status = S.PREFILLING
    req.num_computed_tokens = computed
    return req


def decoding(rid: str, prompt_len: int, num_outputs: int = 1) -> Request:
    req = make_request(rid, prompt_len)
    req.status = S.DECODING
    for _ in range(num_outputs):
        req.num_computed_tokens = req.num_tokens
        req.append_token(SAMPLED, now=0.0)
    assert req.is_decode
    return req


def limits(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_blocks=64):
    return PolicyLimits(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        block_size=block_size, num_blocks=num_blocks)


def held_from(**held: int):
    return lambda rid: held.get(rid, 0)


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def work(ws) -> list[tuple[str, int]]:
    return [(w.request.request_id, w.num_tokens) for w in ws]


# -- unit tests of schedule() --------------------------------------------------------------


def test_empty_inputs_give_an_empty_decision():
    d = schedule([], deque(), 10, held_from(), limits())
    assert d.empty and d.num_tokens == 0 and not d.grants


def test_decodes_are_scheduled_before_prefills_whatever_the_running_order():
    # The prefill comes first in running order and could take the whole budget; the decode
    # still gets its token.
    p = prefilling("p", prompt_len=40, computed=8)
    dec = decoding("d", prompt_len=5)
    d = schedule([p, dec], deque(), 100, held_from(p=2, d=2), limits(max_num_batched_tokens=8))
    assert work(d.decodes) == [("d", 1)]
    assert work(d.prefills) == [("p", 7)]
    assert d.num_tokens == 8
    assert not d.decodes[0].resumed and not d.prefills[0].resumed
    assert sorted(d.grants) == [("d", 6), ("p", 15)]


def test_decodes_first_even_when_the_budget_only_fits_the_decodes():
    decs = [decoding(f"d{i}", prompt_len=3) for i in range(3)]
    p = prefilling("p", prompt_len=20, computed=4)
    w = make_request("w", 5)
    d = schedule([p] + decs, deque([w]), 100, held_from(p=1, d0=1, d1=1, d2=1),
                 limits(max_num_seqs=4, max_num_batched_tokens=4))
    assert work(d.decodes) == [("d0", 1), ("d1", 1), ("d2", 1)]
    assert work(d.prefills) == [("p", 1)]
    assert not d.admitted


def test_chunked_prefill_splits_a_long_prompt_across_iterations():
    lim = limits(max_num_batched_tokens=32, block_size=4, num_blocks=100)
    kv = KVCacheManager(lim.num_blocks, lim.block_size)
    req = make_request("long", prompt_len=100)
    waiting: deque[Request] = deque([req])
    running: list[Request] = []
    chunks = []
    while not req.output_token_ids:
        d = schedule(running, waiting, kv.num_free_blocks, kv.num_held, lim)
        assert d.num_tokens <= 32
        assert kv.allocate(d.grants) is not None
        for r in d.admitted:
            waiting.remove(r)
            running.append(r)
        (w,) = d.prefills
        assert w.resumed == (not chunks)  # only the admitting chunk is "resumed"
        chunks.append(w.num_tokens)
        req.num_computed_tokens += w.num_tokens
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(SAMPLED, now=0.0)
        # The table grows chunk by chunk: just enough blocks for the computed tokens.
        assert kv.num_held("long") == blocks_for(req.num_computed_tokens, 4)
    assert chunks == [32, 32, 32, 4]
    assert req.is_decode


def test_a_prompt_chunk_shares_the_iteration_with_decodes():
    decs = [decoding("d0", 6), decoding("d1", 9)]
    long = make_request("long", prompt_len=500)
    d = schedule(decs, deque([long]), 1000, held_from(d0=2, d1=3),
                 limits(max_num_batched_tokens=16, num_blocks=1000))
    assert work(d.decodes) == [("d0", 1), ("d1", 1)]
    assert work(d.prefills) == [("long", 14)]
    assert ids(d.admitted) == ["long"] and d.prefills[0].resumed
    assert d.num_tokens == 16


def test_waiting_requests_share_what_is_left_of_the_budget_fcfs():
    a, b, c = make_request("a", 5), make_request("b", 20), make_request("c", 3)
    d = schedule([], deque([a, b, c]), 100, held_from(), limits(max_num_batched_tokens=16))
    # a whole, b gets the rest as its first chunk, c waits for the next iteration.
    assert work(d.prefills) == [("a", 5), ("b", 11)]
    assert ids(d.admitted) == ["a", "b"]
    assert d.grants == [("a", 5), ("b", 11)]


def test_running_prefill_is_skipped_only_when_the_budget_is_spent():
    # A hand-built state (two running prompts mid-prefill) that the policy never produces by
    # itself (see Simulator._check_skips); it pins down what the code does with it.
    p1 = prefilling("p1", prompt_len=100, computed=0)
    p2 = prefilling("p2", prompt_len=10, computed=0)
    d = schedule([p1, p2], deque(), 100, held_from(), limits(max_num_batched_tokens=8))
    assert work(d.prefills) == [("p1", 8)]
    assert not d.preempted


def test_max_num_seqs_caps_admission():
    running = [decoding("d0", 4), decoding("d1", 4)]
    waiting = deque(make_request(f"w{i}", 2) for i in range(3))
    d = schedule(running, waiting, 100, held_from(d0=2, d1=2), limits(max_num_seqs=3))
    assert ids(d.admitted) == ["w0"]
    d = schedule([], waiting, 100, held_from(), limits(max_num_seqs=2))
    assert ids(d.admitted) == ["w0", "w1"]


def test_preempted_slots_are_reusable_by_admission():
    # Preempting d1 frees a sequence slot; admission counts running minus victims.
    d0 = decoding("d0", prompt_len=4)   # needs a second block for token 5
    d1 = decoding("d1", prompt_len=8)   # holds 3 blocks (9 tokens)
    w = make_request("w", 2)
    d = schedule([d0, d1], deque([w]), 0, held_from(d0=1, d1=3),
                 limits(max_num_seqs=2, block_size=4))
    assert ids(d.preempted) == ["d1"]
    assert work(d.decodes) == [("d0", 1)]
    # d1's 3 blocks: 1 to d0, 1 to w; w took d1's sequence slot.
    assert ids(d.admitted) == ["w"]


def test_fcfs_admission_stops_at_the_first_request_that_does_not_fit():
    small1, big, small2 = make_request("s1", 4), make_request("big", 40), make_request("s2", 4)
    # 5 free blocks of 4: s1 takes 1, big needs 10 (its whole prompt fits the token budget).
    d = schedule([], deque([small1, big, small2]), 5, held_from(),
                 limits(max_num_batched_tokens=64, block_size=4, num_blocks=20))
    assert ids(d.admitted) == ["s1"]  # s2 would fit but must not overtake big
    assert d.grants == [("s1", 4)]


def test_fcfs_admission_is_judged_on_the_chunk_not_the_whole_prompt():
    big = make_request("big", 400)
    d = schedule([], deque([big]), 5, held_from(),
                 limits(max_num_batched_tokens=16, block_size=4, num_blocks=200))
    assert work(d.prefills) == [("big", 16)] and d.grants == [("big", 16)]


def test_admission_never_preempts_running_work():
    dec = decoding("d", prompt_len=3)  # 4 tokens, 3 computed: fits its one block
    w = make_request("w", 4)
    d = schedule([dec], deque([w]), 0, held_from(d=1), limits(block_size=4, num_blocks=8))
    assert work(d.decodes) == [("d", 1)]
    assert not d.preempted and not d.admitted


def test_preemption_picks_the_cheapest_victim_to_redo():
    # d0 crosses a block boundary with no free block. Same class, never preempted: the
    # victim is the one with the fewest computed tokens to redo, d2 (5) — not d3 (6, the
    # latest admitted) nor d1 (8). d2's two blocks cover d0's and d1's growth.
    d0 = decoding("d0", prompt_len=4)
    d1 = decoding("d1", prompt_len=8)
    d2 = decoding("d2", prompt_len=5)
    d3 = decoding("d3", prompt_len=6)
    held = held_from(d0=1, d1=2, d2=2, d3=2)
    d = schedule([d0, d1, d2, d3], deque(), 0, held, limits(block_size=4, num_blocks=7))
    assert ids(d.preempted) == ["d2"]
    assert work(d.decodes) == [("d0", 1), ("d1", 1), ("d3", 1)]
    assert sorted(d.grants) == [("d0", 5), ("d1", 9), ("d3", 7)]


def test_preemption_prefers_the_least_important_class_then_the_least_preempted():
    a = decoding("a", prompt_len=4)          # needs a new block, none free
    cheap_vip = decoding("vip", prompt_len=5)
    cheap_vip.priority = -1                  # more important than everyone
    batch = decoding("batch", prompt_len=9)
    batch.priority = 10                      # least important: the victim despite its cost
    d = schedule([a, cheap_vip, batch], deque(), 0, held_from(a=1, vip=2, batch=3),
                 limits(block_size=4, num_blocks=6))
    assert ids(d.preempted) == ["batch"]
    # Same class: the one preempted before is spared even though it is cheaper to redo.
    x = decoding("x", prompt_len=4)
    again = decoding("again", prompt_len=5)
    again.num_preemptions = 1
    fresh = decoding("fresh", prompt_len=6)
    d = schedule([x, again, fresh], deque(), 0, held_from(x=1, again=2, fresh=2),
                 limits(block_size=4, num_blocks=5))
    assert ids(d.preempted) == ["fresh"]


def test_decodes_run_most_important_class_first_so_it_never_preempts_itself():
    low = decoding("low", prompt_len=4)
    low.priority = 5
    high = decoding("high", prompt_len=4)
    # Both need a block; one is free. Running order puts low first, class order high first:
    # high gets the block and low (not yet scheduled) is the victim.
    d = schedule([low, high], deque(), 1, held_from(low=1, high=1), limits(block_size=4))
    assert work(d.decodes) == [("high", 1)] and ids(d.preempted) == ["low"]


def test_preemption_takes_victims_latest_first_until_it_fits():
    d0 = decoding("d0", prompt_len=4)
    p1 = prefilling("p1", prompt_len=40, computed=4)
    p2 = prefilling("p2", prompt_len=40, computed=4)
    d = schedule([d0, p1, p2], deque(), 0, held_from(d0=1, p1=1, p2=1),
                 limits(max_num_batched_tokens=8, block_size=4, num_blocks=3))
    # d0 preempts p2 for its block; p1 then needs 2 more blocks for its 7-token chunk and has
    # nobody left to preempt (d0 is scheduled), so p1 preempts itself.
    assert ids(d.preempted) == ["p2", "p1"]
    assert work(d.decodes) == [("d0", 1)] and not d.prefills
    assert d.grants == [("d0", 5)]


def test_a_scheduled_request_is_never_a_victim():
    d0, d1 = decoding("d0", prompt_len=4), decoding("d1", prompt_len=4)
    # Each needs one new block; one is free. d0 takes it; d1 cannot preempt d0 (scheduled)
    # so d1 itself is preempted.
    d = schedule([d0, d1], deque(), 1, held_from(d0=1, d1=1), limits(block_size=4))
    assert work(d.decodes) == [("d0", 1)]
    assert ids(d.preempted) == ["d1"]


def test_a_request_needing_more_blocks_than_the_pool_is_rejected():
    huge = make_request("huge", 4 * 10 + 1)  # 11 blocks of 4; the pool has 10
    ok = make_request("ok", 4)
    d = schedule([], deque([huge, ok]), 10, held_from(),
                 limits(max_num_batched_tokens=100, block_size=4, num_blocks=10))
    assert [(r.request_id) for r, _ in d.rejected] == ["huge"]
    assert "11" in d.rejected[0][1] and "10" in d.rejected[0][1]
    # Rejection does not block the queue.
    assert ids(d.admitted) == ["ok"]
    exact = make_request("exact", 40)
    d = schedule([], deque([exact]), 10, held_from(),
                 limits(max_num_batched_tokens=100, block_size=4, num_blocks=10))
    assert not d.rejected and ids(d.admitted) == ["exact"]


def test_schedule_does_not_mutate_its_arguments():
    running = [decoding("d0", 4), prefilling("p", 30, 8), decoding("d1", 4)]
    waiting = deque([make_request("w0", 10), make_request("w1", 3)])
    before = [(r.request_id, r.status, r.num_computed_tokens, list(r.token_ids))
              for r in list(running) + list(waiting)]
    schedule(running, waiting, 1, held_from(d0=1, p=2, d1=2), limits(max_num_batched_tokens=12))
    assert ids(running) == ["d0", "p", "d1"] and ids(waiting) == ["w0", "w1"]
    assert before == [(r.request_id, r.status, r.num_computed_tokens, list(r.token_ids))
                      for r in list(running) + list(waiting)]


# -- the simulator -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arrival:
    iteration: int
    prompt_len: int
    max_tokens: int
    priority: int = 0
    tenant: str | None = None


class Simulator:
    """waiting/running Requests over a real KVCacheManager, stepped like SchedulerActor.

    Optional scheduler features, as SchedulerActor applies them: `fair` orders the waiting
    queue each iteration (the iteration number is the clock) and is charged the tokens
    computed; `admission` is the KV plan's watermark and lookahead; `budgets(i)` is the
    SLO prefill budget of iteration i (None: static); `swap(victim)` picks the preemption
    mode (a swapped victim keeps its computed tokens and comes back with a plain grant)."""

    def __init__(self, lim: PolicyLimits, arrivals: list[Arrival], *, fair=None,
                 admission: AdmissionParams = AdmissionParams(), budgets=None, swap=None):
        self.lim = lim
        self.fair = fair
        self.admission = admission
        self.budgets = budgets
        self.swap = swap
        self.admitted_at: dict[str, int] = {}
        self.num_swaps = 0
        self.kv = KVCacheManager(lim.num_blocks, lim.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.max_tokens: dict[str, int] = {}
        self.future = deque(sorted(
            (a.iteration, i, a) for i, a in enumerate(arrivals)))
        self.iteration = 0
        self.num_preemptions = 0
        # Starvation bookkeeping: consecutive iterations a running request was neither
        # scheduled nor preempted (see _check_skips for why the bound is 0).
        self.skips: dict[str, int] = {}
        self.max_skips = 0

    @property
    def done(self) -> bool:
        return not self.future and not self.waiting and not self.running

    def _arrive(self) -> None:
        while self.future and self.future[0][0] <= self.iteration:
            _, i, a = self.future.popleft()
            req = make_request(f"r{i}", a.prompt_len, a.max_tokens)
            req.priority, req.tenant, req.arrival_seq = a.priority, a.tenant, i
            req.arrival_time = float(self.iteration)
            self.max_tokens[req.request_id] = a.max_tokens
            self.waiting.append(req)

    def step(self) -> Decision:
        self._arrive()
        lim, kv = self.lim, self.kv
        running_before = list(self.running)
        waiting_before = list(self.waiting)
        order = (self.fair.order(self.waiting, float(self.iteration)) if self.fair is not None
                 else self.waiting)
        budget = self.budgets(self.iteration) if self.budgets is not None else None
        d = schedule(self.running, order, kv.num_free_blocks, kv.num_held, lim,
                     prefill_budget=budget, admission=self.admission, preempt_mode=self.swap)
        self._check_decision(d, running_before, waiting_before)
        if budget is not None:
            assert sum(w.num_tokens for w in d.prefills) <= budget
        self._check_skips(d, running_before)

        # 1. Preemptions, as SchedulerActor._apply_preemptions (its frees reach the KV manager
        # before the grants, in the same KVUpdate).
        for req in d.preempted:
            self.running.remove(req)
            req.transition(S.PREEMPTED)
            req.transition(S.WAITING_PREFILL)
            if req.request_id in d.swapped:
                self.num_swaps += 1   # its KV waits in host memory: nothing to recompute
                req.swapped_slots = [0]
            else:
                req.num_computed_tokens = 0
            req.num_preemptions += 1
            self.num_preemptions += 1
            kv.free(req.request_id)
            self.waiting.appendleft(req)
        assert not d.rejected, f"every request fits the pool alone, yet {d.rejected}"

        # 2. One atomic allocation of exactly the granted token counts.
        new_blocks = kv.allocate(d.grants)
        assert new_blocks is not None, f"KV refused a decision made from its own view: {d}"
        kv.check_integrity()

        # 3. Admission and status, as SchedulerActor._admit.
        for req in d.admitted:
            self.waiting.remove(req)
            self.running.append(req)
            req.swapped_slots = None
            self.admitted_at.setdefault(req.request_id, self.iteration)
        assert len(self.running) <= lim.max_num_seqs
        for w in d.prefills:
            if w.request.status == S.WAITING_PREFILL:
                w.request.transition(S.PREFILLING)
        for w in d.decodes:
            if w.request.status == S.WAITING_DECODE:
                w.request.transition(S.DECODING)

        # 4. The forward pass and postprocess: computed tokens advance; a sequence whose
        # known tokens are now all computed samples one token.
        scheduled = d.decodes + d.prefills
        samplers = [w.request for w in scheduled
                    if w.request.num_computed_tokens + w.num_tokens == w.request.num_tokens]
        for w in scheduled:
            w.request.num_computed_tokens += w.num_tokens
            if self.fair is not None:
                self.fair.charge(w.request.tenant, w.num_tokens)
        for req in samplers:
            req.append_token(SAMPLED, now=float(self.iteration))
            reason = req.check_stop()
            if reason is not None:
                assert reason is FinishReason.LENGTH
                self.running.remove(req)
                req.transition(S.FINISHED)
                req.finish_reason = reason
                kv.free(req.request_id)
                self.finished.append(req)
                self.skips.pop(req.request_id, None)
            elif req.status == S.PREFILLING:
                req.transition(S.WAITING_DECODE)

        self._check_state()
        self.iteration += 1
        return d

    def _check_decision(self, d: Decision, running: list[Request],
                        waiting: list[Request]) -> None:
        lim = self.lim
        assert d.num_tokens <= lim.max_num_batched_tokens
        for w in d.decodes:
            assert w.num_tokens == 1, f"decode got {w.num_tokens} tokens"
            assert w.request.is_decode and w.request in running and not w.resumed
        for w in d.prefills:
            assert 1 <= w.num_tokens <= w.request.num_remaining_tokens
            # (a request swapped back in resumes with its one pending token, as a "prefill")
            assert not w.request.is_decode or w.request.swapped_slots is not None
            assert w.resumed == (w.request in d.admitted)
        sched = [w.request.request_id for w in d.decodes + d.prefills]
        assert len(sched) == len(set(sched)), "a request scheduled twice"
        victims = [r.request_id for r in d.preempted]
        assert len(victims) == len(set(victims))
        assert not set(victims) & set(sched), "a preempted request was also scheduled"
        assert all(r in running for r in d.preempted)
        assert all(r in waiting for r in d.admitted)
        # Grants are exactly the scheduled work, with the token total it reaches.
        assert sorted(d.grants) == sorted(
            (w.request.request_id, w.request.num_computed_tokens + w.num_tokens)
            for w in d.decodes + d.prefills)
        # Progress: with blocks freed at once, any work that exists can run, so an iteration
        # with requests in the system is never empty.
        if running or waiting:
            assert not d.empty, f"idle iteration with work: {running} {waiting}"

    def _check_skips(self, d: Decision, running: list[Request]) -> None:
        """Starvation: every request that stays running is scheduled in every iteration.

        Why the bound is 0 consecutive skips, not merely "bounded":
        - Decodes come first and get 1 token each: they are at most max_num_seqs <=
          max_num_batched_tokens, so the budget never stops one; KV exhaustion preempts it
          instead of skipping it.
        - The policy skips a running *prefill* only when the token budget is spent. But at
          most one running request is ever mid-prompt: a waiting request is admitted only
          while budget is left after the running prefill, i.e. only once that prefill took
          all its remaining tokens, so everything admitted before it has finished its prompt.
          That one prefill comes first among prefills and gets >= 1 token, because decodes
          use at most max_num_seqs - 1 of the budget when a prefill is running.
        So each running request is, every iteration, scheduled or preempted. The policy code
        could skip a second running prefill (see test_running_prefill_is_skipped_only_when_
        the_budget_is_spent), but no sequence of its own decisions reaches that state.
        """
        sched = {w.request.request_id for w in d.decodes + d.prefills}
        victims = {r.request_id for r in d.preempted}
        mid_prompt = [r.request_id for r in running if not r.is_decode]
        assert len(mid_prompt) <= 1, f"several running requests mid-prompt: {mid_prompt}"
        for req in running:
            rid = req.request_id
            if rid in sched or rid in victims:
                self.skips[rid] = 0
                continue
            self.skips[rid] = self.skips.get(rid, 0) + 1
            self.max_skips = max(self.max_skips, self.skips[rid])
            kind = "decode" if req.is_decode else "prefill"
            raise AssertionError(f"running {kind} {rid} neither scheduled nor preempted "
                                 f"({self.skips[rid]} consecutive skips)")

    def _check_state(self) -> None:
        kv, bs = self.kv, self.lim.block_size
        kv.check_integrity()
        for req in self.running:
            # Blocks cover the computed tokens, and (grants being exact) no more than that.
            assert kv.num_held(req.request_id) * bs >= req.num_computed_tokens
            assert kv.num_held(req.request_id) == blocks_for(req.num_computed_tokens, bs)
            assert req.status in (S.PREFILLING, S.WAITING_DECODE, S.DECODING)
        for req in self.waiting:
            assert kv.num_held(req.request_id) == 0
            assert req.num_computed_tokens == 0 or req.swapped_slots is not None
            assert req.status is S.WAITING_PREFILL
        assert sum(kv.num_held(r.request_id) for r in self.running) == kv.num_used_blocks

    def run(self, max_iterations: int) -> None:
        while not self.done:
            assert self.iteration < max_iterations, (
                f"no completion after {self.iteration} iterations: livelock? "
                f"running={self.running} waiting={list(self.waiting)}")
            self.step()


def kv_need(prompt_len: int, max_tokens: int) -> int:
    # The last sampled token is never fed back, so its KV is never stored.
    return prompt_len + max_tokens - 1


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([4, 8, 16]))
    n = draw(st.integers(1, 12))
    arrivals = [Arrival(iteration=draw(st.integers(0, 60)), prompt_len=draw(st.integers(1, 300)),
                        max_tokens=draw(st.integers(1, 40))) for _ in range(n)]
    biggest = max(blocks_for(kv_need(a.prompt_len, a.max_tokens), block_size) for a in arrivals)
    # Just enough for the largest request alone, plus a little: preemption is frequent.
    num_blocks = biggest + draw(st.integers(0, max(1, biggest // 2)))
    max_num_seqs = draw(st.integers(1, 8))
    max_num_batched_tokens = draw(st.integers(max_num_seqs, 128))
    lim = PolicyLimits(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       block_size=block_size, num_blocks=num_blocks)
    return lim, arrivals


def liveness_bound(arrivals: list[Arrival]) -> int:
    # Without preemption every non-idle iteration computes >= 1 token, so last arrival + total
    # tokens is enough; allow 4x for recompute after preemptions. Observed runs stay well under.
    total = sum(a.prompt_len + a.max_tokens for a in arrivals)
    return max(a.iteration for a in arrivals) + 1 + 4 * total


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_simulation_invariants_hold_every_iteration(scenario):
    lim, arrivals = scenario
    sim = Simulator(lim, arrivals)
    sim.run(liveness_bound(arrivals))
    # Every request finished, with exactly its max_tokens outputs, and nothing leaked.
    assert len(sim.finished) == len(arrivals)
    for req in sim.finished:
        assert req.status is S.FINISHED and req.finish_reason is FinishReason.LENGTH
        assert req.num_output_tokens == sim.max_tokens[req.request_id]
        assert req.output_token_ids == [SAMPLED] * sim.max_tokens[req.request_id]
    assert sim.kv.num_free_blocks == lim.num_blocks and sim.kv.num_used_blocks == 0
    sim.kv.check_integrity()
    # No running request was ever left out of an iteration (K = 0; see Simulator._check_skips).
    assert sim.max_skips == 0


@settings(max_examples=100, deadline=None)
@given(block_size=st.sampled_from([4, 8, 16]), seed_lens=st.lists(
    st.tuples(st.integers(1, 300), st.integers(1, 40)), min_size=4, max_size=10))
def test_a_tight_pool_preempts_yet_every_request_completes(block_size, seed_lens):
    # All requests at once into a pool that fits only the biggest one: preemption (and its
    # recompute) is the common path, not the exception.
    arrivals = [Arrival(0, p, m) for p, m in seed_lens]
    biggest = max(blocks_for(kv_need(a.prompt_len, a.max_tokens), block_size) for a in arrivals)
    lim = PolicyLimits(max_num_seqs=8, max_num_batched_tokens=64, block_size=block_size,
                       num_blocks=biggest)
    sim = Simulator(lim, arrivals)
    sim.run(liveness_bound(arrivals))
    assert sorted(r.num_output_tokens for r in sim.finished) == sorted(m for _, m in seed_lens)
    assert sim.kv.num_used_blocks == 0


def test_simulator_sees_preemption_and_recompute():
    # A fixed scenario that must preempt: two decoders outgrow a 6-block pool.
    arrivals = [Arrival(0, 8, 12), Arrival(0, 8, 12)]
    lim = PolicyLimits(max_num_seqs=2, max_num_batched_tokens=16, block_size=4, num_blocks=6)
    sim = Simulator(lim, arrivals)
    sim.run(liveness_bound(arrivals))
    assert sim.num_preemptions >= 1
    assert all(r.num_output_tokens == 12 for r in sim.finished)
    # The preempted one recomputed its prompt and earlier outputs, and still finished.
    assert any(r.num_preemptions for r in sim.finished)


# -- scheduling features: classes, fair share, KV plan, SLO budgets, swap -----------------


@st.composite
def featured_scenarios(draw):
    lim, arrivals = draw(scenarios())
    arrivals = [dataclasses.replace(a, priority=draw(st.sampled_from([0, 0, 1, 10])),
                                    tenant=draw(st.sampled_from([None, "a", "b"])))
                for a in arrivals]
    admission = AdmissionParams(min_free_blocks=draw(st.integers(0, 3)),
                                lookahead_tokens=draw(st.integers(0, 64)))
    budgets = draw(st.lists(st.one_of(st.none(), st.integers(1, 64)), min_size=1, max_size=8))
    aging = draw(st.sampled_from([0.0, 5.0]))
    swap = draw(st.booleans())
    return lim, arrivals, admission, budgets, aging, swap


def swap_odd_ids(req: Request) -> str:
    return "swap" if req.num_computed_tokens and int(req.request_id[1:]) % 2 else "recompute"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(featured_scenarios())
def test_invariants_hold_with_classes_fair_share_kv_plan_slo_budgets_and_swap(scenario):
    """Whatever arrives, in any class and tenant, under any prefill budget, watermark and
    lookahead, with swap or recompute victims: every request completes with its exact token
    count, nothing leaks, and a running decode is never left out of an iteration
    (invariant 3 with K = 0; see Simulator._check_skips)."""
    from tokenloom.actors.fairness import FairShare

    lim, arrivals, admission, budgets, aging, swap = scenario
    sim = Simulator(lim, arrivals, fair=FairShare({"a": 2.0}, aging_seconds=aging),
                    admission=admission, budgets=lambda i: budgets[i % len(budgets)],
                    swap=swap_odd_ids if swap else None)
    sim.run(liveness_bound(arrivals))
    assert len(sim.finished) == len(arrivals)
    for req in sim.finished:
        assert req.num_output_tokens == sim.max_tokens[req.request_id]
    assert sim.kv.num_used_blocks == 0
    assert sim.max_skips == 0


def test_swap_preemption_keeps_computed_tokens_and_completes():
    arrivals = [Arrival(0, 8, 12), Arrival(0, 8, 12), Arrival(0, 9, 12)]
    lim = PolicyLimits(max_num_seqs=3, max_num_batched_tokens=32, block_size=4, num_blocks=8)
    sim = Simulator(lim, arrivals, swap=lambda r: "swap")
    sim.run(liveness_bound(arrivals))
    assert sim.num_swaps >= 1 and sim.num_swaps == sim.num_preemptions
    assert all(r.num_output_tokens == 12 for r in sim.finished)


def test_a_flooding_tenant_cannot_delay_another_tenants_request_beyond_a_bound():
    """Tenant A floods 50 requests; tenant B's single request arrives later. With fair
    share B is admitted as soon as one sequence slot turns over (a slot frees at least every
    prompt + max_tokens iterations); first-come-first-served would make it wait for all
    of A's backlog."""
    from tokenloom.actors.fairness import FairShare

    flood = [Arrival(0, 16, 8, tenant="A") for _ in range(50)]
    late = Arrival(3, 16, 8, tenant="B")
    lim = PolicyLimits(max_num_seqs=4, max_num_batched_tokens=64, block_size=4,
                       num_blocks=400)
    bound = 1 + 8 + 1   # one request's lifetime (1 prefill + 8 decode iterations), +1
    fair = Simulator(lim, flood + [late], fair=FairShare())
    fair.run(10_000)
    fifo = Simulator(lim, flood + [late])
    fifo.run(10_000)
    b = "r50"
    assert fair.admitted_at[b] - late.iteration <= bound
    assert fifo.admitted_at[b] - late.iteration > 8 * bound   # the unfair baseline
    assert len(fair.finished) == 51


def test_a_higher_class_is_admitted_first_and_aging_lifts_a_starved_low_class():
    from tokenloom.actors.fairness import FairShare

    fs = FairShare(aging_seconds=10.0)
    low = make_request("low", 4)
    low.priority, low.arrival_time, low.arrival_seq = 10, 0.0, 1
    high = make_request("high", 4)
    high.priority, high.arrival_time, high.arrival_seq = 0, 5.0, 2
    assert ids(fs.order([low, high], now=6.0)) == ["high", "low"]
    # 100 s later the low request has aged 10 classes: it ties with, then beats, new work.
    high.arrival_time = 105.0
    assert ids(fs.order([high, low], now=106.0)) == ["low", "high"]


def test_kv_plan_waits_for_projected_growth_and_records_why():
    # d holds 2 blocks and will grow 4 more over a 16-token lookahead (block 4). The pool
    # has 6 free: a 4-token prompt (1 block + 4 growth) would leave 6-1-4-4 < 0 -> wait.
    d0 = decoding("d0", prompt_len=7)            # 8 tokens, max_tokens 16
    w = make_request("w", 4)
    adm = AdmissionParams(min_free_blocks=0, lookahead_tokens=16)
    d = schedule([d0], deque([w]), 6, held_from(d0=2), limits(block_size=4), admission=adm)
    assert not d.admitted and d.blocked is not None
    req, why, plan = d.blocked
    assert req is w and why == "kv"
    assert plan["projected_growth_blocks"] == 4 and plan["running_reserved_blocks"] == 4
    # Without the lookahead it is admitted (the static view: only the chunk must fit) ...
    d = schedule([d0], deque([w]), 6, held_from(d0=2), limits(block_size=4))
    assert ids(d.admitted) == ["w"] and d.plans["w"]["chunk_blocks"] == 1
    # ... and with nothing running it is admitted whatever the plan says (liveness).
    d = schedule([], deque([w]), 2, held_from(), limits(block_size=4),
                 admission=AdmissionParams(min_free_blocks=10, lookahead_tokens=64))
    assert ids(d.admitted) == ["w"]


def test_a_prompt_that_can_never_fit_is_rejected_naming_the_limit():
    huge = make_request("huge", 100)
    d = schedule([], deque([huge]), 10, held_from(), limits(block_size=4, num_blocks=10))
    assert [r.request_id for r, _ in d.rejected] == ["huge"]
    assert "25 KV blocks" in d.rejected[0][1] and "only 10 blocks (40 tokens)" in d.rejected[0][1]


def test_the_kv_plan_reduces_preemptions_in_a_tight_pool():
    arrivals = [Arrival(i, 24, 40) for i in range(8)]
    lim = PolicyLimits(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_blocks=40)
    static = Simulator(lim, arrivals)
    static.run(liveness_bound(arrivals))
    planned = Simulator(lim, arrivals, admission=AdmissionParams(min_free_blocks=1,
                                                                 lookahead_tokens=40))
    planned.run(liveness_bound(arrivals))
    assert static.num_preemptions > 0
    assert planned.num_preemptions < static.num_preemptions
