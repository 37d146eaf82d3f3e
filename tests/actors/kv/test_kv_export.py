"""A handoff's prefill half (``PrefixQuery.export``) sends its cached prefix blocks down to
the KV tiers as if it had computed them: the decode worker restores the whole chain from
the handoff tier, hit blocks included."""

from __future__ import annotations

import msgspec

from tokenloom.actors.kv.block_hash import CacheIdentity, hash_request_blocks
from tokenloom.actors.kv.kv_manager import KVCacheManager
from tokenloom.actors.kv.prefix_cache import PrefixQuery

BS = 4
A = list(range(1, 13))              # 3 full blocks
B = A + [50, 51, 52, 53, 54]        # A's blocks, one more full block and a partial one


def query(tokens, export=False) -> PrefixQuery:
    chain = hash_request_blocks(tokens, BS, CacheIdentity("model-fp", None).encode())
    return PrefixQuery(list(tokens), chain, export=export)


def setup(wants=lambda h, committed: True) -> tuple[KVCacheManager, list]:
    """A manager with tiers attached and A prefilled and committed (its write-through
    offloads taken, as the runner would)."""
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    asked: list = []
    kv.attach_tiers(lambda h, committed: (asked.append((h, committed)), wants(h, committed))[1])
    q = query(A)
    assert kv.allocate_with_prefix([("a", len(A))], {"a": q}) is not None
    kv.commit_full_blocks("a", len(A), q.block_hashes, A)
    assert [c for *_, c in kv.take_offloads()] == [True, True, True]
    asked.clear()
    return kv, asked


def test_an_exporting_admission_queues_its_hit_blocks():
    kv, asked = setup()
    q = query(B, export=True)
    g = kv.allocate_with_prefix([("b", len(B))], {"b": q})["b"]
    hit = kv.block_table("a")[:3]
    assert g.block_ids[:3] == hit and g.num_cached_tokens == 12
    offloads = kv.take_offloads()
    assert [(b, c) for b, _, c in offloads] == [(b, True) for b in hit]
    assert [m.block_hash for _, m, _ in offloads] == q.block_hashes[:3]
    assert [m.token_ids for _, m, _ in offloads] == [tuple(A[i:i + BS]) for i in (0, 4, 8)]
    assert [m.parent_hash for _, m, _ in offloads] == [None, *q.block_hashes[:2]]
    assert asked == [(h, True) for h in q.block_hashes[:3]]     # asked as computed blocks
    kv.check_integrity()


def test_the_scheduler_admission_exports_too():
    kv, _ = setup()
    g = kv.admit("b", len(B), query(B, export=True))
    assert g.num_cached_tokens == 12
    assert [b for b, _, _ in kv.take_offloads()] == kv.block_table("a")[:3]


def test_only_blocks_the_tiers_want_are_queued():
    have: set[bytes] = set()
    kv, _ = setup(lambda h, committed: h not in have)
    q = query(B, export=True)
    have.add(q.block_hashes[1])                           # already in the handoff tier
    kv.allocate_with_prefix([("b", len(B))], {"b": q})
    assert [m.block_hash for _, m, _ in kv.take_offloads()] == [q.block_hashes[0],
                                                               q.block_hashes[2]]


def test_without_export_hits_are_not_queued():
    kv, asked = setup()
    kv.allocate_with_prefix([("b", len(B))], {"b": query(B)})
    assert kv.take_offloads() == [] and asked == []
    kv.admit("c", len(B), query(B))
    assert kv.take_offloads() == [] and asked == []


def test_export_without_a_hit_or_without_tiers_queues_nothing():
    kv, _ = setup()
    kv.allocate_with_prefix([("b", 9)], {"b": query([7] * 9, export=True)})
    assert kv.take_offloads() == []
    plain = KVCacheManager(16, BS, enable_prefix_caching=True)
    q = query(A)
    plain.allocate_with_prefix([("a", len(A))], {"a": q})
    plain.commit_full_blocks("a", len(A), q.block_hashes, A)
    plain.allocate_with_prefix([("b", len(B))], {"b": msgspec.structs.replace(
        query(B), export=True)})
    assert plain.take_offloads() == []
