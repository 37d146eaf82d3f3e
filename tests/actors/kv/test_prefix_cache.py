"""Prefix caching in the KV manager: sharing, isolation, eviction, flush, events, misses that
explain themselves, fork/CoW — unit scenarios plus a stateful model check. Pure: no torch."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenloom.actors.kv.block_hash import CacheIdentity, hash_request_blocks
from tokenloom.actors.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventCollector,
    KVEventPublisher,
)
from tokenloom.actors.kv.kv_manager import KVCacheManager, PrefixLookup
from tokenloom.actors.kv.prefix_cache import FlushResult, MissReason, PrefixQuery
from tokenloom.arith import cdiv

BS = 4
FP = "model-fp"


def chain(tokens, salt=None):
    return hash_request_blocks(tokens, BS, CacheIdentity(FP, salt).encode())


def query(tokens, salt=None, preempted=False) -> PrefixQuery:
    content = chain(tokens) if salt is not None else None
    return PrefixQuery(list(tokens), chain(tokens, salt), content, preempted)


def make(num_blocks=16, **kw) -> tuple[KVCacheManager, list]:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True, **kw)
    events: list = []
    kv.events.subscribe(events.append)
    return kv, events


def prefill(kv, rid, tokens, salt=None, preempted=False):
    """Admit ``rid`` with its whole prompt, then compute it and commit its full blocks."""
    q = query(tokens, salt, preempted)
    grown = kv.allocate_with_prefix([(rid, len(tokens))], {rid: q})
    assert grown is not None
    kv.commit_full_blocks(rid, len(tokens), q.block_hashes, tokens, q.content_hashes)
    kv.check_integrity()
    return grown[rid]


def assert_counters_balance(kv):
    s = kv.prefix_stats()
    assert (s.queried_tokens + s.preempted_queried_tokens
            == s.hit_tokens + s.preempted_hit_tokens + sum(s.missed_tokens.values()))


A = list(range(1, 13))          # 3 full blocks
A_PLUS = A + [50, 51, 52]       # A then a partial block


# ---------------------------------------------------------------- sharing and isolation

def test_same_salt_shares_blocks_and_different_salts_never_do():
    kv, _ = make()
    a = prefill(kv, "a", A_PLUS, salt="t1")
    assert a.num_cached_tokens == 0
    b = prefill(kv, "b", A_PLUS, salt="t1")
    assert b.num_cached_tokens == 12
    assert kv.block_table("b")[:3] == kv.block_table("a")[:3]
    assert all(kv._pool.ref_count(blk) == 2 for blk in kv.block_table("a")[:3])
    c = prefill(kv, "c", A_PLUS, salt="t2")
    d = prefill(kv, "d", A_PLUS)  # no salt
    assert c.num_cached_tokens == d.num_cached_tokens == 0
    tables = [set(kv.block_table(r)) for r in ("a", "c", "d")]
    assert tables[0].isdisjoint(tables[1]) and tables[0].isdisjoint(tables[2])
    assert tables[1].isdisjoint(tables[2])
    assert c.prefix.miss_reason == d.prefix.miss_reason == MissReason.ISOLATION
    s = kv.prefix_stats()
    assert (s.requests, s.queried_tokens, s.hit_tokens) == (4, 60, 12)
    assert s.missed_tokens["isolation"] == 30
    assert_counters_balance(kv)


def test_fully_cached_prompt_still_recomputes_its_last_token():
    kv, _ = make()
    prefill(kv, "a", A)                     # 12 tokens = 3 full blocks, all cached
    assert kv.num_cached_blocks == 3
    q = query(A)
    assert kv.lookup("b", q) == PrefixLookup(num_hit_blocks=2, num_cached_tokens=8,
                                             num_reclaimed_blocks=0)
    b = kv.allocate_with_prefix([("b", 12)], {"b": q})["b"]
    # The block holding the last prompt token is never reused: b gets its own copy.
    assert b.num_cached_tokens == 8
    assert b.block_ids[:2] == kv.block_table("a")[:2]
    assert b.block_ids[2] != kv.block_table("a")[2]
    assert b.prefix.miss_reason == MissReason.PARTIAL_BLOCK
    # One more token and the third block is reusable.
    assert kv.lookup("c", query(A + [99])).num_cached_tokens == 12


def test_lookup_is_read_only_and_allocate_agrees_with_it():
    kv, events = make()
    prefill(kv, "a", A_PLUS)
    kv.free("a")
    free_order = list(kv._pool._free)
    n_events, stats = len(events), kv.prefix_stats()
    q = query(A_PLUS)
    look = kv.lookup("b", q)
    assert look == PrefixLookup(3, 12, 3)
    assert list(kv._pool._free) == free_order and len(events) == n_events
    assert kv.prefix_stats() == stats
    grown = kv.allocate_with_prefix([("b", 15)], {"b": q})["b"]
    assert grown.num_cached_tokens == look.num_cached_tokens
    assert kv.num_free_blocks == 16 - 4
    # A grant smaller than the hit still gets the whole hit: tables never shrink.
    short = kv.allocate_with_prefix([("s", 0)], {"s": query(A_PLUS)})["s"]
    assert short.block_ids == grown.block_ids[:3] and short.num_cached_tokens == 12
    # A request that already holds a table gets no hit.
    assert kv.lookup("b", q) == PrefixLookup()


def test_hit_on_free_cached_block_reclaims_it_from_the_lru_list():
    kv, _ = make(num_blocks=8)
    prefill(kv, "a", A_PLUS)
    shared = kv.block_table("a")[:3]
    kv.free("a")
    assert all(kv._pool.is_free(blk) for blk in shared)
    free_before = kv.num_free_blocks
    b = prefill(kv, "b", A + [77])
    assert b.block_ids[:3] == shared
    assert all(not kv._pool.is_free(blk) and kv._pool.ref_count(blk) == 1 for blk in shared)
    assert kv.num_free_blocks == free_before - 4  # 3 reclaimed + 1 fresh


def test_two_requests_hitting_the_same_free_blocks_in_one_call():
    kv, _ = make(num_blocks=8)
    prefill(kv, "a", A_PLUS)
    kv.free("a")
    qs = {"b": query(A + [1]), "c": query(A + [2])}
    # 3 distinct reclaimed blocks + 1 fresh each = 5 of 8 free: fits exactly once counted.
    grown = kv.allocate_with_prefix([("b", 13), ("c", 13)], qs)
    assert grown["b"].block_ids[:3] == grown["c"].block_ids[:3]
    assert all(kv._pool.ref_count(blk) == 2 for blk in grown["b"].block_ids[:3])
    assert kv.num_free_blocks == 3
    kv.check_integrity()


def test_refused_allocation_changes_nothing_not_even_touches():
    kv, events = make(num_blocks=5)
    prefill(kv, "a", A_PLUS)                   # 4 blocks, 3 cached
    kv.free("a")
    free_order, stats, n_events = list(kv._pool._free), kv.prefix_stats(), len(events)
    # b hits 3 free blocks and needs 3 fresh: 6 > 5.
    assert kv.allocate_with_prefix([("b", 24)], {"b": query(A + list(range(60, 72)))}) is None
    assert list(kv._pool._free) == free_order
    assert kv.prefix_stats() == stats and len(events) == n_events
    assert not kv.has_request("b")
    kv.check_integrity()


def test_a_hit_cannot_be_evicted_by_the_allocation_that_takes_it():
    kv, events = make(num_blocks=4)
    prefill(kv, "a", [1] * 8)               # blocks 0, 1
    prefill(kv, "c", [2] * 8)               # blocks 2, 3
    kv.free("a")
    kv.free("c")
    assert list(kv._pool._free) == [1, 0, 3, 2]   # a's blocks at the LRU head
    events.clear()
    grown = kv.allocate_with_prefix([("b", 9)], {"b": query([1] * 9)})["b"]
    # Taking the hits first means the fresh block comes from after them: c's tail.
    assert grown.block_ids == [0, 1, 3]
    assert events == [BlockRemoved(block_hashes=[chain([2] * 8)[1]])]
    kv.check_integrity()


# ------------------------------------------------------------------ eviction and free

def test_eviction_is_lru_and_a_finished_requests_tail_goes_first():
    kv, events = make(num_blocks=6)
    prefill(kv, "a", A_PLUS)                 # blocks 0..3; 3 is partial (uncached)
    ha = chain(A_PLUS)
    kv.free("a")
    # Uncached partial block first (worthless), then never-used blocks, then a's blocks
    # tail-first so that its prefix survives longest.
    assert list(kv._pool._free) == [3, 4, 5, 2, 1, 0]
    events.clear()
    kv.allocate([("x", 16)])                 # 4 blocks: 3, 4, 5, then evicts block 2
    assert kv.block_table("x") == [3, 4, 5, 2]
    assert events == [BlockRemoved(block_hashes=[ha[2]])]
    assert kv.lookup("b", query(A_PLUS)).num_hit_blocks == 2
    kv.free("x")
    b = prefill(kv, "b", A_PLUS)
    assert b.num_cached_tokens == 8
    assert b.prefix.miss_reason == MissReason.EVICTED


def test_free_keeps_hashes_and_duplicates_stay_uncached():
    kv, events = make(num_blocks=8)
    q = query(A)
    # Two requests with the same prompt admitted in the same step: neither hits.
    grown = kv.allocate_with_prefix([("a", 12), ("b", 12)], {"a": q, "b": query(A)})
    assert grown["a"].num_cached_tokens == grown["b"].num_cached_tokens == 0
    assert kv.commit_full_blocks("a", 12, q.block_hashes, A) == 3
    assert kv.commit_full_blocks("b", 12, q.block_hashes, A) == 0  # duplicates: uncached
    assert [type(e) for e in events] == [BlockStored]
    assert kv.num_cached_blocks == 3
    kv.free("b")
    # b's uncached duplicates go to the head: reused before any cached block.
    assert list(kv._pool._free)[:3] == grown["b"].block_ids[::-1]
    kv.free("a")
    assert kv.num_cached_blocks == 3
    kv.check_integrity()


def test_commit_is_incremental_across_chunks_and_decode():
    kv, events = make()
    tokens = list(range(1, 11))
    q = query(tokens)
    kv.allocate_with_prefix([("a", 6)], {"a": q})            # chunk of 6
    assert kv.commit_full_blocks("a", 6, q.block_hashes, tokens) == 1
    assert kv.commit_full_blocks("a", 6, q.block_hashes, tokens) == 0   # idempotent
    kv.allocate([("a", 10)])
    assert kv.commit_full_blocks("a", 10, q.block_hashes, tokens) == 1
    tokens += [11, 12]                                       # two decoded tokens
    kv.allocate([("a", 12)])
    assert kv.commit_full_blocks("a", 12, chain(tokens), tokens) == 1
    h = chain(tokens)
    assert [(e.block_hashes, e.parent_block_hash) for e in events] == [
        ([h[0]], None), ([h[1]], h[0]), ([h[2]], h[1])]
    assert events[0].token_ids == [1, 2, 3, 4] and events[0].block_size == BS
    assert kv.commit_full_blocks("gone", 12, h, tokens) == 0
    with pytest.raises(ValueError):
        kv.commit_full_blocks("a", 16, h, tokens)              # more than it holds


# ------------------------------------------------------------------------------ flush

def test_flush_refuses_while_running_unless_forced_and_keeps_used_blocks():
    kv, events = make()
    prefill(kv, "a", A_PLUS)
    prefill(kv, "b", [9] * 8)
    kv.free("b")
    events.clear()
    assert kv.num_requests == 1
    result = kv.flush(force=False, num_running=kv.num_requests)
    assert result.freed == 0 and "running" in result.refused_reason
    assert kv.num_cached_blocks == 5 and events == []
    result = kv.flush(force=True, num_running=1)
    assert result == FlushResult(freed=2)
    assert events == [BlockRemoved(block_hashes=chain([9] * 8))]
    assert kv.num_cached_blocks == 3                          # a's blocks are in use
    kv.free("a")
    events.clear()
    assert kv.flush(force=False, num_running=0) == FlushResult(freed=3)
    assert events == [AllBlocksCleared()]
    assert kv.num_cached_blocks == 0
    assert kv.num_free_blocks == 16
    # After a flush, a miss on what was there reads "evicted".
    assert prefill(kv, "c", A_PLUS).prefix.miss_reason == MissReason.EVICTED
    kv.check_integrity()


def test_flush_with_caching_off_frees_nothing():
    kv = KVCacheManager(4, BS)
    assert kv.flush(force=False, num_running=3) == FlushResult(0)


# --------------------------------------------------------------------------- misses

def test_each_miss_reason_has_a_scenario():
    kv, _ = make(num_blocks=32)
    assert prefill(kv, "a", A_PLUS).prefix.miss_reason == MissReason.NO_PREFIX
    # Shares blocks 0-1 and the first token of block 2, then diverges inside it.
    diverge = A[:9] + [70, 71, 72, 73]
    r = prefill(kv, "b", diverge).prefix
    assert (r.num_hit_blocks, r.miss_reason) == (2, MissReason.PARTIAL_BLOCK)
    # Shares a prefix shorter than one block: nothing reusable.
    r = prefill(kv, "c", A[:2] + [80, 81, 82, 83]).prefix
    assert (r.num_hit_blocks, r.miss_reason) == (0, MissReason.PARTIAL_BLOCK)
    # A prompt shorter than one block that starts like a cached one.
    r = prefill(kv, "c2", A[:3]).prefix
    assert r.miss_reason == MissReason.PARTIAL_BLOCK
    # Diverging exactly at a block boundary is not partial: nothing was shared there.
    r = prefill(kv, "d", A[:8] + [90, 91, 92, 93, 94]).prefix
    assert (r.num_hit_blocks, r.miss_reason) == (2, MissReason.NO_PREFIX)
    r = prefill(kv, "e", A_PLUS, salt="other").prefix
    assert (r.num_hit_blocks, r.miss_reason) == (0, MissReason.ISOLATION)
    r = prefill(kv, "f", A_PLUS, preempted=True).prefix
    assert (r.num_hit_blocks, r.miss_reason) == (3, MissReason.RECOMPUTE_AFTER_PREEMPT)
    # evicted: see test_eviction_is_lru... and test_flush...
    s = kv.prefix_stats()
    assert s.preempted_requests == 1 and s.preempted_hit_tokens == 12
    assert s.missed_tokens["recompute_after_preempt"] == 3
    assert s.missed_tokens["no_prefix"] == 15 + 5
    assert s.hit_tokens == 8 + 8
    assert_counters_balance(kv)


def test_a_miss_on_unseen_tokens_with_same_first_token_elsewhere_in_chain_is_no_prefix():
    kv, _ = make()
    prefill(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Block 1 of b starts with 5, like a's block 1 — but under a different parent.
    r = prefill(kv, "b", [9, 9, 9, 9, 5, 0, 0, 0, 1]).prefix
    assert r.miss_reason == MissReason.NO_PREFIX


def test_bounded_evicted_memory_forgets_oldest():
    kv, _ = make(num_blocks=4, evicted_memory=2)
    prefill(kv, "a", [1] * 12 + [0])         # 4 blocks, 3 cached
    kv.free("a")
    kv.allocate([("x", 16)])                  # evicts all 3; memory keeps the last 2
    kv.free("x")
    assert len(kv._cache._evicted) == 2
    kv.check_integrity()
    # The first block's hash (freed last, evicted last) is remembered.
    assert prefill(kv, "b", [1] * 5).prefix.miss_reason == MissReason.EVICTED


# ---------------------------------------------------------------------------- fork

def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv, _ = make(num_blocks=8)
    kv.allocate([("p", 10)])                 # blocks 0, 1, 2 (2 holds tokens 8-9)
    copies = kv.fork("p", "c", 10)
    assert copies == [(2, 3)]
    assert kv.block_table("c") == [0, 1, 3]
    assert [kv._pool.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    kv.check_integrity()
    # Exactly at a block boundary there is nothing to copy.
    assert kv.fork("p", "c2", 8) == []
    assert kv.block_table("c2") == [0, 1]
    assert kv._pool.ref_count(0) == 3
    kv.free("p")
    kv.free("c")
    assert kv._pool.ref_count(0) == 1
    kv.check_integrity()


def test_fork_refused_when_no_block_for_the_copy_changes_nothing():
    kv, _ = make(num_blocks=3)
    kv.allocate([("p", 10)])
    assert kv.fork("p", "c", 10) is None
    assert not kv.has_request("c") and kv._pool.ref_count(0) == 1
    with pytest.raises(ValueError):
        kv.fork("p", "p", 4)
    with pytest.raises(ValueError):
        kv.fork("p", "c", 13)
    kv.check_integrity()


def test_fork_works_without_prefix_caching():
    kv = KVCacheManager(8, BS)
    kv.allocate([("p", 6)])
    assert kv.fork("p", "c", 6) == [(1, 2)]
    kv.check_integrity()


# ---------------------------------------------------------------------------- events

def test_stored_events_split_around_duplicates_and_round_trip():
    kv, events = make()
    tokens = list(range(1, 17))
    h = chain(tokens)
    prefill(kv, "a", tokens[:8] + [0])        # caches blocks 0, 1
    kv.free("a")
    # b computes all 4 blocks itself (no query), so blocks 0 and 1 are duplicates.
    kv.allocate([("b", 16)])
    events.clear()
    assert kv.commit_full_blocks("b", 16, h, tokens) == 2
    assert events == [BlockStored(block_hashes=h[2:4], parent_block_hash=h[1],
                                  token_ids=tokens[8:16], block_size=BS,
                                  extra_keys=[None, None])]
    collector = EventCollector()
    kv.events.subscribe(collector)
    kv.free("b")
    kv.allocate([("c", 64)])                  # evicts everything cached
    batch = collector.drain(ts=1.5)
    assert collector.drain() is None
    assert [type(e) for e in batch.events] == [BlockRemoved]
    wire = msgspec.msgpack.encode(batch)
    assert msgspec.msgpack.decode(wire, type=EventBatch) == batch


def test_publisher_subscribe_unsubscribe_and_faulty_subscriber():
    pub = KVEventPublisher()
    got: list = []

    def broken(event):
        raise RuntimeError("boom")

    pub.subscribe(broken)
    pub.subscribe(got.append)
    pub.publish(AllBlocksCleared())
    assert got == [AllBlocksCleared()] and pub.num_callback_errors == 1
    pub.unsubscribe(got.append)
    pub.unsubscribe(got.append)   # idempotent
    pub.publish(AllBlocksCleared())
    assert len(got) == 1


def test_caching_off_by_default_is_inert():
    kv = KVCacheManager(8, BS)
    assert kv.prefix_stats().missed_tokens == {r.value: 0 for r in MissReason}
    q = query(A)
    grown = kv.allocate_with_prefix([("a", 12)], {"a": q})
    assert grown["a"].num_cached_tokens == 0 and grown["a"].prefix is None
    assert kv.commit_full_blocks("a", 12, q.block_hashes, A) == 0
    kv.free("a")
    assert kv.lookup("b", q) == PrefixLookup()
    assert list(kv._pool._free)[-3:] == [2, 1, 0]         # plain LRU order, as before


def test_query_validation():
    kv, _ = make()
    with pytest.raises(ValueError, match="block hashes"):
        kv.lookup("a", PrefixQuery([1, 2, 3], chain(A)))
    with pytest.raises(ValueError, match="without a grant"):
        kv.allocate_with_prefix([], {"a": query(A)})
    kv.allocate([("a", 4)])
    with pytest.raises(ValueError, match="hold a table"):
        kv.allocate_with_prefix([("a", 12)], {"a": query(A)})


# ------------------------------------------------------------------ stateful model check

NUM_BLOCKS = 8
RIDS = ["r0", "r1", "r2", "r3"]
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 9, 9], [3, 3, 3, 3], []]
SALTS = [None, "t1"]


class Req:
    def __init__(self, tokens, salt, table, computed):
        self.tokens, self.salt, self.table, self.computed = tokens, salt, table, computed
        self.hashes = chain(tokens, salt)
        self.content = chain(tokens) if salt is not None else None


class PrefixCachingMachine(RuleBasedStateMachine):
    """Drives KVCacheManager(enable_prefix_caching=True) like a scheduler would and
    checks it against a model: each request's table, the KV each block holds (what
    the runner wrote there), the event stream, and the counters.

    The key property: every cached hash maps to a block that really holds that hash's KV
    — i.e. no block is evicted, reused or written while the cache still serves it."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=True,
                                 evicted_memory=6)
        self.reqs: dict[str, Req] = {}
        self.kv_content: dict[int, object] = {}   # block -> hash of the KV it holds
        self.replayed: set[bytes] = set()
        self.kv.events.subscribe(self._replay)
        self.next_child = 0

    def _replay(self, event):
        match event:
            case BlockStored(block_hashes=hashes):
                assert not set(hashes) & self.replayed, "stored twice"
                self.replayed |= set(hashes)
            case BlockRemoved(block_hashes=hashes):
                assert set(hashes) <= self.replayed, "removed what was not stored"
                self.replayed -= set(hashes)
            case AllBlocksCleared():
                self.replayed.clear()

    def held(self) -> set[int]:
        return {b for r in self.reqs.values() for b in r.table}

    @rule(data=st.data())
    def allocate(self, data):
        rids = data.draw(st.lists(st.sampled_from(RIDS), min_size=1, max_size=3, unique=True))
        grants, prefixes, lookups = [], {}, {}
        for rid in rids:
            if rid in self.reqs:
                r = self.reqs[rid]
                grants.append((rid, min(len(r.tokens), r.computed + data.draw(st.integers(0, 9)))))
                continue
            tokens = (data.draw(st.sampled_from(PREFIXES))
                      + data.draw(st.lists(st.integers(1, 3), max_size=9)))
            if not tokens:
                tokens = [1]
            salt = data.draw(st.sampled_from(SALTS))
            q = query(tokens, salt, preempted=data.draw(st.booleans()))
            look = self.kv.lookup(rid, q)
            lookups[rid] = (look, tokens, salt)
            prefixes[rid] = q
            chunk = data.draw(st.integers(1, len(tokens)))
            grants.append((rid, min(len(tokens), look.num_cached_tokens + chunk)))
        # The model's expectation of the refusal, from the lookups alone.
        held = self.held()
        hit_free = set()
        needed = 0
        for rid, total in grants:
            have = len(self.reqs[rid].table) if rid in self.reqs else lookups[rid][0].num_hit_blocks
            needed += max(0, cdiv(total, BS) - have)
        for rid, (look, tokens, salt) in lookups.items():
            hits = self.kv._cache.match(prefixes[rid].block_hashes[: (len(tokens) - 1) // BS])
            assert len(hits) == look.num_hit_blocks
            assert look.num_reclaimed_blocks == len(set(hits) - held)
            hit_free |= set(hits) - held
        free = NUM_BLOCKS - len(held)
        result = self.kv.allocate_with_prefix(grants, prefixes)
        if needed + len(hit_free) > free:
            assert result is None
            return
        assert result is not None
        fresh = [b for rid, _ in grants for b in result[rid].block_ids[
            (lookups[rid][0].num_hit_blocks if rid in lookups else 0):]]
        assert len(fresh) == len(set(fresh)) and not set(fresh) & held
        for b in fresh:
            self.kv_content[b] = None     # whatever it held is about to be overwritten
        for rid, total in grants:
            g = result[rid]
            if rid in self.reqs:
                assert g.num_cached_tokens == 0 and g.prefix is None
                self.reqs[rid].table += g.block_ids
                continue
            look, tokens, salt = lookups[rid]
            assert g.num_cached_tokens == look.num_cached_tokens
            assert g.num_cached_tokens <= (len(tokens) - 1) // BS * BS
            assert g.prefix.num_query_tokens == len(tokens)
            if prefixes[rid].preempted:
                assert g.prefix.miss_reason == MissReason.RECOMPUTE_AFTER_PREEMPT
            r = Req(tokens, salt, list(g.block_ids), g.num_cached_tokens)
            for i in range(look.num_hit_blocks):
                # The cache served blocks that hold exactly this request's KV.
                assert self.kv_content[r.table[i]] == r.hashes[i]
            assert len(r.table) == max(look.num_hit_blocks, cdiv(total, BS))
            self.reqs[rid] = r

    @precondition(lambda self: len(self.reqs) < len(RIDS))
    @rule(data=st.data())
    def pressure(self, data):
        """A novel request takes every free block, evicting whatever cached blocks are free,
        and is aborted at once."""
        rid = data.draw(st.sampled_from([r for r in RIDS if r not in self.reqs]))
        free = NUM_BLOCKS - len(self.held())
        cached_free = {b for b in self.kv._cache._block_of.values() if b not in self.held()}
        tokens = [7] * (free * BS) or [7]
        # No hashes: it must not hit (its own earlier copies), only evict.
        no_hit = PrefixQuery(tokens, [])
        result = self.kv.allocate_with_prefix([(rid, free * BS)], {rid: no_hit})
        assert result[rid].num_cached_tokens == 0
        assert not cached_free & set(self.kv._cache._block_of.values())   # all evicted
        for b in result[rid].block_ids:
            self.kv_content[b] = None
        assert self.kv.free(rid) == free   # an aborted request: only the eviction remains

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def compute(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs[rid]
        new = min(r.computed + data.draw(st.integers(1, 16)), len(r.table) * BS, len(r.tokens))
        holders = [b for q in self.reqs.values() for b in q.table]
        for i in range(r.computed // BS, cdiv(new, BS)):
            block = r.table[i]
            # The runner writes here: it must be this request's alone and not cached.
            assert holders.count(block) == 1, f"write to shared block {block}"
            assert not self.kv._cache.is_cached(block), f"write to cached block {block}"
            self.kv_content[block] = r.hashes[i] if (i + 1) * BS <= new else ("partial", rid)
        r.computed = new
        self.kv.commit_full_blocks(rid, new, r.hashes, r.tokens, r.content)

    @precondition(lambda self: self.reqs and len(self.reqs) < len(RIDS))
    @rule(data=st.data())
    def fork(self, data):
        parent_id = data.draw(st.sampled_from(sorted(self.reqs)))
        child_id = data.draw(st.sampled_from([r for r in RIDS if r not in self.reqs]))
        p = self.reqs[parent_id]
        n = p.computed
        free = NUM_BLOCKS - len(self.held())
        copies = self.kv.fork(parent_id, child_id, n)
        full = n // BS
        if n % BS and free == 0:
            assert copies is None
            return
        suffix = data.draw(st.lists(st.integers(1, 3), max_size=6))
        c = Req(p.tokens[:n] + suffix, p.salt, self.kv.block_table(child_id), n)
        assert c.table[:full] == p.table[:full]
        if n % BS:
            (src, dst), = copies
            assert src == p.table[full] and c.table == p.table[:full] + [dst]
            assert dst not in self.held()
            self.kv_content[dst] = self.kv_content[src]
        else:
            assert copies == [] and c.table == p.table[:full]
        self.reqs[child_id] = c

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs.pop(rid)
        assert self.kv.free(rid) == len(r.table)
        assert self.kv.free(rid) == 0

    @rule(force=st.booleans(), roll=st.integers(0, 7))
    def flush(self, force, roll):
        if roll != 3:  # rare, or the cache would rarely hold anything to hit or evict
            return
        held = self.held()
        unreferenced = [b for b in self.kv._cache._block_of.values() if b not in held]
        result = self.kv.flush(force=force, num_running=len(self.reqs))
        if self.reqs and not force:
            assert result.freed == 0 and result.refused_reason
            return
        assert result == FlushResult(freed=len(unreferenced))
        assert set(self.kv._cache._block_of.values()) <= held

    @invariant()
    def matches_model(self):
        kv = self.kv
        kv.check_integrity()
        held = self.held()
        assert kv.num_free_blocks == NUM_BLOCKS - len(held)
        assert kv.num_used_blocks == len(held)
        for rid, r in self.reqs.items():
            assert kv.block_table(rid) == r.table
        owners: dict[int, list[Req]] = {}
        for r in self.reqs.values():
            for b in r.table:
                owners.setdefault(b, []).append(r)
        for b, rs in owners.items():
            assert kv._pool.ref_count(b) == len(rs)
            assert len({r.salt for r in rs}) == 1, "different salts share a block"
        for h, b in kv._cache._block_of.items():
            assert self.kv_content.get(b) == h, f"cached block {b} does not hold its KV"
        assert self.replayed == kv._cache.cached_hashes()
        assert_counters_balance(kv)


PrefixCachingMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)
test_prefix_caching_state_machine = PrefixCachingMachine.TestCase
