"""The router's local/remote prefill choice (pure): the guards before the cost model, the
cost model's two sides, the transfer it prices, and the rates it learns."""

from __future__ import annotations

import pytest

from tokenloom.actors.front.disaggregation import (
    ARRIVAL_WINDOW_S,
    EWMA,
    Choice,
    Rates,
    Settings,
    Side,
    choose,
    decode_id,
    prefill_id,
)

BS = 16
KV_BYTES = 1000          # per token
PREFILL, DECODE = 0, 1   # worker indices


def rates(s_per_token=1e-3, bw=1e9) -> Rates:
    return Rates(prefill_s_per_token=[s_per_token, s_per_token], transfer_bytes_per_s=bw)


def pick(mode="cost", prompt=1024, *, d_uncached=None, d_queued=0, decoding=0,
         p_uncached=None, p_queued=0, prefill_side=True, r=None, min_remote=256,
         eligible=True) -> Choice:
    decode = Side(DECODE, prompt if d_uncached is None else d_uncached, d_queued, decoding)
    prefill = (Side(PREFILL, prompt if p_uncached is None else p_uncached, p_queued, 0)
               if prefill_side else None)
    return choose(mode, prompt, BS, KV_BYTES, decode, prefill, r or rates(), min_remote,
                  eligible)


def test_request_ids_of_the_prefill_half_round_trip():
    assert prefill_id("req-1") == "req-1@prefill"
    assert decode_id(prefill_id("req-1")) == "req-1"
    assert decode_id("req-1") is None


def test_guards_keep_the_prefill_local_before_any_pricing():
    assert pick("never", decoding=100) == Choice(False, "never")
    assert pick("always", eligible=False) == Choice(False, "ineligible")
    assert pick("cost", prefill_side=False) == Choice(False, "no_prefill_worker")
    short = pick("always", prompt=1024, d_uncached=255, decoding=100)
    assert (short.remote, short.reason, short.local_s) == (False, "short_prompt", None)
    # The threshold is on the decode side's uncached tokens, not the prompt length.
    assert pick("always", prompt=300, d_uncached=256).remote


def test_unknown_mode_raises():
    with pytest.raises(ValueError, match="sometimes"):
        pick("sometimes")


def test_cost_hands_off_when_decodes_would_wait_for_a_long_prefill():
    c = pick("cost", prompt=1024, decoding=8)
    assert c.remote and c.reason == "cost"
    # local: the prefill, and 8 decoding requests waiting for all of it.
    assert c.local_s == pytest.approx(1024e-3 * 9)
    # remote: prefill there + transfer of 63 full blocks + the last block recomputed here,
    # which is all the decoding requests wait for.
    transfer = 0.0005 + 1008 * KV_BYTES / 1e9
    assert c.predicted_transfer_s == pytest.approx(transfer)
    assert c.remote_s == pytest.approx(1024e-3 + transfer + 16e-3 + 8 * 16e-3)
    assert c.remote_s < c.local_s


def test_cost_stays_local_when_the_prefill_worker_is_busy_and_nothing_decodes():
    c = pick("cost", prompt=1024, decoding=0, p_queued=20_000)
    assert not c.remote and c.reason == "cost"
    assert c.local_s == pytest.approx(1024e-3)
    assert c.remote_s > c.local_s
    # Even idle on both sides, a handoff only adds the transfer and the tail.
    idle = pick("cost", prompt=1024, decoding=0)
    assert not idle.remote and idle.remote_s > idle.local_s


def test_queued_prompts_on_the_decode_worker_weigh_on_both_sides():
    base = pick("cost", prompt=1024, decoding=1)
    queued = pick("cost", prompt=1024, decoding=1, d_queued=500)
    assert queued.local_s - base.local_s == pytest.approx(0.5)
    assert queued.remote_s - base.remote_s == pytest.approx(0.5)


def test_always_hands_off_with_the_predictions_filled():
    c = pick("always", prompt=1024, decoding=0, p_queued=20_000)
    assert c.remote and c.reason == "always"
    assert None not in (c.local_s, c.remote_s, c.predicted_transfer_s)
    assert c.transfer_bytes == 1008 * KV_BYTES
    d = c.as_dict()
    assert d["remote_prefill"] is True and d["transfer_bytes"] == 1008 * KV_BYTES
    assert d["predicted_local_ms"] == pytest.approx(1024.0)


@pytest.mark.parametrize("prompt, cached_on_decode, moved_tokens", [
    (100, 0, 96),       # 6 full blocks before the last token
    (96, 0, 80),        # the block holding the last token is recomputed, never moved
    (97, 0, 96),
    (100, 32, 64),      # the decode side already holds 2 blocks
    (100, 96, 0),       # it holds every full block: nothing to move
    (17, 0, 16),
    (16, 0, 0),
])
def test_transfer_counts_only_full_blocks_the_decode_side_lacks(prompt, cached_on_decode,
                                                                moved_tokens):
    c = pick("always", prompt=prompt, d_uncached=prompt - cached_on_decode, min_remote=0)
    assert c.transfer_bytes == moved_tokens * KV_BYTES
    if moved_tokens:
        assert c.predicted_transfer_s == pytest.approx(0.0005 + moved_tokens * KV_BYTES / 1e9)
    else:
        assert c.predicted_transfer_s == 0.0


def test_observe_prefill_ignores_a_few_tokens_and_moves_the_ewma():
    r = rates(1e-3)
    r.observe_prefill(PREFILL, 15, 1.0)          # measures the step overhead, not prefill
    r.observe_prefill(PREFILL, 100, 0.0)
    assert r.prefill_s_per_token == [1e-3, 1e-3] and r.num_prefill_samples == 0
    r.observe_prefill(PREFILL, 100, 0.5)         # 5 ms a token
    assert r.prefill_s_per_token[PREFILL] == pytest.approx(1e-3 + EWMA * 4e-3)
    assert r.prefill_s_per_token[DECODE] == 1e-3
    assert r.num_prefill_samples == 1
    for _ in range(60):
        r.observe_prefill(PREFILL, 16, 16 * 5e-3)
    assert r.prefill_s_per_token[PREFILL] == pytest.approx(5e-3)


def test_observe_transfer_moves_the_bandwidth():
    r = rates(bw=2e9)
    r.observe_transfer(0, 1.0)
    r.observe_transfer(1000, 0.0)
    assert r.transfer_bytes_per_s == 2e9 and r.num_transfer_samples == 0
    r.observe_transfer(10**9, 1.0)
    assert r.transfer_bytes_per_s == pytest.approx(2e9 - EWMA * 1e9)
    assert r.num_transfer_samples == 1
    # A slower measured link makes handoffs dearer.
    fast = pick("always", decoding=8, r=rates(bw=1e10))
    slow = pick("always", decoding=8, r=rates(bw=1e6))
    assert slow.predicted_transfer_s > fast.predicted_transfer_s
    assert slow.remote_s - fast.remote_s == pytest.approx(
        slow.predicted_transfer_s - fast.predicted_transfer_s)


def test_settings_counts_decisions_and_reports_roles_and_stats():
    s = Settings(mode="cost", prefill_workers=[0], decode_workers=[1, 2],
                 min_remote_tokens=256, kv_bytes_per_token=KV_BYTES,
                 rates=Rates([2e-3, 1e-3, 1e-3], 5e8))
    s.count(Choice(True, "cost"))
    s.count(Choice(True, "cost"))
    s.count(Choice(False, "short_prompt"))
    assert s.decisions == {"remote:cost": 2, "local:short_prompt": 1}
    assert s.roles(3) == ["prefill", "decode", "decode"]
    s.rates.observe_prefill(1, 100, 1.0)    # 10 ms a token
    s.rates.observe_transfer(10**6, 1e-3)
    st = s.stats()
    assert st["mode"] == "cost" and st["decisions"] == s.decisions
    assert st["decisions"] is not s.decisions
    assert st["prefill_ms_per_token"] == [2.0, round((1e-3 + EWMA * 9e-3) * 1e3, 4), 1.0]
    assert st["transfer_mb_s"] == round((5e8 + EWMA * 5e8) / 1e6, 1)
    assert (st["prefill_samples"], st["transfer_samples"]) == (1, 1)


def test_an_idle_worker_of_any_role_takes_the_whole_request():
    """`local` is the whole-request worker (a prefill worker may be it): idle, it beats a
    handoff to a decode worker whose requests would wait for nothing but the tail, while the
    same prompt local on that busy decode worker would lose to the handoff."""
    r = rates()
    busy_decode = Side(worker=1, uncached_tokens=1024, queued_tokens=0, decoding=8)
    prefill = Side(worker=0, uncached_tokens=1024, queued_tokens=0, decoding=0)
    on_decode = choose("cost", 1024, 16, 1000, busy_decode, prefill, r, 256)
    assert on_decode.remote
    on_idle = choose("cost", 1024, 16, 1000, busy_decode, prefill, r, 256, local=prefill)
    assert not on_idle.remote and on_idle.local_s == pytest.approx(1024 * 1e-3)
    # The prefill worker's own decoding requests wait through a handed-off prefill too.
    loaded_prefill = Side(worker=0, uncached_tokens=1024, queued_tokens=0, decoding=4)
    c = choose("cost", 1024, 16, 1000, busy_decode, loaded_prefill, r, 256)
    assert c.remote_s > on_decode.remote_s + 4 * 1024 * 1e-3 - 1e-9


def test_observe_decode_needs_two_tokens_and_moves_the_ewma():
    r = rates()
    r.observe_decode(1, 1.0)
    r.observe_decode(10, 0.0)
    assert r.decode_s_per_token is None and r.num_decode_samples == 0
    r.observe_decode(10, 1.0)                     # the first measurement is taken as is
    assert r.decode_s_per_token == pytest.approx(0.1)
    r.observe_decode(10, 2.0)
    assert r.decode_s_per_token == pytest.approx(0.1 + EWMA * 0.1)
    assert r.num_decode_samples == 2


def test_arrival_rate_is_the_window_and_forgets_old_prompts():
    r = rates()
    assert r.prefill_token_rate(0.0) == 0.0
    r.observe_arrival(1500, 1.0)
    assert r.prefill_token_rate(1.0) == pytest.approx(1500 / ARRIVAL_WINDOW_S)
    r.observe_arrival(1500, 9.0)
    assert r.prefill_token_rate(9.0) == pytest.approx(3000 / ARRIVAL_WINDOW_S)
    assert r.prefill_token_rate(1.0 + ARRIVAL_WINDOW_S + 1) == pytest.approx(
        1500 / ARRIVAL_WINDOW_S)                    # the first one is forgotten
    assert r.prefill_token_rate(100.0) == 0.0 and not r.arrivals


def test_prefill_duty_spreads_over_prefill_workers_and_saturates():
    s = Settings(mode="cost", prefill_workers=[0, 1], decode_workers=[2],
                 min_remote_tokens=256, kv_bytes_per_token=KV_BYTES,
                 rates=Rates([4e-3, 4e-3, 1.0], 1e9))
    assert s.prefill_duty(0.0) == 0.0
    s.rates.observe_arrival(2000, 0.0)
    s.rates.observe_arrival(2000, 10.0)          # 200 tokens/s, 0.8 s of prefill a second
    assert s.prefill_duty(10.0) == pytest.approx(4000 / ARRIVAL_WINDOW_S * 4e-3 / 2)
    s.rates.observe_arrival(10_000, 10.0)
    assert s.prefill_duty(10.0) == 1.0
    assert s.stats(10.0)["prefill_duty_forecast"] == 1.0
    assert Settings("cost", [], [0], 256, KV_BYTES, rates()).prefill_duty(10.0) == 0.0


def test_forecast_prefills_on_a_prefill_worker_send_the_decode_away():
    """An idle prefill worker takes the whole request while nothing forecasts prefills
    there; once long prompts arrive steadily, the request's decode would wait through them
    (predicted decode time * duty), and the handoff wins."""
    r = rates()
    decode = Side(worker=1, uncached_tokens=1024, queued_tokens=0, decoding=4)
    prefill = Side(worker=0, uncached_tokens=1024, queued_tokens=0, decoding=0)
    unknown = choose("cost", 1024, 16, 1000, decode, prefill, r, 256, local=prefill,
                     decode_tokens=16, local_duty=1.0)
    assert not unknown.remote and unknown.forecast_interference_s == 0.0   # no ITL yet
    r.observe_decode(10, 1.0)                     # 100 ms a token
    calm = choose("cost", 1024, 16, 1000, decode, prefill, r, 256, local=prefill,
                  decode_tokens=16, local_duty=0.0)
    assert not calm.remote
    busy = choose("cost", 1024, 16, 1000, decode, prefill, r, 256, local=prefill,
                  decode_tokens=16, local_duty=0.5)
    assert busy.forecast_interference_s == pytest.approx(16 * 0.1 * 0.5)
    assert busy.local_s == pytest.approx(calm.local_s + 0.8)
    assert busy.remote and busy.as_dict()["forecast_interference_ms"] == pytest.approx(800)
