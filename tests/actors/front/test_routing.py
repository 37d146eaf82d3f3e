"""The pure routing core (actors/front/routing.py): prefix index, costs, policies, the account."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.actors.front.routing import PrefixIndex, RoutingCore
from tokenloom.actors.kv.block_hash import CacheIdentity, hash_request_blocks
from tokenloom.actors.kv.events import AllBlocksCleared, BlockRemoved, BlockStored

IDENT = CacheIdentity(model_fingerprint="fp").encode()


def hashes(tokens, block_size=4, ident=IDENT):
    return hash_request_blocks(tokens, block_size, ident)


def stored(hs):
    return BlockStored(block_hashes=list(hs), parent_block_hash=None, token_ids=[],
                       block_size=4)


def core(n=2, policy="prefix", decode_weight=1.0, ttl=60.0):
    c = RoutingCore(n, policy, decode_weight, ttl)
    for w in range(n):
        c.worker_up(w)
    return c


def test_overlap_counts_leading_blocks_only():
    idx = PrefixIndex(ttl=10)
    hs = hashes(list(range(16)))
    idx.apply(stored([hs[0], hs[1], hs[3]]))
    assert idx.overlap(hs, now=0) == 2      # block 2 missing: block 3 is not reusable
    idx.apply(BlockRemoved(block_hashes=[hs[0]]))
    assert idx.overlap(hs, now=0) == 0
    idx.apply(stored(hs))
    idx.apply(AllBlocksCleared())
    assert idx.overlap(hs, now=0) == 0


def test_routed_prefixes_expire():
    idx = PrefixIndex(ttl=5)
    hs = hashes(list(range(12)))
    idx.note_routed(hs, now=100)
    assert idx.overlap(hs, now=104) == 3
    assert idx.overlap(hs, now=106) == 0
    idx.expire(106)
    assert not idx.routed


def test_routed_index_is_bounded():
    idx = PrefixIndex(ttl=5, max_routed=4)
    hs = hashes(list(range(40)))
    idx.note_routed(hs, now=0)
    assert len(idx.routed) == 4
    assert idx.overlap(hs, now=0) == 0      # the oldest (leading) blocks were dropped


def test_salt_isolates_hashes():
    """A prefix stored under one salt is no overlap for another (isolation, invariant 5)."""
    c = core()
    tokens = list(range(32))
    salted = hashes(tokens, ident=CacheIdentity("fp", cache_salt="a").encode())
    c.indexes[1].apply(stored(salted))
    d = c.choose(hashes(tokens, ident=CacheIdentity("fp", cache_salt="b").encode()), 10, 0.0)
    assert d.expected_hit_blocks == 0
    d = c.choose(salted, 10, 0.0)
    assert d.worker == 1 and d.expected_hit_blocks == 8 and d.reason == "prefix"


def test_prefix_beats_small_load_but_not_a_large_one():
    c = core(decode_weight=1.0)
    hs = hashes(list(range(64)))            # 16 blocks
    c.indexes[0].apply(stored(hs))
    c.loads[0].decoding = 3                 # cost 0 + 3 vs 16 + 0
    assert c.choose(hs, 20, 0.0).worker == 0
    c.loads[0].queued_prefill_blocks = 20   # now 23 vs 16
    d = c.choose(hs, 20, 0.0)
    assert d.worker == 1 and d.costs == (23.0, 16.0)


def test_kv_shortfall_is_priced():
    c = core()
    hs = hashes(list(range(16)))
    c.reported(0, free_blocks=0, kv_usage=1.0)
    c.reported(1, free_blocks=100, kv_usage=0.1)
    c.loads[1].decoding = 2                 # 4 + 2 vs 4 + 10 blocks it cannot hold
    assert c.choose(hs, 10, 0.0).worker == 1


def test_ties_go_to_the_affinity_worker_then_spread():
    c = core(n=3)
    hs = hashes(list(range(8)))
    assert c.choose(hs, 4, 0.0, affinity=2).worker == 2
    chosen = set()
    for _ in range(3):
        d = c.choose(hs, 4, 0.0)
        c.routed(d, [], 0.0)                # in flight, no prefix noted
        chosen.add(d.worker)
    assert chosen == {0, 1, 2}


def test_round_robin_and_down_workers():
    c = core(n=3, policy="round_robin")
    c.worker_down(1)
    seq = [c.choose([], 1, 0.0).worker for _ in range(4)]
    assert seq == [0, 2, 0, 2]
    c.worker_down(0)
    c.worker_down(2)
    assert c.choose([], 1, 0.0) is None


def test_least_load_ignores_prefixes():
    c = core(policy="least_load")
    hs = hashes(list(range(64)))
    c.indexes[0].apply(stored(hs))
    c.loads[0].decoding = 1
    d = c.choose(hs, 20, 0.0)
    assert d.worker == 1 and d.expected_hit_blocks == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["route", "start", "finish"]),
                          st.integers(0, 20), st.integers(0, 3)), max_size=60))
def test_account_balances(ops):
    """Any interleaving of route / first token / finish leaves the account consistent and
    back at zero once everything finished."""
    c = core(n=3)
    live: list[tuple[int, int, bool]] = []
    for op, blocks, which in ops:
        if op == "route":
            tokens = list(range(blocks * 4))
            d = c.choose(hashes(tokens), blocks + 1, 0.0)
            live.append((d.worker, c.routed(d, hashes(tokens), 0.0), False))
        elif live:
            i = which % len(live)
            w, charged, started = live[i]
            if op == "start" and not started:
                c.first_token(w, charged)
                live[i] = (w, charged, True)
            elif op == "finish":
                c.finished(w, charged, started)
                live.pop(i)
        for w, load in enumerate(c.loads):
            mine = [r for r in live if r[0] == w]
            assert load.in_flight == len(mine)
            assert load.decoding == sum(r[2] for r in mine)
            assert load.queued_prefill_blocks == sum(r[1] for r in mine if not r[2])
    for w, charged, started in live:
        c.finished(w, charged, started)
    assert all(load.in_flight == load.decoding == load.queued_prefill_blocks == 0
               for load in c.loads)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40))
def test_choice_is_a_cheapest_up_worker(prefix_groups):
    """Whatever the state, the chosen worker's cost is the minimum over the workers up."""
    c = core(n=3)
    for g in prefix_groups:
        hs = hashes([g] * 32)
        d = c.choose(hs, 9, 0.0)
        up_costs = [x for x in d.costs if x is not None]
        assert d.costs[d.worker] == min(up_costs)
        c.routed(d, hs, 0.0)


def test_lora_adapter_routing():
    """1. the worker holding the request's adapter wins between equal workers; 2. a real
    load difference still beats it; 3. its prefix counts only under the same adapter;
    4. routing there counts as holding it until the next report says otherwise."""
    c = core()
    hs = hashes(list(range(16)))
    c.reported(0, free_blocks=100, kv_usage=0.1, adapters=[])
    c.reported(1, free_blocks=100, kv_usage=0.1, adapters=["sql"])
    assert c.choose(hs, 8, 0.0, adapter="sql").worker == 1
    assert c.choose(hs, 8, 0.0, affinity=0).worker == 0      # base requests: no preference
    c.loads[1].decoding = 3
    assert c.choose(hs, 8, 0.0, adapter="sql").worker == 0
    c.loads[1].decoding = 0
    sql = hashes(list(range(16)), ident=CacheIdentity(model_fingerprint="fp",
                                                      adapter="sql").encode())
    assert sql != hs
    c.indexes[0].apply(stored(sql))                          # worker 0 ran sql's prompt
    d = c.choose(sql, 8, 0.0, adapter="sql")
    assert d.worker == 0 and d.expected_hit_blocks == 4
    c.routed(c.choose(hs, 8, 0.0, adapter="chat", affinity=0), [], 0.0, "chat")
    assert "chat" in c.loads[0].adapters
    c.reported(0, free_blocks=100, kv_usage=0.1, adapters=["sql"])
    assert c.loads[0].adapters == {"sql"}
