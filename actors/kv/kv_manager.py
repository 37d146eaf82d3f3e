"""KV cache manager: the only owner of block tables.

Pure module (no torch, no asyncio); the KV-manager actor is a thin shell around it.

Contract:
- Each request id owns one block table per layer group (a list of physical block ids, in
  token order; groups.py). A model without sliding-window layers has one group: one table
  per request. Tables only grow while a request runs; ``free`` releases all of them. A
  sliding group's blocks behind its window are released as the request advances
  (``drop_behind_windows``), their entries becoming ``NULL_BLOCK``.
- ``allocate(grants)`` is atomic across all grants: either every table grows to hold its
  requested token count, or nothing changes and it returns ``None``. It never raises for
  lack of room: ``None`` means "does not fit" and the scheduler preempts or waits.
- ``free`` is idempotent: freeing an unknown (or already freed) request releases nothing.
- Misuse (negative token counts, the same request twice in one ``allocate``, asking for the
  table of an unknown request) raises; those are scheduler bugs, not memory pressure.

Sharing and prefix caching (``enable_prefix_caching=True``; off, behaviour is unchanged):
- A block may be in several tables (a prefix hit, or an n>1 ``fork``); its ref_cnt is the
  number of tables holding it. A request only ever writes KV into blocks it holds alone:
  hits and fork-shared blocks are full, and it computes from after them.
- ``lookup`` (read-only) says how many leading blocks of a request are cached;
  ``allocate_with_prefix`` starts a new request's table with them (ref + 1, taken back
  from the LRU free list if free), atomically with the rest of the allocation.
- ``commit_full_blocks`` registers blocks that became full and computed. ``free`` keeps
  their hashes: they go to the LRU free list (tail blocks first, evicted first), while
  blocks without a hash go to its head (reused before any cached block is evicted).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from tokenloom.actors.kv.block_hash import BlockHash, group_hashes
from tokenloom.actors.kv.block_pool import BlockPool
from tokenloom.actors.kv.events import KVEventPublisher
from tokenloom.actors.kv.groups import NULL_BLOCK, KVGroups
from tokenloom.actors.kv.integrity import check_tables
from tokenloom.actors.kv.prefix_cache import (
    FlushResult,
    PrefixCache,
    PrefixCacheStats,
    PrefixQuery,
    PrefixRecord,
    empty_stats,
)
from tokenloom.arith import cdiv


class KVSnapshot(msgspec.Struct, frozen=True, gc=False):
    """Block counts at one instant, sent to the scheduler and to metrics."""

    num_free_blocks: int
    num_used_blocks: int
    num_blocks: int
    block_size: int


class PrefixLookup(msgspec.Struct, frozen=True, gc=False):
    """What a prefix hit would give a request now. ``num_reclaimed_blocks`` of the hit
    blocks are currently free: taking them consumes free blocks (the policy must count
    them, once per distinct block, besides the new blocks)."""

    num_hit_blocks: int = 0
    num_cached_tokens: int = 0
    num_reclaimed_blocks: int = 0


class TableGrowth(msgspec.Struct, frozen=True, gc=False):
    """One request's share of an allocation. ``block_ids`` were appended to its table in
    order: cached hit blocks first (``num_cached_tokens`` tokens of KV already computed;
    full blocks only), then fresh ones. ``prefix`` is set for requests given a query.

    KV tiers: the first ``len(restores)`` fresh blocks are restored rather than computed —
    ``restores`` pairs each with its bytes (the runner writes them before the step's
    forward) and ``restored_tiers`` names the tier each came from. They count in
    ``num_cached_tokens`` (nothing recomputes them) but are not yet in the device's prefix
    cache: they are committed after the step, like computed blocks."""

    block_ids: list[int]
    num_cached_tokens: int = 0
    prefix: PrefixRecord | None = None
    restores: list[tuple[int, Any]] = []
    restored_tiers: list[str] = []


class StagedBlocks(msgspec.Struct, frozen=True, gc=False):
    """Blocks ``start_block ..`` of a request's chain fetched from the tiers for its
    admission: their bytes and the tier each came from."""
    start_block: int
    payloads: list[Any]
    tiers: list[str]


class _Hit(msgspec.Struct, frozen=True, gc=False):
    """A prefix hit over every group: `num_blocks` leading blocks are cached, and group g
    reuses blocks `first[g] ..` of them (`blocks[g]`; a sliding group needs only those
    inside its window at the hit point)."""
    num_blocks: int
    blocks: list[list[int]]
    first: list[int]

    def distinct(self) -> set[int]:
        return {b for group in self.blocks for b in group}



class KVCacheManager:
    """Maps request ids to block tables (one per layer group) over one ``BlockPool``."""

    def __init__(self, num_blocks: int, block_size: int, *,
                 enable_prefix_caching: bool = False,
                 events: KVEventPublisher | None = None,
                 evicted_memory: int | None = None,
                 groups: KVGroups | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._groups = groups if groups is not None else KVGroups.single(1)
        self._pool = BlockPool(num_blocks)
        # A hybrid layout's tables hold NULL_BLOCK for dropped blocks: the pool reserves it.
        self._reserved = 0
        if self._groups.hybrid:
            taken = self._pool.allocate(1)
            assert taken == [NULL_BLOCK], f"a fresh pool allocated {taken} first"
            self._reserved = 1
        self._block_size = block_size
        self._tables: dict[str, list[list[int]]] = {}
        self.events = events if events is not None else KVEventPublisher()
        self._cache: PrefixCache | None = None
        if enable_prefix_caching:
            self._cache = PrefixCache(self._pool, block_size, events=self.events,
                                      evicted_memory=evicted_memory)
        # Leading table blocks already offered to the cache (hits count as offered).
        self._committed: dict[str, int] = {}
        # Swapped-out requests: the table positions each group held, in the order the swap
        # slots were given (a swap-in pairs them position by position).
        self._swapped_shape: dict[str, list[list[int]]] = {}
        # KV tiers: device blocks the runner must copy out before anything overwrites them
        # (block id, identity, committed: write-through of a new block, else an eviction).
        self.offloads: list[tuple[int, Any, bool]] = []
        self._tier_wants: Callable[[bytes, bool], bool] | None = None

    def attach_tiers(self, wants: Callable[[bytes, bool], bool]) -> None:
        """Send blocks down to the KV tiers: every block the cache evicts or stores for
        which ``wants(hash, committed)`` is true is queued in ``offloads``."""
        if self._cache is None:
            raise ValueError("KV tiers need prefix caching")
        if self._groups.hybrid:
            raise ValueError("KV tiers restore a chain's blocks from the start; this "
                             "model's sliding-window layers keep only their windows")
        self._tier_wants = wants

        def sink(block_id: int, meta, committed: bool) -> None:
            if wants(meta.block_hash, committed):
                self.offloads.append((block_id, meta, committed))

        self._cache.tier_sink = sink

    def _export_hits(self, blocks: Sequence[int]) -> None:
        """Copy a handoff's cached prefix blocks out to the tiers that take computed
        blocks (the handoff tier), as if computed now: the runner copies them before the
        next forward, and the request's own reference keeps them from being overwritten."""
        if self._tier_wants is None or self._cache is None:
            return
        for b in blocks:
            meta = self._cache.meta(b)
            if self._tier_wants(meta.block_hash, True):
                self.offloads.append((b, meta, True))

    def take_offloads(self) -> list[tuple[int, Any, bool]]:
        out, self.offloads = self.offloads, []
        return out

    # ------------------------------------------------------------------ queries

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def groups(self) -> KVGroups:
        return self._groups

    @property
    def num_blocks(self) -> int:
        """Blocks tables can hold (a hybrid layout reserves NULL_BLOCK)."""
        return self._pool.num_blocks - self._reserved

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self._pool.num_used_blocks - self._reserved

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (vLLM's ``kv_cache_usage_perc``)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self._block_size

    def num_held(self, request_id: str) -> int:
        """Blocks currently held by ``request_id`` over all its groups (0 if unknown)."""
        return sum(b != NULL_BLOCK or not self._reserved
                   for t in self._tables.get(request_id, ()) for b in t)

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's (first group's) block table. ``KeyError`` if the
        request holds no table."""
        return list(self._tables[request_id][0])

    def block_tables(self, request_id: str) -> list[list[int]]:
        """Copies of every group's table (``NULL_BLOCK`` where a sliding group dropped)."""
        return [list(t) for t in self._tables[request_id]]

    def physical_blocks(self, request_id: str) -> list[int]:
        """The blocks the request holds, group by group in table order (swap order)."""
        return [b for t in self._tables[request_id] for b in t if not self._null(b)]

    @property
    def num_requests(self) -> int:
        """Requests holding a table (the ``num_running`` a flush refuses to disturb)."""
        return len(self._tables)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def table_length(self, request_id: str) -> int:
        """The length of the request's tables in position blocks (0 if unknown)."""
        return self._logical(request_id)

    def _logical(self, request_id: str) -> int:
        tables = self._tables.get(request_id)
        return len(tables[0]) if tables else 0

    def _null(self, block_id: int) -> bool:
        return self._reserved > 0 and block_id == NULL_BLOCK

    def num_blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        """Extra blocks ``request_id`` needs to hold ``num_total_tokens`` tokens (>= 0):
        one per group for each position block its tables do not cover yet."""
        if num_total_tokens < 0:
            raise ValueError(f"num_total_tokens must be >= 0, got {num_total_tokens}")
        blocks_for_tokens = cdiv(num_total_tokens, self._block_size)
        return self._groups.num_groups * max(0, blocks_for_tokens - self._logical(request_id))

    def snapshot(self) -> KVSnapshot:
        return KVSnapshot(
            num_free_blocks=self.num_free_blocks,
            num_used_blocks=self.num_used_blocks,
            num_blocks=self.num_blocks,
            block_size=self._block_size,
        )

    # ---------------------------------------------------------------- mutations

    @property
    def prefix_caching(self) -> bool:
        return self._cache is not None

    @property
    def num_cached_blocks(self) -> int:
        return self._cache.num_cached_blocks if self._cache is not None else 0

    def prefix_stats(self) -> PrefixCacheStats:
        """A copy of the prefix-cache counters (all zero when caching is off)."""
        if self._cache is None:
            return empty_stats()
        return self._cache.stats()

    def lookup(self, request_id: str, query: PrefixQuery) -> PrefixLookup:
        """How many leading blocks of ``query`` are cached and reusable now. Read-only.

        The block holding the last token is never reused (it must be recomputed so that
        logits exist), so at most ``(len(token_ids) - 1) // block_size`` blocks hit. A
        request that already holds a table gets no hit. Valid until the next allocation:
        ``free`` never removes cache entries, allocation may evict them. With sliding
        groups a hit needs, besides the full groups' whole prefix, each sliding group's
        blocks inside its window at the hit point.
        """
        self._check_query(query)
        if self._cache is None or request_id in self._tables:
            return PrefixLookup()
        hit = self._match(query)
        return PrefixLookup(num_hit_blocks=hit.num_blocks,
                            num_cached_tokens=hit.num_blocks * self._block_size,
                            num_reclaimed_blocks=sum(self._pool.is_free(b)
                                                     for b in hit.distinct()))

    def allocate(self, grants: Sequence[tuple[str, int]],
                 computed: Mapping[str, int] | None = None) -> dict[str, list[int]] | None:
        """Grow every listed table to hold its token count, atomically.

        ``grants`` is a sequence of ``(request_id, num_total_tokens)`` with distinct ids.
        Returns ``{request_id: newly_added_block_ids}`` for every entry (``[]`` when the
        table is already large enough; tables never shrink), or ``None`` when the blocks
        needed by all entries together exceed the free blocks, in which case nothing is
        allocated. Never raises for lack of room. A request id seen here for the first
        time gets a table, even if it needs no blocks yet. ``computed[request_id]``: where
        a new table of a request that computed that much before (a swap-in) starts its
        sliding groups' windows.
        """
        grown = self.allocate_with_prefix(grants, {}, computed=computed)
        return None if grown is None else {rid: g.block_ids for rid, g in grown.items()}

    def allocate_with_prefix(self, grants: Sequence[tuple[str, int]],
                             prefixes: dict[str, PrefixQuery], *,
                             count: bool = True,
                             computed: Mapping[str, int] | None = None
                             ) -> dict[str, TableGrowth] | None:
        """``allocate``, where each request in ``prefixes`` (new: it holds no table) starts
        its table with its cached prefix.

        Atomic: the hits are matched, their blocks taken (ref + 1) and then the fresh
        blocks allocated — so a hit cannot be evicted by the same call — or, when the
        fresh blocks plus the distinct free hit blocks exceed the free blocks, nothing
        changes (no touches, no counters) and it returns ``None``. A request's table covers
        ``max(num_total_tokens, cached tokens)``. Each query is counted in the stats and
        gets a ``PrefixRecord``. With caching off, queries hit nothing and are not counted.
        """
        duplicates = [rid for rid, count in Counter(rid for rid, _ in grants).items() if count > 1]
        if duplicates:
            raise ValueError(f"allocate got request ids more than once: {duplicates}")
        unknown = set(prefixes) - {rid for rid, _ in grants}
        if unknown:
            raise ValueError(f"prefix queries for requests without a grant: {sorted(unknown)}")
        holding = [rid for rid in prefixes if rid in self._tables]
        if holding:
            raise ValueError(f"prefix queries for requests that hold a table: {holding}")
        for query in prefixes.values():
            self._check_query(query)
        computed = computed or {}
        hits = {rid: self._match(q) for rid, q in prefixes.items()}
        plans = [self._growth_plan(rid, n, hits.get(rid), computed.get(rid, 0))
                 for rid, n in grants]
        needed = [sum(fresh) for _, fresh in plans]
        reclaimed = {b for hit in hits.values() for b in hit.distinct() if self._pool.is_free(b)}
        if sum(needed) + len(reclaimed) > self._pool.num_free_blocks:
            return None
        # Explain misses before the allocation below can evict what they look at.
        reasons = {rid: self._cache.classify_miss(q, hits[rid].num_blocks)
                   for rid, q in prefixes.items()} if self._cache is not None else {}
        # Commit point: nothing below can fail for lack of room.
        if self._cache is not None:
            for hit in hits.values():
                self._cache.touch([b for group in hit.blocks for b in group])
        new_blocks = self._allocate_blocks(sum(needed))
        assert new_blocks is not None, "free-block check passed but allocation failed"
        # Split one all-or-nothing pool allocation in grant order: deterministic, and no
        # partial state to roll back.
        result: dict[str, TableGrowth] = {}
        start = 0
        for (rid, _), (prefix_tables, fresh) in zip(grants, plans):
            added_all: list[int] = []
            tables = self._tables.get(rid)
            if tables is None:
                tables = self._tables[rid] = [list(t) for t in prefix_tables]
            for table, n in zip(tables, fresh):
                added = new_blocks[start:start + n]
                start += n
                table.extend(added)
                added_all.extend(added)
            if rid not in prefixes:
                result[rid] = TableGrowth(block_ids=added_all)
                continue
            hit = hits[rid]
            hit_blocks = [b for group in hit.blocks for b in group]
            if prefixes[rid].export and hit.num_blocks:
                self._export_hits(hit.blocks[0])
            record = None
            if self._cache is not None:
                self._committed[rid] = hit.num_blocks
                query = prefixes[rid]
                record = PrefixRecord(num_query_tokens=len(query.token_ids),
                                      num_hit_blocks=hit.num_blocks,
                                      num_hit_tokens=hit.num_blocks * self._block_size,
                                      miss_reason=reasons[rid])
                if count:  # (a restoring admission counts under its own reason)
                    self._cache.record(record.num_query_tokens, record.num_hit_tokens,
                                       record.miss_reason)
            result[rid] = TableGrowth(block_ids=hit_blocks + added_all,
                                      num_cached_tokens=hit.num_blocks * self._block_size,
                                      prefix=record)
        return result

    def _growth_plan(self, request_id: str, num_tokens: int, hit: _Hit | None,
                     computed: int) -> tuple[list[list[int]], list[int]]:
        """(the tables a new request starts with: NULL_BLOCK behind each sliding group's
        window, then its hit blocks; the fresh blocks each group adds)."""
        bs, g = self._block_size, self._groups
        logical = cdiv(num_tokens, bs)
        tables = self._tables.get(request_id)
        if tables is not None:
            have = len(tables[0])
            return [], [max(0, logical - have)] * g.num_groups
        if hit is None or hit.num_blocks == 0:
            first = [min(logical, g.first_kept_block(i, computed, bs))
                     for i in range(g.num_groups)]
            return ([[NULL_BLOCK] * f for f in first],
                    [logical - f for f in first])
        have = max(logical, hit.num_blocks)
        return ([[NULL_BLOCK] * f + blocks for f, blocks in zip(hit.first, hit.blocks)],
                [have - hit.num_blocks] * g.num_groups)

    def admit(self, request_id: str, planned_tokens: int, query: PrefixQuery,
              budget: int | None = None, staged: StagedBlocks | None = None) -> TableGrowth:
        """Admit a new request the scheduler planned to compute ``planned_tokens`` tokens
        of from scratch, reusing its cached prefix when that fits ``budget`` free blocks.

        The scheduler reserved ``groups x ceil(planned_tokens / block_size)`` free blocks
        for it (the default budget; the caller may add unreserved slack). With ``h`` hit
        blocks it computes ``min(planned, len - h * block_size)`` tokens from position
        ``h * block_size``; that costs the fresh blocks plus the hit blocks that are
        currently free (taking them back uses free blocks). The longest hit whose cost fits
        the budget is used — at worst none, which is exactly what was reserved — so an
        admission the scheduler planned is never refused.

        ``staged``: blocks fetched from the KV tiers. Those continuing the device hit (the
        staging starts at or before it) are restored into fresh blocks, as many as fit
        the budget, and the request computes from after them.
        """
        bs, groups = self._block_size, self._groups.num_groups
        reserved = groups * cdiv(planned_tokens, bs)
        if budget is not None:
            reserved = max(reserved, budget)
        hit = self._match(query)
        hits = hit.blocks[0] if groups == 1 else []
        length = len(query.token_ids)
        h = hit.num_blocks
        reusable = max(0, (length - 1) // bs)
        restorable = 0
        if staged is not None and groups == 1 and staged.start_block <= h:
            restorable = max(0, min(staged.start_block + len(staged.payloads), reusable) - h)
        reclaimed = sum(self._pool.is_free(b) for b in hit.distinct())
        r = restorable
        while r > 0:
            fresh = r + cdiv(min(planned_tokens, length - (h + r) * bs), bs)
            if fresh + reclaimed <= reserved:
                break
            r -= 1
        if r > 0:
            return self._admit_restored(request_id, planned_tokens, query, hits, r, staged)
        cut = hit
        while h > 0:
            # (a shorter hit may stop earlier still: a sliding group's window at h - 1
            # need not be cached although its window at h is)
            h = cut.num_blocks
            fresh = groups * cdiv(min(planned_tokens, length - h * bs), bs)
            if h == 0 or fresh + sum(self._pool.is_free(b) for b in cut.distinct()) <= reserved:
                break
            cut = self._match(query, h - 1)
        if h < hit.num_blocks:
            query = msgspec.structs.replace(
                query, block_hashes=query.block_hashes[:h],
                content_hashes=None if query.content_hashes is None else query.content_hashes[:h])
        total = h * bs + min(planned_tokens, length - h * bs)
        grown = self.allocate_with_prefix([(request_id, total)], {request_id: query})
        assert grown is not None, (f"admission of {request_id!r} refused within its "
                                   f"reservation of {reserved} blocks")
        return grown[request_id]

    def _admit_restored(self, request_id: str, planned_tokens: int, query: PrefixQuery,
                        hits: list[int], r: int, staged: StagedBlocks) -> TableGrowth:
        """``admit`` with all ``hits`` and ``r`` restored blocks after them (the budget
        check is the caller's; one group only)."""
        bs = self._block_size
        h = len(hits)
        length = len(query.token_ids)
        reason = self._cache.classify_miss(query, h) if self._cache is not None else None
        total = (h + r) * bs + min(planned_tokens, length - (h + r) * bs)
        cut = msgspec.structs.replace(
            query, block_hashes=query.block_hashes[:h],
            content_hashes=None if query.content_hashes is None else query.content_hashes[:h])
        grown = self.allocate_with_prefix([(request_id, total)], {request_id: cut},
                                          count=False)
        assert grown is not None, f"restoring admission of {request_id!r} refused"
        g = grown[request_id]
        offset = h - staged.start_block
        restores = [(g.block_ids[h + i], staged.payloads[offset + i]) for i in range(r)]
        tiers = staged.tiers[offset:offset + r]
        prefix = g.prefix
        if prefix is not None and self._cache is not None:
            reason = f"{reason}_restored_from_{tiers[0]}"
            prefix = msgspec.structs.replace(prefix, miss_reason=reason,
                                             num_restored_blocks=r)
            self._cache.record(prefix.num_query_tokens, prefix.num_hit_tokens, reason)
        # The restored blocks are committed (cached on the device) after the step.
        self._committed[request_id] = h
        return TableGrowth(block_ids=g.block_ids, num_cached_tokens=(h + r) * bs,
                           prefix=prefix, restores=restores, restored_tiers=list(tiers))

    def num_exclusive(self, request_id: str) -> int:
        """Blocks that freeing ``request_id`` would return to the free list right now
        (those it holds alone); shared prefix blocks stay with their other holders."""
        return sum(self._pool.ref_count(b) == 1 for b in self._held_blocks(request_id))

    def _held_blocks(self, request_id: str) -> list[int]:
        return [b for t in self._tables.get(request_id, ()) for b in t if not self._null(b)]

    def commit_full_blocks(self, request_id: str, num_computed_tokens: int,
                           block_hashes: Sequence[BlockHash], token_ids: Sequence[int],
                           content_hashes: Sequence[BlockHash] | None = None, *,
                           cache_salt: str | None = None, lora_name: str | None = None) -> int:
        """Offer the request's blocks that are full and computed (the first
        ``num_computed_tokens // block_size``) to the cache; return how many became cached.

        Called after a step, with the request's whole chain so far (``block_hashes`` must
        cover those blocks; ``token_ids`` all its tokens). Blocks offered before are
        skipped, so calling it every step costs only the new blocks. A request that holds
        no table (freed meanwhile) commits nothing. A no-op when caching is off. Each
        group's blocks are cached under the group's own hashes (block_hash.group_hashes);
        only the first group's are announced in KV events. ``cache_salt`` (the request's)
        is announced with a chain's first block; ``lora_name`` (its adapter) with every
        stored run.

        A new run's parent must be cached when the run is announced, or a KV event
        subscriber could not place it (llm-d and Dynamo drop a store whose parent they do
        not know). It can be gone: a block offered before stays uncached when its hash is
        cached on another block (two requests computed it at once), and that other block
        may have been evicted since. Then the request's own copies of the missing parents
        (full, computed, held by it) are cached first, back to a cached ancestor or the
        chain's start (or the window's, for a sliding first group).
        """
        if self._cache is None or request_id not in self._tables:
            return 0
        tables = self._tables[request_id]
        bs = self._block_size
        num_full = num_computed_tokens // bs
        if num_full > len(tables[0]):
            raise ValueError(f"request {request_id!r} computed {num_computed_tokens} tokens "
                             f"but holds only {len(tables[0])} blocks")
        if len(block_hashes) < num_full or len(token_ids) < num_full * bs:
            raise ValueError(f"commit of {num_full} full blocks needs their hashes and tokens")
        done = self._committed.get(request_id, 0)
        if num_full <= done:
            return 0
        stored = 0
        for g, table in enumerate(tables):
            hashes = group_hashes(block_hashes[:num_full], g)
            first = next((j for j in range(num_full) if not self._null(table[j])), num_full)
            start = max(done, first)
            if g == 0:
                while start > first and not self._cache.has_hash(hashes[start - 1]):
                    start -= 1
            if start >= num_full:
                continue
            stored += self._cache.cache_blocks(
                table[start:num_full], hashes[start:num_full],
                hashes[start - 1] if start > 0 else None,
                [token_ids[i * bs:(i + 1) * bs] for i in range(start, num_full)],
                content_hashes[start:num_full] if content_hashes is not None and g == 0
                else None, cache_salt=cache_salt, lora_name=lora_name, announce=g == 0)
        self._committed[request_id] = num_full
        return stored

    def can_fork(self, parent_id: str, num_tokens: int) -> bool:
        """Whether the parent still holds every block a child computing from position
        `num_tokens` reads: a sliding group may have dropped some behind its window as the
        parent moved on (the child then computes its prompt itself, with prefix hits)."""
        tables = self._tables.get(parent_id)
        if tables is None:
            return False
        bs = self._block_size
        for g, table in enumerate(tables):   # (the partial block is copied: it counts too)
            first = self._groups.first_kept_block(g, num_tokens, bs)
            if any(self._null(b) for b in table[first:cdiv(num_tokens, bs)]):
                return False
        return True

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give ``child_id`` (new) the parent's first ``num_tokens`` tokens of KV, for n>1
        siblings. Full blocks are shared (ref + 1); a partially filled last block is copied
        into a fresh block (one per group). Returns the ``(src_block, dst_block)`` copies
        the runner must execute before the child's next step, or ``None`` (nothing
        changed) when not enough blocks are free for the copies.

        Copy-on-write happens at fork time rather than on first write: siblings diverge at
        their very first sampled token, which lands in that partial block, so a lazy copy
        would happen at the next step anyway — and copying now (at most block_size tokens)
        keeps "a request writes only blocks it holds alone" true without a write barrier.
        """
        if child_id in self._tables:
            raise ValueError(f"fork into {child_id!r}, which already holds a table")
        tables = self._tables[parent_id]
        num_full, rem = divmod(num_tokens, self._block_size)
        if num_tokens < 0 or num_full + (rem > 0) > len(tables[0]):
            raise ValueError(f"fork of {num_tokens} tokens from {parent_id!r}, which holds "
                             f"{len(tables[0])} blocks")
        copies: list[tuple[int, int]] = []
        if rem:
            dst = self._allocate_blocks(len(tables))
            if dst is None:
                return None
            copies = [(t[num_full], d) for t, d in zip(tables, dst)]
        children = []
        for g, table in enumerate(tables):
            shared = table[:num_full]
            self._pool.incr_ref([b for b in shared if not self._null(b)])
            children.append(list(shared) + ([copies[g][1]] if rem else []))
        self._tables[child_id] = children
        if self._cache is not None:
            self._committed[child_id] = min(self._committed.get(parent_id, 0), num_full)
        return copies

    def drop_behind_windows(self, request_id: str, num_computed: int) -> int:
        """Release the blocks each sliding group no longer needs once the next position to
        compute is ``num_computed`` (their entries become NULL_BLOCK); returns how many.
        Cached ones join the LRU free list, to be reused for prefix hits while they last.
        A step still running may read them: nothing writes a reused block before that step
        is done (the runner executes steps in order)."""
        tables = self._tables.get(request_id)
        if tables is None or not self._groups.hybrid:
            return 0
        dropped = []
        for g, table in enumerate(tables):
            first = min(len(table), self._groups.first_kept_block(g, num_computed,
                                                                  self._block_size))
            for j in range(first):
                if not self._null(table[j]):
                    dropped.append(table[j])
                    table[j] = NULL_BLOCK
        self._release(dropped)
        return len(dropped)

    def swap_out_blocks(self, request_id: str) -> list[int]:
        """The blocks a swap-out copies to host slots, in slot order; which table position
        each came from is kept for the swap-in."""
        self._swapped_shape[request_id] = [
            [j for j, b in enumerate(t) if not self._null(b)] for t in self._tables[request_id]]
        return self.physical_blocks(request_id)

    def swap_in_pairs(self, request_id: str, slots: Sequence[int]) -> list[tuple[int, int]]:
        """(host slot, block) for a swap-in of the slots `swap_out_blocks` filled: each
        slot into the block at its table position in the new tables. A slot whose position
        has fallen behind a sliding window since (the request had computed more by the time
        it was swapped out than when its tables were last trimmed) is not needed."""
        shape = self._swapped_shape.pop(request_id, None)
        tables = self._tables[request_id]
        if shape is None:
            return list(zip(slots, self.physical_blocks(request_id)))
        positions = [(g, j) for g, held in enumerate(shape) for j in held]
        return [(slot, tables[g][j]) for slot, (g, j) in zip(slots, positions)
                if j < len(tables[g]) and not self._null(tables[g][j])]

    def flush(self, force: bool = False, num_running: int = 0) -> FlushResult:
        """Drop every unreferenced cached block (admin ``flush_cache``); see
        ``PrefixCache.flush``. With caching off there is nothing to flush."""
        if self._cache is None:
            return FlushResult(0)
        return self._cache.flush(force, num_running)

    def free(self, request_id: str) -> int:
        """Release ``request_id``'s tables; return the number of blocks released.

        Idempotent: an unknown or already freed request releases 0 blocks.
        """
        tables = self._tables.pop(request_id, None)
        if tables is None:   # (ended while swapped out: its shape is not needed any more)
            self._swapped_shape.pop(request_id, None)
            return 0
        self._committed.pop(request_id, None)
        # Reversed so a request's tail blocks are reused first: its leading blocks are the
        # ones most likely to be a shared prefix.
        blocks = [b for t in tables for b in reversed(t) if not self._null(b)]
        self._release(blocks)
        return len(blocks)

    def _release(self, blocks: list[int]) -> None:
        if self._cache is None:
            self._pool.free(blocks)
            return
        # Blocks without a hash hold nothing reusable: reuse them before evicting any.
        self._pool.free([b for b in blocks if not self._cache.is_cached(b)], front=True)
        self._pool.free([b for b in blocks if self._cache.is_cached(b)])

    # --------------------------------------------------------------- invariants

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` describing the first broken invariant, if any (see
        ``integrity.check_tables``)."""
        check_tables(self._pool, {f"{rid}/{g}": [b for b in t if not self._null(b)]
                                  for rid, tables in self._tables.items()
                                  for g, t in enumerate(tables)},
                     self._cache, {f"{rid}/0": n for rid, n in self._committed.items()},
                     reserved=self._reserved,
                     logical={f"{rid}/0": len(t[0]) for rid, t in self._tables.items()})

    # ------------------------------------------------------------------ helpers

    def _allocate_blocks(self, n: int) -> list[int] | None:
        if self._cache is not None:
            return self._cache.allocate(n)
        return self._pool.allocate(n)

    def _check_query(self, query: PrefixQuery) -> None:
        if len(query.block_hashes) > len(query.token_ids) // self._block_size:
            raise ValueError(f"{len(query.block_hashes)} block hashes for "
                             f"{len(query.token_ids)} tokens")
        if query.content_hashes is not None and \
                len(query.content_hashes) != len(query.block_hashes):
            raise ValueError("content_hashes must be None or match block_hashes")

    def _match(self, query: PrefixQuery, at_most: int | None = None) -> _Hit:
        """The longest hit usable by every group, at most `at_most` blocks."""
        g = self._groups
        if self._cache is None:
            return _Hit(0, [[] for _ in g.windows], [0] * g.num_groups)
        reusable = max(0, (len(query.token_ids) - 1) // self._block_size)
        hashes = query.block_hashes[:reusable if at_most is None else min(reusable, at_most)]
        per_group = [group_hashes(hashes, i) for i in range(g.num_groups)]
        h = len(hashes)
        for i, w in enumerate(g.windows):
            if w is None:
                h = min(h, len(self._cache.match(per_group[i])))
        while h > 0:
            blocks, first = [], []
            for i in range(g.num_groups):
                lo = g.first_kept_block(i, h * self._block_size, self._block_size)
                got = [self._cache.block_of(x) for x in per_group[i][lo:h]]
                if any(b is None for b in got):
                    break
                blocks.append(got)
                first.append(lo)
            else:
                return _Hit(h, blocks, first)
            h -= 1
        return _Hit(0, [[] for _ in g.windows], [0] * g.num_groups)

    def __repr__(self) -> str:
        return (
            f"KVCacheManager(num_blocks={self.num_blocks}, block_size={self._block_size}, "
            f"free={self.num_free_blocks}, requests={len(self._tables)})"
        )
