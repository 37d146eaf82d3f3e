"""KVCacheManager: unit tests and a stateful model check (pure; no torch, no asyncio)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tokenloom.actors.kv.kv_manager import KVCacheManager, KVSnapshot
from tokenloom.arith import cdiv


def test_num_blocks_needed_is_ceil_minus_held():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert [kv.num_blocks_needed("a", t) for t in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    kv.allocate([("a", 5)])
    assert kv.num_held("a") == 2
    assert [kv.num_blocks_needed("a", t) for t in (0, 3, 8, 9, 13)] == [0, 0, 0, 1, 2]
    with pytest.raises(ValueError):
        kv.num_blocks_needed("a", -1)


def test_allocate_grows_tables_and_returns_only_new_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert kv.allocate([("a", 5), ("b", 1)]) == {"a": [0, 1], "b": [2]}
    # "a" fits 8 tokens already; "b" grows by one block; "c" is new.
    assert kv.allocate([("a", 8), ("b", 5), ("c", 12)]) == {"a": [], "b": [3], "c": [4, 5, 6]}
    assert kv.block_table("a") == [0, 1]
    assert kv.block_table("b") == [2, 3]
    assert kv.block_table("c") == [4, 5, 6]
    assert (kv.num_used_blocks, kv.num_free_blocks) == (7, 3)
    kv.check_integrity()


def test_tables_never_shrink():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate([("a", 6)])
    assert kv.allocate([("a", 1)]) == {"a": []}
    assert kv.num_held("a") == 3


def test_allocate_is_atomic_across_grants():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate([("a", 4)])
    before = {rid: kv.block_table(rid) for rid in ("a",)}
    # 1 + 3 blocks needed, 3 free: nothing at all may be allocated.
    assert kv.allocate([("a", 8), ("b", 12)]) is None
    assert {rid: kv.block_table(rid) for rid in ("a",)} == before
    assert not kv.has_request("b")
    assert kv.num_free_blocks == 3
    kv.check_integrity()
    # Exactly filling the pool succeeds.
    assert kv.allocate([("a", 8), ("b", 8)]) == {"a": [1], "b": [2, 3]}
    assert kv.num_free_blocks == 0
    assert kv.allocate([("c", 1)]) is None
    assert kv.allocate([("c", 0)]) == {"c": []}
    kv.check_integrity()


def test_allocate_rejects_duplicate_request_ids():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="more than once"):
        kv.allocate([("a", 4), ("a", 8)])
    assert kv.num_free_blocks == 4


def test_empty_grants():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert kv.allocate([]) == {}


def test_free_releases_table_and_is_idempotent():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    kv.allocate([("a", 5), ("b", 2)])
    assert kv.free("a") == 3
    assert kv.free("a") == 0
    assert kv.free("never-seen") == 0
    assert kv.num_held("a") == 0
    with pytest.raises(KeyError):
        kv.block_table("a")
    assert (kv.num_used_blocks, kv.num_free_blocks) == (1, 5)
    kv.check_integrity()


def test_free_returns_tail_blocks_to_the_pool_first():
    kv = KVCacheManager(num_blocks=3, block_size=1)
    kv.allocate([("a", 3)])
    kv.free("a")
    assert kv.allocate([("b", 3)]) == {"b": [2, 1, 0]}


def test_block_table_is_a_copy():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate([("a", 4)])
    kv.block_table("a").append(3)
    assert kv.block_table("a") == [0]


def test_usage_capacity_and_snapshot():
    kv = KVCacheManager(num_blocks=8, block_size=16)
    assert kv.capacity_tokens == 128
    assert kv.usage == 0.0
    kv.allocate([("a", 33)])
    assert kv.usage == 3 / 8
    snap = kv.snapshot()
    assert snap == KVSnapshot(num_free_blocks=5, num_used_blocks=3, num_blocks=8, block_size=16)
    with pytest.raises(AttributeError):
        snap.num_free_blocks = 0
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=KVSnapshot) == snap


def test_constructor_validation():
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=0, block_size=16)


def test_check_integrity_detects_corruption():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate([("a", 8), ("b", 4)])
    kv._tables["b"][0].append(kv._tables["a"][0][0])
    with pytest.raises(AssertionError, match="held by both"):
        kv.check_integrity()

    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate([("a", 4)])
    kv._tables["a"][0].append(3)  # a block the pool still lists as free
    with pytest.raises(AssertionError, match="holds free block 3"):
        kv.check_integrity()

    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate([("a", 8)])
    kv._tables["a"][0].pop()  # leaked: used in the pool, in no table
    with pytest.raises(AssertionError, match="tables hold 1 blocks but the pool has 2 used"):
        kv.check_integrity()


def test_check_integrity_with_sharing():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    kv.allocate([("a", 8)])
    assert kv.fork("a", "b", 8) == []        # legitimately shared: ref_cnt 2, two tables
    kv.check_integrity()

    kv._pool.incr_ref([0])                    # a reference no table accounts for
    with pytest.raises(AssertionError, match="ref_cnt 3 but 2 table"):
        kv.check_integrity()

    kv = KVCacheManager(num_blocks=6, block_size=4)
    kv.allocate([("a", 4)])
    kv._tables["a"][0].append(0)
    with pytest.raises(AssertionError, match="holds a block twice"):
        kv.check_integrity()


REQUEST_IDS = ["r0", "r1", "r2", "r3", "r4"]


class KVManagerMachine(RuleBasedStateMachine):
    """Compares KVCacheManager with a model: blocks held per request and a free count."""

    num_blocks = 12
    block_size = 4

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(self.num_blocks, self.block_size)
        self.held: dict[str, list[int]] = {}

    def num_free(self) -> int:
        return self.num_blocks - sum(len(t) for t in self.held.values())

    @rule(
        grants=st.lists(
            st.tuples(st.sampled_from(REQUEST_IDS), st.integers(0, 40)),
            max_size=4,
            unique_by=lambda g: g[0],
        )
    )
    def allocate(self, grants):
        needed = {
            rid: max(0, cdiv(tokens, self.block_size) - len(self.held.get(rid, [])))
            for rid, tokens in grants
        }
        for rid, tokens in grants:
            assert self.kv.num_blocks_needed(rid, tokens) == needed[rid]
        free_before = set(range(self.num_blocks)) - {b for t in self.held.values() for b in t}
        result = self.kv.allocate(grants)
        if sum(needed.values()) > len(free_before):
            assert result is None
            return  # the invariant checks nothing changed
        assert result is not None
        assert list(result) == [rid for rid, _ in grants]
        added = [b for rid in result for b in result[rid]]
        assert len(added) == len(set(added)) and set(added) <= free_before
        for rid, _ in grants:
            assert len(result[rid]) == needed[rid]
            self.held[rid] = self.held.get(rid, []) + result[rid]

    @rule(rid=st.sampled_from(REQUEST_IDS + ["unknown"]))
    def free(self, rid):
        assert self.kv.free(rid) == len(self.held.pop(rid, []))

    @rule(rid=st.sampled_from(REQUEST_IDS))
    def free_twice_is_idempotent(self, rid):
        self.free(rid)
        assert self.kv.free(rid) == 0

    @invariant()
    def matches_model(self):
        self.kv.check_integrity()
        assert self.kv.num_free_blocks == self.num_free()
        assert self.kv.num_used_blocks == self.num_blocks - self.num_free()
        for rid in REQUEST_IDS:
            assert self.kv.has_request(rid) == (rid in self.held)
            assert self.kv.num_held(rid) == len(self.held.get(rid, []))
            if rid in self.held:
                assert self.kv.block_table(rid) == self.held[rid]
        assert self.kv.snapshot() == KVSnapshot(
            self.num_free(), self.num_blocks - self.num_free(), self.num_blocks, self.block_size
        )
        assert self.kv.usage == (self.num_blocks - self.num_free()) / self.num_blocks


KVManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_kv_manager_state_machine = KVManagerMachine.TestCase
