"""The online step-cost model and the SLO chunk size it implies; the swap space's slots;
the per-request trace. Pure modules, no engine."""

from __future__ import annotations

import random

import pytest

from tokenloom.actors.cost_model import StepCostModel, attention_work
from tokenloom.actors.swap import SwapSpace
from tokenloom.actors.trace import RequestTrace, TraceHistory


def synthetic(tokens: int, attn: float) -> float:
    return 0.010 + 0.0005 * tokens + 0.05 * attn


def test_fit_recovers_the_coefficients_of_a_noisy_linear_step_time():
    rng = random.Random(0)
    m = StepCostModel()
    for _ in range(200):
        decodes = rng.randint(1, 32)
        chunk = rng.choice([0, 0, 16, 64, 256, 1024])
        start = rng.randint(0, 2000)
        attn = sum(attention_work(1, rng.randint(10, 500)) for _ in range(decodes))
        attn += attention_work(chunk, start)
        tokens = decodes + chunk
        m.observe(tokens, attn, synthetic(tokens, attn) * rng.uniform(0.97, 1.03))
    c0, c1, c2 = m.coef
    assert c0 == pytest.approx(0.010, rel=0.2)
    assert c1 == pytest.approx(0.0005, rel=0.1)
    assert c2 == pytest.approx(0.05, rel=0.3)


def test_not_ready_until_enough_samples_and_never_negative():
    m = StepCostModel(min_samples=16)
    for i in range(15):
        m.observe(10 + i, 0.0, 0.05)
    assert not m.ready
    # Time falls as tokens grow (noise): the token coefficient is clamped at 0, not negative.
    for i in range(40):
        m.observe(10 + i, 0.0, 0.05 - 0.0001 * i)
    assert m.ready and (m.coef >= 0).all()


def test_chunk_size_keeps_the_predicted_iteration_within_the_target():
    m = StepCostModel()
    for t in range(1, 300, 7):
        m.observe(t, 0.0, synthetic(t, 0.0))
    # decodes alone: 0.010 + 0.0005 * 16 = 18 ms; target 50 ms leaves 32 ms = 64 tokens
    n = m.max_prefill_tokens(0.050, decode_tokens=16, decode_attn=0.0, prefill_start=0,
                             lo=8, hi=2048)
    assert n == pytest.approx(64, abs=2)
    assert m.predict(16 + n, 0.0) <= 0.050 + 1e-9
    # clamps: a generous target gives the static budget, an impossible one the minimum
    assert m.max_prefill_tokens(10.0, 16, 0.0, 0, 8, 2048) == 2048
    assert m.max_prefill_tokens(0.001, 16, 0.0, 0, 8, 2048) == 8


def test_deeper_prompts_get_smaller_chunks_when_attention_costs():
    m = StepCostModel()
    rng = random.Random(1)
    for _ in range(100):
        t, a = rng.randint(1, 512), rng.uniform(0, 2)
        m.observe(t, a, synthetic(t, a))
    shallow = m.max_prefill_tokens(0.2, 8, 0.0, prefill_start=0, lo=1, hi=4096)
    deep = m.max_prefill_tokens(0.2, 8, 0.0, prefill_start=50_000, lo=1, hi=4096)
    assert deep < shallow


def test_swap_space_hands_out_and_takes_back_slots():
    sp = SwapSpace(4)
    a = sp.allocate(3)
    assert sorted(a) == [0, 1, 2] and sp.num_free == 1
    assert sp.allocate(2) is None and sp.num_free == 1   # all or nothing
    sp.release(a)
    assert sp.num_free == 4
    with pytest.raises(ValueError, match="released twice"):
        sp.release([0])


def test_trace_records_events_gaps_and_exports_relative_times():
    tr = RequestTrace("r1", received=100.0, routed=100.001, priority=10, tenant="t")
    tr.mark("admitted", 100.5)
    tr.token(101.0)
    tr.token(101.1)
    tr.token(101.4)
    d = tr.as_dict(wall_offset=1_000.0)
    names = [e["event"] for e in d["events"]]
    assert names == ["request_received", "routed", "admitted", "first_token"]
    assert d["events"][2]["t"] == pytest.approx(0.5)
    assert d["received_at"] == pytest.approx(1_100.0)
    assert d["decode"]["iterations"] == 2
    assert d["decode"]["max_gap_s"] == pytest.approx(0.3)
    assert d["decode"]["mean_gap_s"] == pytest.approx(0.2)
    assert d["priority"] == 10 and d["tenant"] == "t"


def test_trace_history_is_bounded_and_finds_choices_by_client_id():
    h = TraceHistory(capacity=3)
    for rid in ("a", "cmpl-x-0", "cmpl-x-1", "b"):
        h.add(RequestTrace(rid, received=0.0))
    assert len(h) == 3 and h.get("a") is None           # oldest evicted
    assert [t.request_id for t in h.find("cmpl-x")] == ["cmpl-x-0", "cmpl-x-1"]
    assert [t.request_id for t in h.find("b")] == ["b"]
    assert h.find("cmpl") == [] and h.find("nope") == []


def test_a_long_decode_only_stretch_does_not_erase_what_prefill_costs():
    m = StepCostModel(window=64)
    rng = random.Random(2)
    for _ in range(32):                         # a burst with prefills
        t = rng.randint(16, 1024)
        m.observe(t, 0.0, synthetic(t, 0.0), prefill_tokens=t - 16)
    for i in range(500):                        # then only 16 decodes, context creeping up
        attn = attention_work(1, 100 + i) * 16
        m.observe(16, attn, synthetic(16, attn) * rng.uniform(0.98, 1.02))
    # It still knows a 500-token chunk costs about 0.25 s on top of the decodes.
    assert m.predict(516, 0.0) == pytest.approx(synthetic(516, 0.0), rel=0.15)
