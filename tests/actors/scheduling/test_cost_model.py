"""The online step-cost model and the SLO chunk size it implies; the swap space's slots;
the per-request trace. Pure modules, no engine."""

from __future__ import annotations

import random

import pytest

from tokenloom.actors.scheduling.cost_model import AttentionWork, StepCostModel, attention_work
from tokenloom.actors.scheduling.swap import SwapSpace
from tokenloom.actors.messages import RequestMeta
from tokenloom.actors.scheduling.trace import RequestTrace, TraceHistory


def synthetic(tokens: int, attn: AttentionWork | float, read_cost: float = 0.0) -> float:
    """A step time with a per-step, a per-token, a per-pair and a per-key-read cost."""
    if not isinstance(attn, AttentionWork):
        attn = AttentionWork(pairs=attn)
    return 0.010 + 0.0005 * tokens + 0.05 * attn.pairs + read_cost * attn.reads


def measured(tokens: int, attn: AttentionWork) -> float:
    """Step time with the coefficients fitted on SmolLM2-135M fp32, 2 CPU cores
    (benchmarks/mixed_step.py): 54 ms + 1.2 ms/token + 0.49 s per million (causal) pairs +
    1.09 s per million keys read (16 decodes at context 1024: 25 ms of attention)."""
    return 0.054 + 0.0012 * tokens + 0.49 * attn.pairs + 1.09 * attn.reads


def _random_step(rng: random.Random) -> tuple[int, AttentionWork, int]:
    """tokens, attention work and prefill tokens of a random mixed iteration."""
    decodes = rng.randint(1, 32)
    chunk = rng.choice([0, 0, 16, 64, 256, 1024])
    start = rng.randint(0, 2000)
    attn = sum(attention_work(1, rng.randint(10, 2000)) for _ in range(decodes))
    attn += attention_work(chunk, start) if chunk else 0
    return decodes + chunk, attn, chunk


def test_attention_work_counts_pairs_and_keys_read_and_adds_up():
    assert attention_work(1, 99) == AttentionWork(pairs=100 / 1e6, reads=100 / 1e6)
    # causal: 1024 cached keys for each new token, then 1..512 of the chunk's own
    assert attention_work(512, 1024) == AttentionWork((512 * 1024 + 512 * 513 // 2) / 1e6,
                                                      1536 / 1e6)
    work = 0.0                                   # how the scheduler sums a batch
    for n, start in ((1, 9), (1, 19), (30, 0)):
        work += attention_work(n, start)
    assert (work.pairs, work.reads) == pytest.approx(((10 + 20 + 465) / 1e6, 60 / 1e6))
    assert sum(attention_work(1, 9) for _ in range(3)) == attention_work(1, 9) * 3
    with pytest.raises(TypeError):
        attention_work(1, 9) + 1.0               # not a number: no silent mixing of units


def test_fit_recovers_the_coefficients_of_a_noisy_linear_step_time():
    rng = random.Random(0)
    m = StepCostModel()
    for _ in range(200):
        tokens, attn, chunk = _random_step(rng)
        m.observe(tokens, attn, synthetic(tokens, attn, read_cost=0.3) * rng.uniform(0.97, 1.03),
                  prefill_tokens=chunk)
    c0, c1, c2, c3, c4 = m.coef
    assert c4 == pytest.approx(0.0, abs=1e-4)   # sampled rows cost nothing extra here
    assert c0 == pytest.approx(0.010, rel=0.2)
    assert c1 == pytest.approx(0.0005, rel=0.1)
    assert c2 == pytest.approx(0.05, rel=0.3)
    assert c3 == pytest.approx(0.3, rel=0.3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_small_decode_batches_and_small_deep_chunks_are_priced(seed):
    """A decode batch is memory-bound (one pair per key read), a chunk deep in a prompt
    compute-bound (many pairs per key read). With pairs alone the fit folds the decodes'
    reads into the per-step constant: right for the average batch, ~1.5x too high for 1-4
    decodes at short contexts (the SLO target, a multiple of it, then allows 1.5x the ITL),
    ~1.6x too low for 64 decodes at 2000 (prefill starves) and ~1.25x too high for a
    16-token chunk at 2000. With keys read as their own feature, every shape is priced."""
    rng = random.Random(seed)
    m = StepCostModel()
    for _ in range(300):
        tokens, attn, chunk = _random_step(rng)
        m.observe(tokens, attn, measured(tokens, attn) * rng.uniform(0.98, 1.02),
                  prefill_tokens=chunk)
    for decodes, context, chunk, start in ((16, 1024, 0, 0), (4, 256, 0, 0), (1, 100, 0, 0),
                                           (64, 2000, 0, 0), (16, 1024, 512, 1024),
                                           (0, 0, 16, 2000), (4, 256, 64, 0)):
        attn = sum(attention_work(1, context - 1) for _ in range(decodes))
        attn += attention_work(chunk, start) if chunk else 0
        # (64 decodes extrapolate past the data's 32, with one more feature to fit: 8%)
        assert m.predict(decodes + chunk, attn, rows=decodes) == pytest.approx(
            measured(decodes + chunk, attn), rel=0.08 if decodes > 32 else 0.05), (
            decodes, context, chunk, start)
    # The SLO chunk for 4 decodes at 256 and a target of twice their step keeps it.
    decodes = sum(attention_work(1, 255) for _ in range(4))
    target = 2 * measured(4, decodes)
    budget = m.max_prefill_tokens(target, 4, decodes, prefill_start=0, lo=16, hi=2048)
    assert measured(4 + budget, decodes + attention_work(budget, 0)) == pytest.approx(
        target, rel=0.05)


def test_bare_numbers_still_count_as_pairs():
    m = StepCostModel()
    for t in range(1, 300, 7):
        a = t * t / 1e6
        m.observe(t, a, synthetic(t, a), prefill_tokens=t)
    assert m.coef[3] == 0.0
    assert m.predict(100, 0.01) == pytest.approx(synthetic(100, 0.01), rel=0.02)


def test_sampled_rows_are_priced_apart_from_tokens():
    """Speculative rows pay an LM-head row and sampling that prefill tokens do not: with
    decodes, prefill chunks and verification steps in the data, the fit tells them apart."""
    rng = random.Random(3)
    m = StepCostModel()

    def cost(tokens, rows):
        return 0.02 + 0.0003 * tokens + 0.0006 * rows

    for _ in range(200):
        decodes = rng.randint(1, 16)
        chunk = rng.choice([0, 0, 64, 256])
        drafts = rng.choice([0, 0, decodes * 2, decodes * 4])
        tokens, rows = decodes + chunk + drafts, decodes + drafts
        m.observe(tokens, 0.0, cost(tokens, rows) * rng.uniform(0.98, 1.02),
                  prefill_tokens=chunk, rows=rows)
    # 16 decodes each verifying 4 drafts, against what a per-token price would say
    assert m.predict(80, 0.0, rows=80) == pytest.approx(cost(80, 80), rel=0.05)
    assert m.predict(16 + 512, 0.0, rows=16) == pytest.approx(cost(528, 16), rel=0.05)


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
        m.observe(t, 0.0, synthetic(t, 0.0), prefill_tokens=t)
    # decodes alone: 0.010 + 0.0005 * 16 = 18 ms; target 50 ms leaves 32 ms = 64 tokens
    n = m.max_prefill_tokens(0.050, decode_tokens=16, decode_attn=0.0, prefill_start=0,
                             lo=8, hi=2048)
    assert n == pytest.approx(64, abs=2)
    assert m.predict(16 + n, 0.0, rows=16) <= 0.050 + 1e-9
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
    tr = RequestTrace("r1", received=100.0, routed=100.001,
                      meta=RequestMeta(priority=10, tenant="t"))
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
        m.observe(16, attn, synthetic(16, attn, 0.3) * rng.uniform(0.98, 1.02))
    # It still knows a 500-token chunk costs about 0.25 s on top of the decodes.
    assert m.predict(516, 0.0) == pytest.approx(synthetic(516, 0.0), rel=0.15)
