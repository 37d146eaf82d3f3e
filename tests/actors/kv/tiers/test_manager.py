"""The tier manager's write policies (back, through, store threshold, bounded queues), its
held fetches (staged in order, truncated at a bad block, cancelled), and its KV events."""

from __future__ import annotations

import threading

import numpy as np

from tokenloom.actors.kv.events import BlockRemoved, BlockStored
from tokenloom.actors.kv.tiers.calibration import TransferModel
from tokenloom.actors.kv.tiers.disk import DiskStore
from tokenloom.actors.kv.tiers.manager import TierManager, WritePolicy
from tokenloom.actors.kv.tiers.planner import RecomputeCost
from tokenloom.actors.kv.tiers.store import HostStore

DEAR = RecomputeCost(coef=None, prior_s_per_token=1.0)    # restoring always pays


def manager(layout, tmp_path, host_blocks=2, host="back", disk="back", threshold=0, **kw):
    stores = [HostStore(layout, host_blocks * layout.block_bytes),
              DiskStore(layout, tmp_path, 1 << 20)]
    models = {"host": TransferModel(0.0, 4e9), "disk": TransferModel(1e-4, 5e8)}
    return TierManager(layout, stores, {"host": WritePolicy(host),
                                        "disk": WritePolicy(disk, threshold)}, models,
                       block_size=4, **kw)


def offer(m, records, committed=False):
    m.offer([r.meta for r in records], np.stack([r.payload for r in records]),
            [committed] * len(records))


def settle(m):
    for pool in m._writers.values():
        pool.submit(lambda: None).result()


def test_write_back_cascades_host_evictions_to_disk(layout, tmp_path, make_chain):
    m = manager(layout, tmp_path)
    chain = make_chain(4)
    assert all(m.wants(r.meta.block_hash, committed=False) for r in chain)
    assert not m.wants(chain[0].meta.block_hash, committed=True)   # nobody writes through
    offer(m, chain)
    settle(m)
    host, disk = m.stores
    assert host.usage().num_blocks == 2
    assert disk.contains([r.meta.block_hash for r in chain[:2]]) == 2
    events = m.drain_events()
    stored = [(e.medium, e.block_hashes[0]) for e in events if isinstance(e, BlockStored)]
    first = chain[0].meta.block_hash
    assert ("CPU", first) in stored and ("DISK", first) in stored
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in events)
    assert not m.wants(chain[3].meta.block_hash, committed=False)   # already in host memory
    m.close()


def test_write_through_and_store_threshold(layout, tmp_path, make_chain):
    m = manager(layout, tmp_path, host_blocks=8, disk="through", threshold=2)
    chain = make_chain(2)
    hashes = [r.meta.block_hash for r in chain]
    offer(m, chain, committed=True)
    settle(m)
    assert m.stores[1].usage().num_blocks == 0          # looked up fewer than 2 times
    for _ in range(2):
        m.query("r", hashes, 2, 12, DEAR)
        m.cancel("r")
    offer(m, chain, committed=True)
    settle(m)
    assert m.stores[1].contains(hashes) == 2
    m.close()


def test_slow_tier_queue_is_bounded_and_drops(layout, tmp_path, make_chain):
    m = manager(layout, tmp_path, host="off", max_queued_write_bytes=layout.block_bytes)
    gate = threading.Event()
    m._writers["disk"].submit(gate.wait)                # the writer is busy
    offer(m, make_chain(3))
    gate.set()
    settle(m)
    assert m.counters["disk"].dropped_writes == 2 and m.stores[1].usage().num_blocks == 1
    m.close()


def test_close_lands_the_queued_writes_first(layout, tmp_path, make_chain):
    """A graceful stop (a prefill worker writing through to the handoff tier) keeps the
    writes already queued: close() waits for them, up to its drain timeout."""
    m = manager(layout, tmp_path, host="off", disk="through")
    gate = threading.Event()
    m._writers["disk"].submit(gate.wait)                # the writer is busy...
    offer(m, make_chain(3), committed=True)
    threading.Timer(0.2, gate.set).start()              # ...for a moment after close begins
    m.close()
    assert m.counters["disk"].stored_blocks == 3 and m.counters["disk"].dropped_writes == 0


def test_close_gives_up_on_a_wedged_writer(layout, tmp_path, make_chain):
    m = manager(layout, tmp_path, host="off", disk="through")
    gate = threading.Event()
    m._writers["disk"].submit(gate.wait)                # never finishes before close's limit
    offer(m, make_chain(2), committed=True)
    threading.Timer(1.0, gate.set).start()              # (lets the pool's thread end)
    m.close(drain_timeout=0.1)
    assert m.counters["disk"].stored_blocks == 0        # dropped, and close returned


def test_fetch_from_disk_is_held_then_staged_in_order(layout, tmp_path, make_chain):
    m = manager(layout, tmp_path, host_blocks=1)
    chain = make_chain(5)
    hashes = [r.meta.block_hash for r in chain]
    for r in chain:
        m.stores[1].put(r)
    m.stores[0].put(chain[2])
    done = threading.Event()
    reports = []
    m.notify = lambda rep: (reports.append(rep), done.set())
    assert m.query("r", hashes, 0, 21, DEAR) is None        # held
    assert done.wait(5)
    staged = m.take_staged("r", 0, 21)
    assert [r.meta.block_hash for r in staged.records] == hashes
    assert staged.tiers == ["disk", "disk", "host", "disk", "disk"]
    assert reports[0].staged_blocks == 5 and reports[0].failed is None
    assert reports[0].plan["ranges"][1] == {"tier": "host", "tokens": [8, 12]}
    m.close()


def test_a_bad_block_ends_the_restore_there(layout, tmp_path, make_chain):
    m = manager(layout, tmp_path, host_blocks=1)
    chain = make_chain(4)
    hashes = [r.meta.block_hash for r in chain]
    for r in chain:
        m.stores[1].put(r)
    (m.stores[1].root / hashes[2].hex()[:2] / f"{hashes[2].hex()}.kvb").write_bytes(b"junk")
    done = threading.Event()
    reports = []
    m.notify = lambda rep: (reports.append(rep), done.set())
    m.query("r", hashes, 0, 17, DEAR)
    assert done.wait(5)
    staged = m.take_staged("r", 0, 17)
    assert len(staged.records) == 2 and "disk returned 2 of 4" in reports[0].failed
    assert m.stores[1].health().degraded
    m.close()


def test_cancel_drops_the_answer(layout, tmp_path, make_chain):
    m = manager(layout, tmp_path)
    chain = make_chain(3)
    for r in chain:
        m.stores[1].put(r)
    reports = []
    m.notify = reports.append
    m.query("r", [r.meta.block_hash for r in chain], 0, 13, DEAR)
    m.cancel("r")
    m.close()
    assert m.take_staged("r", 0, 13) is None
    assert not reports or reports[0].request_id == "r"


def test_host_restore_is_planned_at_admission(layout, tmp_path, make_chain):
    """Without slow tiers the query answers at once; host blocks are read at admission,
    from the device hit of that moment."""
    m = manager(layout, tmp_path, host_blocks=8)
    chain = make_chain(3)
    offer(m, chain)
    hashes = [r.meta.block_hash for r in chain]
    report = m.query("r", hashes, 1, 13, DEAR)
    assert report is not None and report.plan["restore_tokens"] == 8
    staged = m.take_staged("r", 0, 13)          # the device lost block 0 meanwhile
    assert staged.start_block == 0 and len(staged.records) == 3
    m.close()
