"""The restore planner and its transfer models: it restores what is predicted faster than
recomputing, splits a prefix between a fast tier and recompute, weighs load, and the fixed
rules do what their names say."""

from __future__ import annotations

import pytest

from tokenloom.actors.kv.tiers.calibration import PredictionLog, TransferModel
from tokenloom.actors.kv.tiers.planner import (
    RecomputeCost,
    TierCost,
    assign,
    available,
    parse_mode,
    plan_restore,
)

BS, BLOCK = 16, 1 << 20                      # 16 tokens, 1 MiB a block
COEF = (0.002, 1e-4, 0.0, 0.0, 0.0)          # 2 ms a step + 0.1 ms a token


def tier(name, n, latency, mb_s, start=0, wait=0.0):
    held = tuple([False] * start + [True] * n)
    return TierCost(name, held, latency, mb_s * 1e6, wait)


def test_fast_tier_is_restored_slow_one_recomputed():
    cost = RecomputeCost(COEF, chunk_tokens=512)
    fast = plan_restore("cost", 0, [tier("host", 32, 0.0, 10_000)], BS, BLOCK, 600, cost)
    assert fast.num_restore_blocks == 32 and fast.ranges == [("host", 0, 32)]
    slow = plan_restore("cost", 0, [tier("remote", 32, 0.2, 5)], BS, BLOCK, 600, cost)
    assert slow.num_restore_blocks == 0
    assert slow.predicted_ttft_s == pytest.approx(cost.seconds(0, 600))
    assert slow.all_restore_s > slow.all_recompute_s


def test_split_restores_the_fast_part_and_recomputes_the_rest():
    """Host holds the first 8 blocks, a slow remote all 32: restore 8, recompute the rest."""
    cost = RecomputeCost(COEF, chunk_tokens=512)
    plan = plan_restore("cost", 0, [tier("host", 8, 0.0, 10_000), tier("remote", 32, 0.5, 5)],
                        BS, BLOCK, 600, cost)
    assert plan.ranges == [("host", 0, 8)]
    assert plan.predicted_ttft_s < min(plan.all_recompute_s, plan.all_restore_s)


def test_blocks_come_from_the_fastest_tier_holding_them():
    tiers = [tier("disk", 6, 1e-4, 500), tier("host", 3, 0.0, 10_000, start=2)]
    assert available(tiers) == 6
    assert assign(tiers, 4, 10) == [("disk", 4, 6), ("host", 6, 9), ("disk", 9, 10)]


def test_load_makes_recompute_dearer():
    """The same remote restore: not worth it on an idle engine, worth it under load."""
    coef = (0.002, 1e-4, 0.0, 1e-3, 1e-3)
    remote = [tier("remote", 16, 0.02, 500)]
    idle = RecomputeCost(coef, chunk_tokens=64)
    busy = RecomputeCost(coef, decode_tokens=32, decode_reads=0.3, chunk_tokens=64)
    assert busy.seconds(0, 300) > 2 * idle.seconds(0, 300)
    assert plan_restore("cost", 0, remote, BS, BLOCK, 300, idle).num_restore_blocks == 0
    assert plan_restore("cost", 0, remote, BS, BLOCK, 300, busy).num_restore_blocks >= 12


def test_queue_wait_counts_against_a_tier():
    cost = RecomputeCost(COEF, chunk_tokens=512)
    free = plan_restore("cost", 0, [tier("disk", 16, 0.0, 1000)], BS, BLOCK, 300, cost)
    queued = plan_restore("cost", 0, [tier("disk", 16, 0.0, 1000, wait=1.0)], BS, BLOCK, 300,
                          cost)
    assert free.num_restore_blocks == 16 and queued.num_restore_blocks == 0


def test_fixed_rules():
    cost = RecomputeCost(COEF)
    slow = [tier("remote", 4, 1.0, 1)]
    assert plan_restore("always_restore", 2, slow, BS, BLOCK, 200, cost).ranges == \
        [("remote", 2, 6)]
    assert plan_restore("always_recompute", 0, [tier("host", 4, 0, 1e4)], BS, BLOCK, 200,
                        cost).num_restore_blocks == 0
    assert plan_restore("threshold:64", 0, slow, BS, BLOCK, 200, cost).num_restore_blocks == 4
    assert plan_restore("threshold:65", 0, slow, BS, BLOCK, 200, cost).num_restore_blocks == 0
    for bad in ("fast", "threshold:", "threshold:x"):
        with pytest.raises(ValueError, match="planner mode"):
            parse_mode(bad)


def test_recompute_cost_chunks_and_prior():
    assert RecomputeCost(None, prior_s_per_token=1e-3).seconds(100, 300) == pytest.approx(0.2)
    cost = RecomputeCost(COEF, chunk_tokens=100)
    # Three chunks: three step constants.
    assert cost.seconds(0, 300) == pytest.approx(3 * 0.002 + 300 * 1e-4)
    assert cost.seconds(5, 5) == 0.0


def test_transfer_model_learns_latency_and_bandwidth():
    m = TransferModel(0.001, 100e6)
    assert m.predict(1e6) == pytest.approx(0.011)
    for n in (1, 2, 4, 8, 16, 32) * 5:         # a link of 20 ms + 10 MB/s
        m.observe(n * 1_000_000, 0.02 + n * 0.1)
    assert m.latency_s == pytest.approx(0.02, abs=0.01)
    assert m.bandwidth == pytest.approx(10e6, rel=0.1)


def test_transfer_model_ignores_nonsense_and_keeps_positive_bandwidth():
    m = TransferModel(0.0, 1e9)
    m.observe(0, 1.0)
    m.observe(1000, -1)
    assert m.num_observed == 0
    for _ in range(10):           # one size only, noisy: the slope stays positive
        m.observe(1 << 20, 0.001)
    assert m.bandwidth > 0 and m.latency_s >= 0


def test_prediction_log_median():
    log = PredictionLog()
    assert log.median() is None
    for predicted, actual in ((1.0, 1.0), (1.2, 1.0), (0.5, 1.0)):
        log.add(predicted, actual)
    assert log.median() == pytest.approx(0.2)


def test_the_chunk_a_recompute_would_get_shrinks_under_load():
    """What the planner prices a recompute with (ChunkSizer.steady_budget): the whole budget
    on an idle engine, the SLO chunk beside decoding streams (smaller with more of them)."""
    from tokenloom.actors.sampling_params import SamplingParams
    from tokenloom.actors.scheduling.chunk_sizing import ChunkSizer
    from tokenloom.actors.scheduling.cost_model import StepCostModel
    from tokenloom.actors.scheduling.request import Request
    from tokenloom.config.schema import SchedulerConfig

    cost = StepCostModel()
    for decodes in range(1, 33):       # exact steps: 10 ms + 0.5 ms a token + 0.3 ms a row
        for chunk in (0, 128):
            tokens = decodes + chunk
            cost.observe(tokens, 0.0, 0.010 + 0.0005 * tokens + 0.0003 * decodes,
                         prefill_tokens=chunk, rows=decodes)

    def decoding(n):
        out = []
        for i in range(n):
            r = Request(f"d{i}", list(range(3, 53)), SamplingParams(max_tokens=64))
            r.append_token(7, 0.0)
            r.num_computed_tokens = r.num_tokens - 1
            out.append(r)
        return out

    sizer = ChunkSizer(SchedulerConfig(chunking="slo", target_itl_ms=60.0, min_prefill_chunk=8),
                       2048, cost)
    assert sizer.steady_budget([]) == 2048
    two, eight = sizer.steady_budget(decoding(2)), sizer.steady_budget(decoding(8))
    assert 8 <= eight < two < 2048
