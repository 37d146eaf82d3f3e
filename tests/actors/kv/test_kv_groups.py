"""Layer groups over one KV pool (actors/kv/groups.py) and the KV manager's per-group
tables: sliding groups drop the blocks behind their windows, a prefix hit needs each
group's blocks inside its window at the hit point, forks and swaps go group by group.
Pure: no torch, no asyncio."""

from __future__ import annotations

import pytest

from tokenloom.actors.kv.block_hash import CacheIdentity, hash_request_blocks
from tokenloom.actors.kv.groups import NULL_BLOCK, KVGroups
from tokenloom.actors.kv.kv_manager import KVCacheManager
from tokenloom.actors.kv.prefix_cache import PrefixQuery

IDENT = CacheIdentity("model").encode()
BS = 4


def query(tokens: list[int]) -> PrefixQuery:
    return PrefixQuery(token_ids=tokens, block_hashes=hash_request_blocks(tokens, BS, IDENT))


def test_plan_groups_layers_by_type_in_equal_sizes():
    # Gemma 3 1B: layers 5, 11, 17, 23 full, the other 22 sliding.
    windows = [None if i % 6 == 5 else 512 for i in range(26)]
    g = KVGroups.plan(windows)
    assert g.num_slots == 4 and g.num_groups == 7
    assert g.windows == (None,) + (512,) * 6
    assert [g.layer_group[i] for i in (5, 11, 17, 23)] == [0, 0, 0, 0]
    assert sorted(g.layer_slot[i] for i in (5, 11, 17, 23)) == [0, 1, 2, 3]
    # every (group, slot) pair is one layer's
    assert len({(g.layer_group[i], g.layer_slot[i]) for i in range(26)}) == 26
    # Gemma 2: alternating 13 + 13; Mistral: one sliding group; Llama: one full group.
    assert KVGroups.plan([8, None] * 13).num_groups == 2
    mistral = KVGroups.plan([8] * 4)
    assert (mistral.num_groups, mistral.num_slots, mistral.hybrid) == (1, 4, True)
    assert KVGroups.plan([None] * 3) == KVGroups.single(3)


def test_blocks_for_counts_only_the_window_of_sliding_groups():
    # 5 sliding : 1 full, window 1,024, 16-token blocks: at 16k a request holds 1,024 blocks
    # in the full group and 64 in each sliding one (keys >= 15,361: blocks 960..1,023).
    g = KVGroups.plan([None] + [1024] * 5)
    assert g.blocks_for(16384, 16384, 16) == 1024 + 5 * 64
    single = KVGroups.single(6)
    assert single.blocks_for(16384, 16384, 16) == 1024
    # 6 groups of 1 layer against 1 group of 6: blocks are 6x smaller, so the same memory
    # holds 6 * 1024 / (1024 + 320) = 4.57x the sequences.
    assert 6 * 1024 / g.blocks_for(16384, 16384, 16) > 3


def test_sliding_groups_drop_blocks_behind_the_window():
    kv = KVCacheManager(32, BS, groups=KVGroups.plan([None, 6]))
    assert kv.num_blocks == 31            # NULL_BLOCK is reserved
    assert kv.allocate([("a", 16)]) is not None
    assert kv.num_held("a") == 8          # 4 blocks in each group
    # Next position 16, window 6: keys >= 11 are still read, so blocks 0-1 ([0, 8)) go.
    assert kv.drop_behind_windows("a", 16) == 2
    full, sliding = kv.block_tables("a")
    assert NULL_BLOCK not in full and sliding[:2] == [NULL_BLOCK] * 2
    assert NULL_BLOCK not in sliding[2:]
    assert kv.num_held("a") == 6 and kv.num_used_blocks == 6
    assert kv.num_blocks_needed("a", 20) == 2    # one position block more, in both groups
    kv.check_integrity()
    assert kv.free("a") == 6 and kv.num_used_blocks == 0
    kv.check_integrity()


def test_a_hit_needs_each_sliding_group_s_window_at_the_hit_point():
    kv = KVCacheManager(64, BS, enable_prefix_caching=True, groups=KVGroups.plan([None, 6]))
    tokens = list(range(100, 124))          # 6 blocks
    kv.allocate_with_prefix([("a", 24)], {"a": query(tokens)})
    kv.commit_full_blocks("a", 24, query(tokens).block_hashes, tokens)
    kv.free("a")
    hit = kv.lookup("b", query(tokens + [7]))
    assert hit.num_hit_blocks == 6
    # While "a" runs past it, its sliding group drops what is behind the window: the hit
    # at 24 still needs only the window's blocks (4 and 5), which "a" holds.
    kv2 = KVCacheManager(64, BS, enable_prefix_caching=True, groups=KVGroups.plan([None, 6]))
    kv2.allocate_with_prefix([("a", 24)], {"a": query(tokens)})
    kv2.commit_full_blocks("a", 24, query(tokens).block_hashes, tokens)
    assert kv2.drop_behind_windows("a", 24) == 4
    assert kv2.lookup("b", query(tokens + [7])).num_hit_blocks == 6
    kv2.free("a")
    assert kv2.lookup("b", query(tokens + [7])).num_hit_blocks == 6
    grown = kv2.allocate_with_prefix([("b", 25)], {"b": query(tokens + [7])})
    full, sliding = kv2.block_tables("b")
    assert grown["b"].num_cached_tokens == 24 and len(full) == 7
    # At hit point 24 (window 6) the sliding group needs positions >= 19: blocks 4, 5.
    assert sliding[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in sliding[4:]
    kv2.check_integrity()


def test_a_hit_stops_where_a_sliding_group_lost_its_window():
    groups = KVGroups.plan([None, 6])
    kv = KVCacheManager(64, BS, enable_prefix_caching=True, groups=groups)
    tokens = list(range(100, 124))
    q = query(tokens)
    kv.allocate_with_prefix([("a", 24)], {"a": q})
    kv.commit_full_blocks("a", 24, q.block_hashes, tokens)
    sliding_block_5 = kv.block_tables("a")[1][5]
    kv.free("a")
    # Evict exactly the sliding group's block 5 by allocating until it is reused.
    while kv._cache.is_cached(sliding_block_5):     # noqa: SLF001 (test of the eviction order)
        kv.allocate([(f"x{kv.num_requests}", BS)])
    hit = kv.lookup("b", query(tokens + [7]))
    # 6 full blocks are cached but the sliding window at 24 needs block 5: the hit shrinks
    # to a point whose window is whole (or to nothing).
    assert hit.num_hit_blocks < 6
    kv.check_integrity()


def test_forks_copy_the_partial_block_of_every_group():
    kv = KVCacheManager(32, BS, groups=KVGroups.plan([None, 6]))
    kv.allocate([("p", 10)])
    copies = kv.fork("p", "c", 10)
    assert len(copies) == 2                      # a partial block per group
    parent, child = kv.block_tables("p"), kv.block_tables("c")
    for pg, cg, (src, dst) in zip(parent, child, copies):
        assert cg[:2] == pg[:2] and cg[2] == dst and src == pg[2]
    kv.check_integrity()


def test_swap_in_pairs_slots_group_by_group():
    kv = KVCacheManager(40, BS, groups=KVGroups.plan([None, 6]))
    kv.allocate([("a", 16)])
    kv.drop_behind_windows("a", 16)
    out = kv.swap_out_blocks("a")                # 4 full + 2 sliding, slot order
    assert len(out) == 6
    kv.free("a")
    # Re-granted with more tokens, having computed 18 by then: each slot goes back to its
    # table position; the sliding group's block 2 is behind the window now, so its slot is
    # not needed.
    kv.allocate([("a", 20)], computed={"a": 18})
    full, sliding = kv.block_tables("a")
    assert sliding[:3] == [NULL_BLOCK] * 3 and len(sliding) == 5
    slots = [100 + i for i in range(6)]
    assert kv.swap_in_pairs("a", slots) == list(zip(slots, full[:4])) + [(105, sliding[3])]
    kv.check_integrity()


@pytest.mark.parametrize("windows", [[None], [None, 6], [6, 6], [None, 6, 6, 6]])
def test_admit_fits_its_reservation_in_every_layout(windows):
    groups = KVGroups.plan(windows)
    kv = KVCacheManager(64, BS, enable_prefix_caching=True, groups=groups)
    tokens = list(range(50, 90))
    q = query(tokens)
    kv.allocate_with_prefix([("a", 40)], {"a": q})
    kv.commit_full_blocks("a", 40, q.block_hashes, tokens)
    kv.free("a")
    before = kv.num_free_blocks
    g = kv.admit("b", planned_tokens=9, query=query(tokens[:30] + [1, 2, 3]))
    used = before - kv.num_free_blocks
    assert used <= groups.num_groups * 3       # what the scheduler reserved (3 blocks a group)
    assert g.num_cached_tokens % BS == 0
    kv.check_integrity()
