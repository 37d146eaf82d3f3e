"""The front's handoff ledger against a real directory (pure, no processes): states,
leases on shared hashes, expiry by an injected clock, the sweep of unleased files, and
the transfer histograms."""

from __future__ import annotations

import os
import time

import pytest

from tokenloom.actors.kv.tiers.handoff import handoff_file, stored_blocks
from tokenloom.actors.messages import AddRequest
from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.daemon.workers.handoff import HandoffLedger, Histogram

LEASE = 10.0
H1, H2, H3, H4 = (bytes([i]) * 32 for i in range(1, 5))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def request(rid: str) -> AddRequest:
    return AddRequest(request_id=rid, prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(),
                      arrival_time=0.0)


def write(root, *hashes: bytes, age: float = 0.0) -> None:
    """A block file per hash (any bytes do), ``age`` seconds old."""
    for h in hashes:
        path = handoff_file(root, h)
        path.write_bytes(b"kv")
        if age:
            t = time.time() - age
            os.utime(path, (t, t))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def ledger(tmp_path, clock) -> HandoffLedger:
    return HandoffLedger(tmp_path, lease_seconds=LEASE, grace_seconds=5.0, clock=clock)


def test_states_from_open_to_close(ledger, tmp_path, clock):
    h = ledger.open(request("a"), prefill_worker=0, decode_worker=1, hashes=[H1, H2])
    assert "a" in ledger and ledger.get("a") is h
    assert (h.state, h.opened, h.prefill_done, h.expires) == ("prefilling", 100.0, None, None)
    clock.now = 101.0
    assert ledger.prefilled("a") is h
    assert (h.state, h.prefill_done, h.expires) == ("transferring", 101.0, 101.0 + LEASE)
    clock.now = 105.0
    ledger.prefilled("a")                    # only the first end counts
    assert h.expires == 101.0 + LEASE
    ledger.decoding("a")
    assert h.state == "decoding" and h.expires == 101.0 + LEASE
    assert ledger.stats()["by_state"] == {"decoding": 1}
    write(tmp_path, H1, H2)
    assert ledger.close("a", "claimed") is h
    assert "a" not in ledger and ledger.get("a") is None
    assert stored_blocks(tmp_path) == []
    assert ledger.files_removed == 2
    assert ledger.close("a", "claimed") is None          # idempotent, not counted twice
    assert ledger.counts == {"started": 1, "claimed": 1}


def test_unknown_requests_are_ignored():
    ledger = HandoffLedger("/nonexistent-handoff-dir", LEASE)
    assert ledger.prefilled("x") is None
    ledger.decoding("x")
    assert ledger.missing("x") == 0 and ledger.close("x", "aborted") is None
    assert ledger.sweep() == 0                # no directory: nothing to sweep


def test_opening_the_same_request_twice_raises(ledger):
    ledger.open(request("a"), 0, 1, [H1])
    with pytest.raises(ValueError, match="'a'"):
        ledger.open(request("a"), 0, 2, [H2])
    assert ledger.get("a").hashes == [H1] and ledger.counts["started"] == 1


def test_a_shared_hash_is_deleted_only_when_its_last_handoff_closes(ledger, tmp_path):
    ledger.open(request("a"), 0, 1, [H1, H2, H2])       # a repeated hash counts once
    ledger.open(request("b"), 0, 2, [H2, H3])
    write(tmp_path, H1, H2, H3)
    assert ledger.stats()["leased_blocks"] == 3
    ledger.close("a", "claimed")
    assert sorted(stored_blocks(tmp_path)) == [H2, H3]
    assert ledger.stats()["leased_blocks"] == 2
    ledger.close("b", "aborted")
    assert stored_blocks(tmp_path) == []
    assert ledger.stats()["leased_blocks"] == 0
    assert ledger.files_removed == 3
    assert ledger.counts == {"started": 2, "claimed": 1, "aborted": 1}


def test_close_counts_only_files_that_existed(ledger, tmp_path):
    ledger.open(request("a"), 0, 1, [H1, H2, H3])
    write(tmp_path, H2)                       # the prefill wrote only one block
    ledger.close("a", "failed")
    assert ledger.files_removed == 1 and stored_blocks(tmp_path) == []


def test_lease_runs_from_the_prefill_end(ledger, clock):
    ledger.open(request("a"), 0, 1, [H1])
    clock.now += 1000                          # still prefilling: no lease running yet
    assert ledger.expired() == []
    ledger.prefilled("a")
    clock.now += LEASE
    assert ledger.expired() == []              # exactly at the deadline: still valid
    clock.now += 0.001
    assert ledger.expired() == ["a"]


def test_lease_runs_from_decoding_when_the_prefill_never_ended(ledger, clock):
    ledger.open(request("a"), 0, 1, [H1])
    ledger.open(request("b"), 0, 1, [H2])
    clock.now += 50
    ledger.decoding("a")                       # its prefill worker died: sent on anyway
    assert ledger.get("a").expires == clock.now + LEASE
    clock.now += LEASE + 1
    assert ledger.expired() == ["a"]           # b still prefilling, no lease
    ledger.close("a", "expired")
    assert ledger.expired() == [] and ledger.counts["expired"] == 1


def test_sweep_deletes_old_unleased_files_only(ledger, tmp_path):
    ledger.open(request("a"), 0, 1, [H1])
    write(tmp_path, H1, H2, age=60)            # H1 leased, H2 a late write nobody holds
    write(tmp_path, H3)                        # fresh: a write whose handoff opens soon
    stray = tmp_path / "notes.txt"
    stray.write_text("x")
    bad = tmp_path / f"zz{'0' * 62}.kvb"       # not a hash
    bad.write_bytes(b"x")
    tmp = tmp_path / ".abc.tmp"                # a write in progress
    tmp.write_bytes(b"x")
    for p in (stray, bad, tmp):
        os.utime(p, (time.time() - 60, time.time() - 60))
    assert ledger.sweep() == 1
    assert sorted(stored_blocks(tmp_path)) == [H1, H3]
    assert stray.exists() and bad.exists() and tmp.exists()
    assert ledger.files_removed == 1
    # Once released, the leased file goes with its handoff; the fresh one ages out.
    ledger.close("a", "claimed")
    write(tmp_path, H3, age=6)
    assert ledger.sweep() == 1 and stored_blocks(tmp_path) == []


def test_missing_counts_blocks_not_in_the_tier(ledger, tmp_path):
    ledger.open(request("a"), 0, 1, [H1, H2, H3, H4])
    assert ledger.missing("a") == 4
    write(tmp_path, H1, H3)
    assert ledger.missing("a") == 2
    write(tmp_path, H2, H4)
    assert ledger.missing("a") == 0


def test_stats_and_transfer_histograms(ledger):
    ledger.open(request("a"), 0, 1, [H1, H2])
    ledger.open(request("b"), 0, 2, [H3])
    ledger.prefilled("b")
    ledger.observe_transfer(1 << 20, 0.003)
    ledger.observe_transfer(3 << 20, 0.2)
    s = ledger.stats()
    assert (s["in_flight"], s["leased_blocks"]) == (2, 3)
    assert s["by_state"] == {"prefilling": 1, "transferring": 1}
    assert s["outcomes"] == {"started": 2}
    assert s["bytes_transferred"] == 4 << 20
    assert sum(s["transfer_seconds"]["counts"]) == 2
    assert s["transfer_seconds"]["sum"] == pytest.approx(0.203)


def test_histogram_buckets_and_sum():
    h = Histogram((1.0, 2.0, 5.0))
    for x in (0.5, 1.0, 1.5, 3.0, 5.0, 10.0, 99.0):
        h.observe(x)
    # Per-bucket counts: (<=1], (1, 2], (2, 5], (5, +inf) — the exporter cumulates them.
    assert h.counts == [2, 1, 2, 2]
    assert h.sum == pytest.approx(120.0)
    d = h.as_dict()
    assert d == {"bounds": [1.0, 2.0, 5.0], "counts": [2, 1, 2, 2], "sum": pytest.approx(120.0)}
    d["counts"][0] = 99
    assert h.counts[0] == 2                   # a copy
