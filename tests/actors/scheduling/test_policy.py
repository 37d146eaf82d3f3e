"""The pure scheduling policy: unit tests of schedule() and of the admission order (no torch,
no asyncio).

The property tests that run whole scenarios — the real SchedulerActor and KVManagerActor with a
fake runner checking every token and KV read — are in test_scheduler_properties.py.
"""

from __future__ import annotations

from collections import deque

from tokenloom.actors.kv.kv_manager import KVCacheManager
from tokenloom.actors.messages import RequestMeta
from tokenloom.actors.scheduling.policy import AdmissionParams, PolicyLimits, schedule
from tokenloom.actors.scheduling.request import Request, RequestStatus
from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.arith import cdiv

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
        assert kv.num_held("long") == cdiv(req.num_computed_tokens, 4)
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
    # itself: a waiting request is admitted only while budget is left after the running
    # prefill, i.e. once that prefill took all its remaining tokens. It pins down what the
    # code does with it.
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
    cheap_vip.meta = RequestMeta(priority=-1)   # more important than everyone
    batch = decoding("batch", prompt_len=9)
    batch.meta = RequestMeta(priority=10)   # least important: the victim despite its cost
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
    low.meta = RequestMeta(priority=5)
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


# -- classes, fair share and the KV plan -------------------------------------------------


def test_a_higher_class_is_admitted_first_and_aging_lifts_a_starved_low_class():
    from tokenloom.actors.scheduling.fairness import FairShare

    fs = FairShare(aging_seconds=10.0)
    low = make_request("low", 4)
    low.meta, low.arrival_time, low.arrival_seq = RequestMeta(priority=10), 0.0, 1
    high = make_request("high", 4)
    high.meta, high.arrival_time, high.arrival_seq = RequestMeta(priority=0), 5.0, 2
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
