"""The speculation kill switch on a known cost model (pure: no engine, no torch)."""

from __future__ import annotations

import pytest

from tokenloom.actors.scheduling.cost_model import StepCostModel
from tokenloom.actors.speculation.controller import Candidate, SpecController, SpecState


def fitted(c0: float, per_token: float, per_row: float) -> StepCostModel:
    """A cost model fitted on exact step times c0 + per_token * tokens + per_row * rows."""
    m = StepCostModel()
    for decodes in range(1, 33):
        for drafts, chunk in ((0, 0), (2 * decodes, 0), (0, 128)):
            tokens, rows = decodes + drafts + chunk, decodes + drafts
            m.observe(tokens, 0.0, c0 + per_token * tokens + per_row * rows,
                      prefill_tokens=chunk, rows=rows)
    assert m.ready
    return m


def state(ctl: SpecController, rate: float, mode: str = "auto") -> SpecState:
    """A request whose history says each draft position is accepted at `rate`."""
    s = ctl.new_state(mode)
    for _ in range(200):
        s.accepted = [rate * 40] * ctl.k
        s.tried = [40.0] * ctl.k
    return s


def candidates(ctl, rates, context=200, mode="auto"):
    return [Candidate(f"r{i}", state(ctl, r, mode), num_proposed=ctl.k, max_drafts=100,
                      context=context) for i, r in enumerate(rates)]


# Memory-bound small model on CPU: 30 ms per step, 0.2 ms per extra token and row.
CHEAP = dict(c0=0.030, per_token=0.0001, per_row=0.0001)
# Compute-bound: every token costs as much as a step's fixed part / 8.
DEAR = dict(c0=0.010, per_token=0.001, per_row=0.0015)


def test_high_acceptance_at_batch_1_speculates_with_full_k():
    ctl = SpecController("ngram", k=4)
    ctl.cost = fitted(**CHEAP)
    cands = candidates(ctl, [0.9])
    assert ctl.plan(cands, 1, 200, ctl.cost) == {"r0": 4}
    assert cands[0].state.decisions == {"pays": 1}


def test_low_acceptance_does_not_pay():
    ctl = SpecController("ngram", k=4)
    ctl.cost = fitted(**DEAR)
    cands = candidates(ctl, [0.02])
    assert ctl.plan(cands, 8, 1600, ctl.cost) == {}
    assert cands[0].state.decisions == {"does_not_pay": 1}


def test_k_shrinks_where_later_positions_rarely_hold():
    """The best k maximises expected accepted tokens minus what the extra tokens cost."""
    ctl = SpecController("ngram", k=4)
    ctl.cost = fitted(**DEAR)
    cands = candidates(ctl, [0.6])
    # T0 = 12.5 ms for one decode; a draft adds 2.5 ms = 0.2 tokens' worth: gains for
    # k = 1..4 are 0.40, 0.56, 0.58, 0.51 tokens per step
    assert ctl.plan(cands, 1, 200, ctl.cost) == {"r0": 3}


def test_large_compute_bound_batch_stops_everyone():
    """32 decodes on a compute-bound model: extra tokens cost their full price, so even
    decent acceptance loses tokens per second; the whole batch stops (and says so)."""
    ctl = SpecController("ngram", k=4)
    ctl.cost = fitted(c0=0.005, per_token=0.002, per_row=0.002)
    cands = candidates(ctl, [0.5] * 32)
    assert ctl.plan(cands, 32, 32 * 200, ctl.cost) == {}
    assert all("pays" not in c.state.decisions for c in cands)


def test_mode_on_skips_the_cost_test_and_no_cost_model_means_no_auto():
    ctl = SpecController("ngram", k=3)
    cands = candidates(ctl, [0.01], mode="on") + candidates(ctl, [0.99])
    cands[1].request_id = "r1"
    assert ctl.plan(cands, 2, 400, ctl.cost) == {"r0": 3}   # cost model not fitted yet
    assert cands[1].state.decisions == {"no_cost_model": 1}


def test_drafts_bounded_by_proposals_and_remaining_tokens():
    ctl = SpecController("ngram", k=4, mode="on")
    c = candidates(ctl, [0.9], mode="on")[0]
    c.num_proposed, c.max_drafts = 3, 2
    assert ctl.plan([c], 1, 200, ctl.cost) == {"r0": 2}
    c.max_drafts = 0     # its next token is its last: nothing to speculate
    assert ctl.plan([c], 1, 200, ctl.cost) == {}


def test_reprobe_and_shadow_scoring():
    ctl = SpecController("ngram", k=4, reprobe_steps=5)
    s = ctl.new_state("auto")
    assert ctl.wants_proposals(s, speculating=False)          # until the cost test says no
    s.note("does_not_pay")
    s.idle_steps = 5
    assert not ctl.wants_proposals(s, speculating=False)
    s.idle_steps = 9
    assert ctl.wants_proposals(s, speculating=False)          # every reprobe_steps steps
    assert ctl.wants_proposals(s, speculating=True)
    s.note("pays")
    s.idle_steps = 5
    assert ctl.wants_proposals(s, speculating=False)
    # Shadow proposals [7, 8, 9]: the model then produced 7, 8, 5 -> two accepted.
    s.shadow = [7, 8, 9]
    for t in (7, 8, 5):
        ctl.score_shadow(s, t)
    assert s.shadow is None
    assert s.tried[:3] == [1.0, 1.0, 1.0] and s.accepted[:3] == [1.0, 1.0, 0.0]
    assert s.rate(0) > 0.5 > s.rate(2)


def test_draft_model_overhead_can_kill_and_idle_requests_probe():
    ctl = SpecController("draft", k=2, reprobe_steps=4)
    ctl.cost = fitted(**CHEAP)
    ctl.observe_draft_time(0.5)          # a draft model far slower than the target
    cands = candidates(ctl, [0.9])
    assert ctl.plan(cands, 1, 200, ctl.cost) == {}
    assert ctl.totals.steps_killed == 1
    cands = candidates(ctl, [0.0])
    cands[0].state.idle_steps = 4
    assert ctl.plan(cands, 1, 200, ctl.cost) == {"r0": 1}     # a probe
    assert cands[0].state.decisions == {"probe": 1}


@pytest.mark.parametrize("mode", ["off"])
def test_off_has_no_state(mode):
    assert SpecController("ngram", k=4).new_state(mode) is None
    assert SpecController("ngram", k=4, mode="on").new_state("auto").mode == "on"


def test_measured_step_times_calibrate_each_batch_size():
    """A linear fit that looks cheap everywhere: at 16 decodes speculation first pays on
    paper; once speculative steps there measure 3x their prediction it no longer does,
    while batch 1 (where they measured as predicted) keeps speculating."""
    ctl = SpecController("ngram", k=4)
    ctl.cost = fitted(**CHEAP)
    cands16 = candidates(ctl, [0.7] * 16)
    assert len(ctl.plan(cands16, 16, 16 * 200, ctl.cost)) == 16
    for _ in range(10):
        ctl.calibrate(16, speculative=False, predicted=0.04, measured=0.04)
        ctl.calibrate(16, speculative=True, predicted=0.05, measured=0.15)
        ctl.calibrate(1, speculative=True, predicted=0.03, measured=0.03)
    assert ctl.plan(candidates(ctl, [0.7] * 16), 16, 16 * 200, ctl.cost) == {}
    assert ctl.plan(candidates(ctl, [0.7]), 1, 200, ctl.cost) == {"r0": 4}
    assert ctl.calibration[16][1] == pytest.approx(3.0, rel=0.05)


def test_new_requests_inherit_the_workloads_acceptance():
    """After many requests whose drafts were all rejected, a new request starts with a low
    estimate and does not pay to learn it again; a fresh engine starts at 0.5."""
    ctl = SpecController("ngram", k=2)
    assert ctl.new_state("auto").rate(0) == pytest.approx(0.5)
    for _ in range(50):
        ctl.observe(ctl.new_state("auto"), 2, 0)
    fresh = ctl.new_state("auto")
    assert fresh.rate(0) < 0.1 and fresh.rate(1) < 0.1
    # A draft costs ~5% of a token's worth here: pays at 0.5, not at the workload's rate.
    ctl.cost = fitted(c0=0.02, per_token=0.0005, per_row=0.0005)
    c = Candidate("r0", fresh, num_proposed=2, max_drafts=10, context=200)
    assert ctl.plan([c], 1, 200, ctl.cost) == {}
    blind = SpecController("ngram", k=2)
    c = Candidate("r0", blind.new_state("auto"), num_proposed=2, max_drafts=10, context=200)
    assert blind.plan([c], 1, 200, ctl.cost) == {"r0": 2}


def test_slo_chunks_leave_room_for_the_drafts_a_step_verifies():
    """The SLO chunker prices the iteration with its verification tokens: the same decodes
    verifying 4 drafts each leave fewer prefill tokens within the ITL target."""
    from tokenloom.actors.sampling_params import SamplingParams
    from tokenloom.actors.scheduling.chunk_sizing import ChunkSizer
    from tokenloom.actors.scheduling.request import Request
    from tokenloom.config.schema import SchedulerConfig
    cost = fitted(c0=0.010, per_token=0.0005, per_row=0.0003)
    decodes = []
    for i in range(4):
        r = Request(f"d{i}", list(range(3, 53)), SamplingParams(max_tokens=64))
        r.append_token(7, 0.0)
        r.num_computed_tokens = r.num_tokens - 1
        assert r.is_decode
        decodes.append(r)
    waiting = [Request("w", list(range(3, 1003)), SamplingParams())]
    cfg = SchedulerConfig(chunking="slo", target_itl_ms=60.0, min_prefill_chunk=8)
    drafts = {r.request_id: 4 for r in decodes}
    sizers = ChunkSizer(cfg, 2048, cost), ChunkSizer(cfg, 2048, cost)
    for _ in range(12):   # the budget at most doubles per iteration: let both settle
        plain = sizers[0].prefill_budget(decodes, waiting)
        speculating = sizers[1].prefill_budget(decodes, waiting, drafts)
    assert plain is not None and speculating is not None
    # 16 more tokens and rows cost 12.8 ms at these prices: ~16 tokens' worth of prefill
    assert 8 <= speculating < plain, (speculating, plain)
