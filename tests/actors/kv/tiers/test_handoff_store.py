"""HandoffStore against a real directory: round trip, two processes' stores on one
directory (no index in memory), corrupt and vanished files, the capacity refusal, the
front's helpers (remove_blocks, stored_blocks), temp files; and the tier manager's rules
for the handoff tier (computed blocks only, no KV events)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tokenloom.actors.kv.events import BlockRemoved, BlockStored
from tokenloom.actors.kv.tiers.calibration import TransferModel
from tokenloom.actors.kv.tiers.handoff import (
    MEDIUM_PEER,
    HandoffStore,
    handoff_file,
    remove_blocks,
    stored_blocks,
)
from tokenloom.actors.kv.tiers.manager import TierManager, WritePolicy
from tokenloom.actors.kv.tiers.record import encode
from tokenloom.actors.kv.tiers.store import HostStore


def record_bytes(layout, record) -> int:
    return len(encode(record, layout))


def files(root) -> list[str]:
    return sorted(os.listdir(root))


def test_round_trip(tmp_path, layout, make_chain, same_record):
    store = HandoffStore(layout, tmp_path / "handoff", 1 << 20)    # created if absent
    chain = make_chain(3)
    hashes = [r.meta.block_hash for r in chain]
    assert store.contains(hashes) == 0 and store.get(hashes[0]) is None
    for r in chain:
        assert store.put(r).stored
    assert not store.put(chain[0]).stored                 # already there
    assert store.contains(hashes) == 3
    assert store.contains([hashes[0], b"x" * 32, hashes[2]]) == 1
    assert store.present([hashes[0], b"x" * 32, hashes[2]]) == [True, False, True]
    assert all(same_record(store.get(h), r) for h, r in zip(hashes, chain))
    assert sorted(stored_blocks(store.root)) == sorted(hashes)
    assert all(handoff_file(store.root, h).exists() for h in hashes)
    assert (store.name, store.medium) == ("peer", MEDIUM_PEER)
    assert not store.announce_events and not store.takes_evictions
    store.discard(hashes[1])
    assert store.present(hashes) == [True, False, True]
    assert not store.health().degraded
    store.close()
    assert store.contains([hashes[0]]) == 1                # closing deletes nothing


def test_capacity_below_one_block(tmp_path, layout):
    with pytest.raises(ValueError, match="cannot hold one block"):
        HandoffStore(layout, tmp_path, layout.block_bytes - 1)


def test_usage_counts_files(tmp_path, layout, make_record):
    store = HandoffStore(layout, tmp_path, 1 << 20)
    records = [make_record() for _ in range(12)]
    for r in records:
        store.put(r)
    u = store.usage()
    assert u.bytes_used == sum(os.path.getsize(handoff_file(tmp_path, r.meta.block_hash))
                               for r in records)
    assert (u.num_blocks, u.bytes_capacity) == (12, 1 << 20)


def test_two_stores_on_one_directory_see_each_others_blocks(tmp_path, layout, make_record,
                                                            same_record):
    """A prefill worker writes, a decode worker reads, the front deletes: each its own
    process, so nothing may be cached in memory."""
    writer = HandoffStore(layout, tmp_path, 1 << 20)
    reader = HandoffStore(layout, tmp_path, 1 << 20)
    a, b = make_record(), make_record()
    writer.put(a)
    assert reader.contains([a.meta.block_hash]) == 1
    assert same_record(reader.get(a.meta.block_hash), a)
    reader.put(b)
    assert same_record(writer.get(b.meta.block_hash), b)
    assert remove_blocks(tmp_path, [a.meta.block_hash]) == 1      # the front releases a
    assert writer.present([a.meta.block_hash, b.meta.block_hash]) == [False, True]
    assert reader.usage().bytes_used == writer.usage().bytes_used


def test_a_corrupt_file_reads_as_none_is_deleted_and_degrades(tmp_path, layout, make_record,
                                                              same_record):
    store = HandoffStore(layout, tmp_path, 1 << 20)
    good, bad = make_record(), make_record()
    store.put(good)
    store.put(bad)
    path = handoff_file(tmp_path, bad.meta.block_hash)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.get(bad.meta.block_hash) is None
    assert not path.exists()
    h = store.health()
    assert h.degraded and "crc" in h.reason
    assert same_record(store.get(good.meta.block_hash), good)      # the next good read
    assert not store.health().degraded                             # is the recovery


def test_a_file_filed_under_another_hash_is_corrupt(tmp_path, layout, make_record):
    store = HandoffStore(layout, tmp_path, 1 << 20)
    a, b = make_record(), make_record()
    store.put(a)
    handoff_file(tmp_path, a.meta.block_hash).rename(handoff_file(tmp_path, b.meta.block_hash))
    assert store.get(b.meta.block_hash) is None
    assert store.health().degraded and stored_blocks(tmp_path) == []


def test_a_file_deleted_by_someone_else_is_a_miss_not_a_failure(tmp_path, layout, make_record):
    store = HandoffStore(layout, tmp_path, 1 << 20)
    store.put(r := make_record())
    remove_blocks(tmp_path, [r.meta.block_hash])        # lease expired at the front
    assert store.get(r.meta.block_hash) is None
    assert not store.health().degraded


def test_capacity_refuses_writes_and_recovers_when_files_go(tmp_path, layout, make_record):
    records = [make_record() for _ in range(4)]
    size = record_bytes(layout, records[0])
    store = HandoffStore(layout, tmp_path, 2 * size)
    assert store.put(records[0]).stored and store.put(records[1]).stored
    refused = store.put(records[2])
    assert not refused.stored and store.num_refused == 1
    assert not handoff_file(tmp_path, records[2].meta.block_hash).exists()
    assert len(files(tmp_path)) == 2                      # no temp file either
    assert not store.health().degraded                    # a refusal is not a failure
    # The front deletes a claimed handoff's files (another process): room again.
    assert remove_blocks(tmp_path, [records[0].meta.block_hash, b"x" * 32]) == 1
    assert store.put(records[2]).stored
    assert not store.put(records[3]).stored and store.num_refused == 2
    # A second store on the directory counts what is already there.
    other = HandoffStore(layout, tmp_path, 2 * size)
    assert not other.put(records[3]).stored and other.num_refused == 1


def test_remove_blocks_and_stored_blocks(tmp_path, layout, make_chain):
    store = HandoffStore(layout, tmp_path, 1 << 20)
    chain = make_chain(3)
    for r in chain:
        store.put(r)
    hashes = [r.meta.block_hash for r in chain]
    assert remove_blocks(tmp_path, [hashes[0], hashes[0], b"y" * 32]) == 1
    assert sorted(stored_blocks(tmp_path)) == sorted(hashes[1:])
    assert remove_blocks(tmp_path, hashes) == 2
    assert stored_blocks(tmp_path) == []
    assert stored_blocks(tmp_path / "absent") == [] and remove_blocks(tmp_path / "absent",
                                                                      hashes) == 0


def test_temp_files_are_never_blocks(tmp_path, layout, make_record, monkeypatch):
    store = HandoffStore(layout, tmp_path, 1 << 20)
    (tmp_path / ".half-written.tmp").write_bytes(b"partial")       # a writer mid-write
    r = make_record()
    store.put(r)
    assert stored_blocks(tmp_path) == [r.meta.block_hash]
    assert store.usage().bytes_used == record_bytes(layout, r)
    # Puts leave no temp file behind, even when the rename fails.
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("EIO")))
    s = make_record()
    assert not store.put(s).stored
    assert store.health().degraded
    monkeypatch.undo()
    assert files(tmp_path) == [".half-written.tmp", handoff_file(tmp_path, r.meta.block_hash).name]
    assert store.contains([s.meta.block_hash]) == 0


# ------------------------------------------------------------------ in the tier manager

def manager(layout, tmp_path, peer="through", host_blocks=1):
    stores = [HostStore(layout, host_blocks * layout.block_bytes),
              HandoffStore(layout, tmp_path, 1 << 20)]
    models = {"host": TransferModel(0.0, 4e9), "peer": TransferModel(1e-4, 2e9)}
    return TierManager(layout, stores, {"host": WritePolicy("back"),
                                        "peer": WritePolicy(peer)}, models, block_size=4)


def offer(m, records, committed):
    m.offer([r.meta for r in records], np.stack([r.payload for r in records]),
            [committed] * len(records))
    m.drain_writes()


def test_handoff_tier_takes_computed_blocks_only_and_announces_nothing(layout, tmp_path,
                                                                       make_chain):
    m = manager(layout, tmp_path)
    host, peer = m.stores
    computed, evicted = make_chain(2), make_chain(3)
    c_hashes = [r.meta.block_hash for r in computed]
    e_hashes = [r.meta.block_hash for r in evicted]
    assert m.wants(c_hashes[0], committed=True)            # the handoff tier writes through
    offer(m, computed, committed=True)
    assert sorted(stored_blocks(tmp_path)) == sorted(c_hashes)
    assert host.usage().num_blocks == 0                    # host memory writes back only
    assert not m.wants(c_hashes[0], committed=True)        # already handed off
    assert m.drain_events() == []                          # in flight, not a cache
    assert m.counters["peer"].stored_blocks == 2
    # Evictions go to host memory (which evicts in turn) but never to the handoff tier,
    # not even what host memory pushes out.
    assert m.wants(e_hashes[0], committed=False)
    offer(m, evicted, committed=False)
    assert sorted(stored_blocks(tmp_path)) == sorted(c_hashes)
    assert peer.present(e_hashes) == [False] * 3
    events = m.drain_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.block_hashes[0] for e in stored] == e_hashes
    assert all(e.medium == "CPU" for e in stored)
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in events)
    assert all(getattr(e, "medium", None) != MEDIUM_PEER for e in events)
    m.close()
    assert sorted(stored_blocks(tmp_path)) == sorted(c_hashes)    # the front removes them


def test_a_decode_workers_handoff_tier_is_read_only(layout, tmp_path, make_chain):
    m = manager(layout, tmp_path, peer="off", host_blocks=8)
    chain = make_chain(2)
    assert not m.wants(chain[0].meta.block_hash, committed=True)
    offer(m, chain, committed=True)
    offer(m, chain, committed=False)
    assert stored_blocks(tmp_path) == []
    m.close()


def test_a_handoff_tier_alone_ignores_evictions(layout, tmp_path, make_chain):
    """The handoff tier as the only tier (the user's tiers off), even with policy "back":
    a device eviction is never a handoff."""
    m = TierManager(layout, [HandoffStore(layout, tmp_path, 1 << 20)],
                    {"peer": WritePolicy("back")}, {"peer": TransferModel(1e-4, 2e9)},
                    block_size=4)
    chain = make_chain(2)
    assert not m.wants(chain[0].meta.block_hash, committed=False)
    offer(m, chain, committed=False)
    assert stored_blocks(tmp_path) == [] and m.drain_events() == []
    m.close()
