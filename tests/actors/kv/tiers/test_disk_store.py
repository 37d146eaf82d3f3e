"""DiskStore against a real directory: round trip, LRU by bytes, restart, layout isolation,
corrupt/truncated files, a full disk, and concurrent use."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from tokenloom.actors.kv.tiers.disk import DiskStore
from tokenloom.actors.kv.tiers.record import KVLayout
from tokenloom.actors.kv.tiers.store import TierUsage


def test_round_trip(tmp_path, layout, make_chain, same_record):
    store = DiskStore(layout, tmp_path, 1 << 20)
    blocks = make_chain(3)
    for r in blocks:
        assert store.put(r).hashes == []
    hashes = [r.meta.block_hash for r in blocks]
    assert store.contains(hashes) == 3
    assert store.contains([hashes[0], b"x" * 32, hashes[2]]) == 1
    assert all(same_record(store.get(r.meta.block_hash), r) for r in blocks)
    assert store.get(b"x" * 32) is None
    assert store.put(blocks[0]).hashes == []       # already there: only refreshed
    u = store.usage()
    assert (u.num_blocks, u.bytes_capacity) == (3, 1 << 20)
    assert u.bytes_used == sum(os.path.getsize(store._file(h)) for h in hashes)
    store.discard(hashes[1])
    assert store.contains(hashes) == 1 and not store._file(hashes[1]).exists()
    assert not store.health().degraded


def test_capacity_below_one_record(tmp_path, layout):
    with pytest.raises(ValueError, match="bytes"):
        DiskStore(layout, tmp_path, layout.block_bytes)


def test_lru_eviction_by_bytes(tmp_path, layout, make_record):
    probe = DiskStore(layout, tmp_path / "probe", 1 << 20)
    probe.put(make_record())
    size = probe.usage().bytes_used
    store = DiskStore(layout, tmp_path / "lru", 3 * size)
    a, b, c, d = (make_record() for _ in range(4))
    for r in (a, b, c):
        assert store.put(r).hashes == []
    assert store.get(a.meta.block_hash) is not None      # a is now most recent
    evicted = store.put(d)
    assert evicted.hashes == [b.meta.block_hash] and evicted.records == []
    assert not store._file(b.meta.block_hash).exists()
    assert [store.contains([r.meta.block_hash]) for r in (a, b, c, d)] == [1, 0, 1, 1]
    assert store.usage().bytes_used <= 3 * size


def test_restart_sees_blocks_parents_first(tmp_path, layout, make_chain, same_record):
    store = DiskStore(layout, tmp_path, 1 << 20)
    chain = make_chain(5)
    for r in reversed(chain):          # children written (so older) before their parents
        store.put(r)
    leftover = store._file(chain[0].meta.block_hash).parent / ".crash.tmp"
    leftover.write_bytes(b"partial")
    store.close()

    again = DiskStore(layout, tmp_path, 1 << 20)
    assert not leftover.exists()
    hashes = [r.meta.block_hash for r in chain]
    assert again.contains(hashes) == 5
    assert again.usage() == store.usage()
    assert [m.block_hash for m in again.metas()] == hashes
    assert same_record(again.get(hashes[3]), chain[3])


def test_other_layout_does_not_see_blocks(tmp_path, layout, make_record):
    store = DiskStore(layout, tmp_path, 1 << 20)
    store.put(r := make_record())
    other = KVLayout("bfloat16", layout.shape, 2)
    assert other.tag != layout.tag
    foreign = DiskStore(other, tmp_path, 1 << 20)
    assert foreign.contains([r.meta.block_hash]) == 0 and foreign.usage().num_blocks == 0
    assert DiskStore(layout, tmp_path, 1 << 20).contains([r.meta.block_hash]) == 1


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_file_is_dropped_and_health_recovers(tmp_path, layout, make_record, damage,
                                                      same_record):
    store = DiskStore(layout, tmp_path, 1 << 20)
    store.put(r := make_record())
    h = r.meta.block_hash
    path = store._file(h)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-100] ^= 0xFF              # inside the payload
    else:
        data = data[:len(data) // 2]
    path.write_bytes(bytes(data))

    assert store.get(h) is None
    assert not path.exists() and store.contains([h]) == 0
    assert store.usage() == TierUsage(0, 0, 1 << 20)
    health = store.health()
    assert health.degraded and h.hex()[:12] in health.reason and health.num_errors == 1

    store.put(r2 := make_record())
    assert not store.health().degraded
    assert same_record(store.get(r2.meta.block_hash), r2)


def test_corrupt_file_is_dropped_by_metas(tmp_path, layout, make_chain):
    store = DiskStore(layout, tmp_path, 1 << 20)
    chain = make_chain(3)
    for r in chain:
        store.put(r)
    store._file(chain[1].meta.block_hash).write_bytes(b"garbage")
    again = DiskStore(layout, tmp_path, 1 << 20)
    metas = again.metas()
    assert [m.block_hash for m in metas] == [chain[0].meta.block_hash, chain[2].meta.block_hash]
    assert again.usage().num_blocks == 2 and again.health().degraded


def test_full_disk_stores_nothing_then_recovers(tmp_path, layout, make_record, monkeypatch):
    store = DiskStore(layout, tmp_path, 1 << 20)
    real_replace = os.replace

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    r = make_record()
    assert store.put(r).hashes == []
    assert store.contains([r.meta.block_hash]) == 0 and store.usage().num_blocks == 0
    health = store.health()
    assert health.degraded and "disk write failed" in health.reason
    assert not any(p.is_file() for p in store.root.rglob("*"))   # no temp file left

    monkeypatch.setattr(os, "replace", real_replace)
    store.put(r)
    assert store.contains([r.meta.block_hash]) == 1 and not store.health().degraded


def test_concurrent_put_get(tmp_path, layout, make_record, same_record):
    records = [make_record() for _ in range(64)]
    probe = DiskStore(layout, tmp_path / "probe", 1 << 20)
    probe.put(records[0])
    # Room for about half the blocks: puts evict while other threads read.
    store = DiskStore(layout, tmp_path / "s", 32 * probe.usage().bytes_used)
    errors: list[str] = []

    def work(k: int) -> None:
        for i in range(k, k + 48):
            r = records[i % 64]
            store.put(r)
            got = store.get(records[(i * 7) % 64].meta.block_hash)
            if got is not None and not same_record(got, records[(i * 7) % 64]):
                errors.append(f"wrong block for {i}")

    threads = [threading.Thread(target=work, args=(k * 16,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert not store.health().degraded
    u = store.usage()
    files = [p for p in store.root.rglob("*") if p.is_file()]
    assert len(files) == u.num_blocks <= 32
    assert sum(p.stat().st_size for p in files) == u.bytes_used <= u.bytes_capacity
