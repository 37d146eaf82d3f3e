"""RemoteStore against a real redis-server: round trip, sharing between daemons, layout
isolation, a dead and restarted server, corrupt values, ttl and link shaping."""

from __future__ import annotations

import time

from tokenloom.actors.kv.tiers.record import KVLayout
from tokenloom.actors.kv.tiers.remote import RemoteStore


def test_round_trip(redis_server, layout, make_chain, same_record):
    store = RemoteStore(layout, redis_server.url)
    chain = make_chain(3)
    hashes = [r.meta.block_hash for r in chain]
    assert store.contains(hashes) == 0 and store.get(hashes[0]) is None
    for r in chain:
        assert store.put(r).hashes == []
    assert store.contains(hashes) == 3
    assert store.contains([hashes[0], b"x" * 32, hashes[2]]) == 1
    assert all(same_record(store.get(r.meta.block_hash), r) for r in chain)
    store.put(chain[0])                          # already there: not counted twice
    u = store.usage()
    assert u.num_blocks == 3 and u.bytes_capacity == 0
    assert u.bytes_used == sum(redis_server.client().strlen(store.key(h)) for h in hashes)
    store.discard(hashes[2])
    assert store.contains(hashes) == 2 and store.usage().num_blocks == 2
    assert not store.health().degraded
    store.close()


def test_two_daemons_share_blocks(redis_server, layout, make_record, same_record):
    a = RemoteStore(layout, redis_server.url)
    b = RemoteStore(layout, redis_server.url)
    a.put(r := make_record())
    assert b.contains([r.meta.block_hash]) == 1
    assert same_record(b.get(r.meta.block_hash), r)
    assert b.usage().num_blocks == 0             # usage counts what this daemon wrote


def test_other_layout_does_not_see_blocks(redis_server, layout, make_record):
    RemoteStore(layout, redis_server.url).put(r := make_record())
    other = RemoteStore(KVLayout("bfloat16", layout.shape, 2), redis_server.url)
    assert other.contains([r.meta.block_hash]) == 0
    assert other.get(r.meta.block_hash) is None


def test_dead_server_then_recovery(redis_server, layout, make_record, same_record):
    store = RemoteStore(layout, redis_server.url, retry_after_s=0.3)
    store.put(r := make_record())
    h = r.meta.block_hash
    redis_server.kill()

    t0 = time.monotonic()
    assert store.get(h) is None
    assert store.contains([h]) == 0
    store.put(make_record())
    store.discard(h)
    assert time.monotonic() - t0 < 2
    health = store.health()
    assert health.degraded and "remote get failed" in health.reason
    assert health.num_errors == 1                # the rest answered inside the retry window

    redis_server.restart()                       # empty, on the same port
    time.sleep(0.35)
    store.put(r)
    assert not store.health().degraded
    assert same_record(store.get(h), r)


def test_restart_between_calls_is_not_a_failure(redis_server, layout, make_record):
    store = RemoteStore(layout, redis_server.url)
    store.put(make_record())
    redis_server.restart()           # the pooled connection is now stale
    store.put(r := make_record())
    assert store.contains([r.meta.block_hash]) == 1 and not store.health().degraded


def test_no_network_inside_retry_window(redis_server, layout, make_record):
    store = RemoteStore(layout, redis_server.url, retry_after_s=60)
    redis_server.kill()
    assert store.get(b"x" * 32) is None and store.health().degraded
    redis_server.restart()
    RemoteStore(layout, redis_server.url).put(r := make_record())
    # The server is back and holds the block, but this store does not ask before 60 s.
    assert store.contains([r.meta.block_hash]) == 0
    assert store.get(r.meta.block_hash) is None
    assert store.health().num_errors == 1


def test_corrupt_value_is_deleted(redis_server, layout, make_record):
    store = RemoteStore(layout, redis_server.url)
    store.put(r := make_record())
    raw = redis_server.client()
    key = store.key(r.meta.block_hash)
    raw.set(key, b"TLKV garbage")
    assert store.get(r.meta.block_hash) is None
    assert raw.exists(key) == 0
    assert store.health().degraded
    store.put(r)
    assert not store.health().degraded and raw.exists(key) == 1


def test_ttl_sets_expiry(redis_server, layout, make_record):
    store = RemoteStore(layout, redis_server.url, ttl_s=100)
    store.put(r := make_record())
    raw = redis_server.client()
    assert 0 < raw.ttl(store.key(r.meta.block_hash)) <= 100
    plain = RemoteStore(layout, redis_server.url)
    plain.put(r2 := make_record())
    assert raw.ttl(plain.key(r2.meta.block_hash)) == -1      # no expiry


def test_shaping_adds_delay(redis_server, layout, make_record):
    store = RemoteStore(layout, redis_server.url, shaping=(0.05, 1e6))
    r = make_record()
    store.put(r)      # (writes are not shaped: they run off every request's path)
    t0 = time.monotonic()
    assert store.get(r.meta.block_hash) is not None
    assert time.monotonic() - t0 >= 0.05
    t0 = time.monotonic()
    assert store.contains([r.meta.block_hash] * 5) == 5        # one round trip
    assert time.monotonic() - t0 >= 0.05
