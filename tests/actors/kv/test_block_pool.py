"""BlockPool: unit tests and a stateful model check (pure; no torch, no asyncio)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenloom.actors.kv.block_pool import BlockPool


def test_fresh_pool_is_all_free():
    pool = BlockPool(4)
    assert (pool.num_blocks, pool.num_free_blocks, pool.num_used_blocks) == (4, 4, 0)
    assert all(pool.ref_count(b) == 0 for b in range(4))
    pool.check_integrity()


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_pops_from_head_in_id_order():
    pool = BlockPool(5)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert [pool.ref_count(b) for b in range(5)] == [1] * 5
    assert pool.num_free_blocks == 0
    pool.check_integrity()


def test_allocate_is_all_or_nothing_and_returns_none_without_room():
    pool = BlockPool(3)
    assert pool.allocate(2) == [0, 1]
    assert not pool.can_allocate(2)
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    assert pool.can_allocate(1)
    assert pool.allocate(1) == [2]
    assert pool.allocate(1) is None
    pool.check_integrity()


def test_allocate_zero_and_negative():
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.can_allocate(0)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        pool.can_allocate(-1)


def test_freed_blocks_go_to_tail_lru_order():
    pool = BlockPool(4)
    pool.allocate(4)
    pool.free([2, 0])
    assert pool.allocate(1) == [2]
    pool.free([3])
    # Free list is now [0, 3]: 0 was freed before 3.
    assert pool.allocate(2) == [0, 3]
    pool.check_integrity()


def test_free_to_front_is_reused_first_in_listed_order():
    pool = BlockPool(6)
    pool.allocate(6)
    pool.free([4, 5])
    pool.incr_ref([1])
    pool.free([2, 1, 3], front=True)  # 1 keeps a reference: it stays used
    assert list(pool._free) == [2, 3, 4, 5]
    assert pool.allocate(2) == [2, 3]
    pool.check_integrity()


def test_unallocated_blocks_are_used_before_freed_ones():
    pool = BlockPool(4)
    assert pool.allocate(1) == [0]
    pool.free([0])
    assert pool.allocate(4) == [1, 2, 3, 0]


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    pool.free([0])
    with pytest.raises(AssertionError, match="double free of block 0"):
        pool.free([0])
    with pytest.raises(AssertionError, match="double free of block 1"):
        pool.free([1, 1])
    # The failed free([1, 1]) released nothing, not even the first reference.
    assert pool.ref_count(1) == 1
    assert pool.num_free_blocks == 2
    with pytest.raises(AssertionError, match="double free of block 2"):
        pool.free([2])  # never allocated
    pool.check_integrity()


def test_invalid_block_ids_raise():
    pool = BlockPool(2)
    pool.allocate(2)
    for bad in (-1, 2, 99):
        with pytest.raises(AssertionError, match="invalid block id"):
            pool.free([bad])
        with pytest.raises(AssertionError, match="invalid block id"):
            pool.incr_ref([bad])
        with pytest.raises(AssertionError, match="invalid block id"):
            pool.ref_count(bad)


def test_incr_ref_keeps_block_used_until_last_free():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.incr_ref([block, block])
    assert pool.ref_count(block) == 3
    pool.free([block])
    pool.free([block])
    assert pool.ref_count(block) == 1
    assert pool.num_used_blocks == 1
    pool.free([block])
    assert pool.ref_count(block) == 0
    assert pool.num_free_blocks == 2
    pool.check_integrity()


def test_incr_ref_of_free_block_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(1)
    with pytest.raises(AssertionError, match="incr_ref of free block 1"):
        pool.incr_ref([0, 1])
    assert pool.ref_count(0) == 1
    pool.check_integrity()


def test_reclaim_takes_blocks_from_the_middle_of_the_free_list():
    pool = BlockPool(5)
    pool.allocate(5)
    pool.free([4, 3, 2, 1, 0])
    pool.reclaim([2])
    assert pool.ref_count(2) == 1
    assert pool.num_used_blocks == 1
    pool.check_integrity()
    assert pool.allocate(4) == [4, 3, 1, 0]


def test_reclaim_rejects_used_or_duplicate_blocks():
    pool = BlockPool(3)
    pool.allocate(1)
    with pytest.raises(AssertionError, match="in use"):
        pool.reclaim([1, 0])
    with pytest.raises(AssertionError, match="duplicate"):
        pool.reclaim([1, 1])
    assert pool.num_free_blocks == 2
    pool.check_integrity()


def test_check_integrity_detects_corruption():
    pool = BlockPool(3)
    pool.allocate(2)
    pool._ref_cnt[2] = 1  # a free block claims a reference
    with pytest.raises(AssertionError, match="both free and used"):
        pool.check_integrity()

    pool = BlockPool(3)
    pool.allocate(2)
    pool._ref_cnt[0] = 0  # a used block lost its reference
    with pytest.raises(AssertionError, match="neither free nor used"):
        pool.check_integrity()

    pool = BlockPool(3)
    pool.allocate(1)
    pool._num_used = 2  # counters disagree
    with pytest.raises(AssertionError, match=r"free \(2\) \+ used \(2\) != total \(3\)"):
        pool.check_integrity()

    pool = BlockPool(3)
    pool._free[7] = None  # id outside the pool
    with pytest.raises(AssertionError, match="invalid block ids"):
        pool.check_integrity()


class BlockPoolMachine(RuleBasedStateMachine):
    """Compares BlockPool with a model: a ref-count dict and a free list in LRU order."""

    num_blocks = 8

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.num_blocks)
        self.ref = dict.fromkeys(range(self.num_blocks), 0)
        self.free_order = list(range(self.num_blocks))

    def used(self) -> list[int]:
        return sorted(b for b, r in self.ref.items() if r > 0)

    @rule(n=st.integers(0, num_blocks + 2))
    def allocate(self, n):
        got = self.pool.allocate(n)
        if n > len(self.free_order):
            assert got is None
            return
        assert got == self.free_order[:n]
        del self.free_order[:n]
        for b in got:
            self.ref[b] = 1

    @precondition(lambda self: self.used())
    @rule(data=st.data())
    def free(self, data):
        # Draw references to drop: an id may repeat up to its ref count.
        refs = [b for b in self.used() for _ in range(self.ref[b])]
        picked = data.draw(st.lists(st.sampled_from(refs), min_size=1, max_size=6))
        counts = Counter(picked)
        picked = [b for b in picked if counts[b] <= self.ref[b]]
        if not picked:
            return
        self.pool.free(picked)
        for b in picked:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free_order.append(b)

    @precondition(lambda self: self.used())
    @rule(data=st.data())
    def incr_ref(self, data):
        picked = data.draw(st.lists(st.sampled_from(self.used()), min_size=1, max_size=4))
        self.pool.incr_ref(picked)
        for b in picked:
            self.ref[b] += 1

    @precondition(lambda self: self.free_order)
    @rule(data=st.data())
    def double_free_raises(self, data):
        victim = data.draw(st.sampled_from(self.free_order))
        others = [b for b in self.used() if self.ref[b] == 1][:1]
        try:
            self.pool.free(others + [victim])
        except AssertionError as e:
            assert f"double free of block {victim}" in str(e)
        else:
            raise AssertionError("freeing a free block did not raise")
        # Nothing was freed, not even the valid ids listed before the bad one.

    @precondition(lambda self: self.free_order)
    @rule(data=st.data())
    def reclaim(self, data):
        picked = data.draw(st.lists(st.sampled_from(self.free_order), unique=True, max_size=3))
        self.pool.reclaim(picked)
        for b in picked:
            self.free_order.remove(b)
            self.ref[b] = 1

    @invariant()
    def matches_model(self):
        self.pool.check_integrity()
        assert self.pool.num_free_blocks == len(self.free_order)
        assert self.pool.num_used_blocks == len(self.used())
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == self.num_blocks
        assert [self.pool.ref_count(b) for b in range(self.num_blocks)] == [
            self.ref[b] for b in range(self.num_blocks)
        ]
        assert self.pool.can_allocate(len(self.free_order))
        assert not self.pool.can_allocate(len(self.free_order) + 1)


BlockPoolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_block_pool_state_machine = BlockPoolMachine.TestCase
