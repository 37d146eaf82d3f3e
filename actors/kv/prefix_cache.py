"""Automatic prefix caching over a ``BlockPool``: which physical blocks hold which full,
computed block of a hash chain. Pure module (no torch, no asyncio).

Contract:
- Only FULL blocks whose KV has been computed are cached (``cache_blocks``), each under
  its chain hash (``block_hash.py``). A hash maps to exactly one block and a block to at
  most one hash. Caching a hash that is already cached keeps the existing block; the
  duplicate block simply stays uncached (its KV is identical, nothing is lost).
- A cached block stays cached while it is used AND after it is freed: a free cached block
  sits in the pool's LRU free list until allocation pops it from the head — only then is
  it *evicted* (unmapped, ``BlockRemoved`` emitted, its hash remembered in a bounded
  memory so a later miss reads ``evicted``). So all allocation must go through
  ``PrefixCache.allocate``, never ``BlockPool.allocate`` directly.
- ``match`` is read-only. A matched block must be ``touch``ed (ref + 1; a free block is
  taken back out of the middle of the LRU list in O(1)) before anything else allocates,
  or it may be evicted and overwritten.
- ``flush`` drops every unreferenced cached block; blocks still in use stay cached.
- Every change to the set of cached hashes emits one event, synchronously and in order
  (``actors/kv/events.py``), so a subscriber replaying them knows the cached set exactly.

Miss explanation (``classify_miss``) for the first block of a request that did not hit:
- ``partial_block``: the shared prefix ends before a block boundary — the block *is*
  cached but holds the prompt's last token (which must be recomputed so logits exist), or
  a cached block continues the same parent chain with the same first token (the
  sequences diverge inside the block), or the request's tail is a partial block with such
  a sibling (a prompt shorter than one block that shares its start with a cached one).
- ``evicted``: this exact hash was cached once and evicted (or flushed) since.
- ``isolation``: the same tokens are cached under another ``cache_salt`` (its *content*
  hash — the chain computed without the salt — is present).
- ``no_prefix``: none of the above; never seen (or forgotten by the bounded memory).
- ``recompute_after_preempt`` is the caller's call: the request was preempted and is
  recomputing its own tokens. Its hits and misses are counted apart (``preempted_*``),
  as vLLM does, so they don't inflate the hit rate.
Siblings are indexed by (parent hash, first token); for a request's first block the
parent is "none", shared by all identities, so a first-block sibling under another salt
also reads ``partial_block`` — true enough: it would not have hit under the same salt.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Annotated, Callable

import msgspec

from tokenloom.actors.kv.block_hash import BlockHash
from tokenloom.actors.kv.block_pool import BlockPool
from tokenloom.actors.kv.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
)
from tokenloom.actors.kv.tiers.record import BlockMeta
from tokenloom.actors.metric_fields import counter


class MissReason(enum.StrEnum):
    NO_PREFIX = "no_prefix"
    PARTIAL_BLOCK = "partial_block"
    EVICTED = "evicted"
    ISOLATION = "isolation"
    RECOMPUTE_AFTER_PREEMPT = "recompute_after_preempt"


class PrefixQuery(msgspec.Struct, frozen=True, gc=False):
    """What a request brings to a prefix lookup.

    ``token_ids``: every token the request will compute from position 0 (the prompt; after
    a preemption, prompt + generated tokens). ``block_hashes``: the chain over its full
    blocks (a prefix of them is fine). ``content_hashes``: the same chain without the
    salt, or ``None`` for an unsalted identity. ``preempted``: the request is recomputing
    after a preemption (miss reason ``recompute_after_preempt``).
    """
    token_ids: list[int]
    block_hashes: list[bytes]
    content_hashes: list[bytes] | None = None
    preempted: bool = False
    # Disaggregation: this request is the prefill half of a handoff, so its cached prefix
    # blocks go to the KV tiers too (the decode worker restores the whole chain from there).
    export: bool = False


class PrefixRecord(msgspec.Struct, frozen=True, gc=False):
    """Per-request outcome of a prefix lookup, for the request's ``metrics`` object.
    Blocks ``0 .. num_hit_blocks - 1`` hit; block ``num_hit_blocks`` is the first miss.
    With KV tiers, ``num_restored_blocks`` after the hits came back from a tier (the
    reason then names it: ``evicted_restored_from_host``)."""
    num_query_tokens: int
    num_hit_blocks: int
    num_hit_tokens: int
    miss_reason: MissReason | str
    num_restored_blocks: int = 0


class PrefixCacheStats(msgspec.Struct, kw_only=True, gc=False):
    """Monotonic counters. For requests not preempted: queried = hit + missed[reason]
    summed over the first four reasons; for preempted ones: preempted_queried =
    preempted_hit + missed["recompute_after_preempt"]. ``requests``/``queried_tokens``/
    ``hit_tokens`` are vLLM's ``prefix_cache_queries``/``prefix_cache_hits`` semantics."""
    requests: int = 0
    queried_tokens: Annotated[int, counter("vllm:prefix_cache_queries", "Prefix cache queries, "
                                           "in terms of number of queried tokens.")] = 0
    hit_tokens: Annotated[int, counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms "
                                       "of number of cached tokens.")] = 0
    preempted_requests: int = 0
    preempted_queried_tokens: int = 0
    preempted_hit_tokens: int = 0
    # (a preempted request's recompute is neither a query nor a hit, only a miss reason)
    missed_tokens: Annotated[dict[str, int], counter(
        "tokenloom:prefix_cache_missed_tokens", "Prompt tokens not served from the prefix "
        "cache, by the reason of the request's first miss.", "reason")] = {}
    stored_blocks: int = 0
    evicted_blocks: int = 0
    flushed_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit / queried tokens of requests not preempted (0 before any query)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def preempted_hit_rate(self) -> float:
        """The same for recomputation after preemption."""
        return (self.preempted_hit_tokens / self.preempted_queried_tokens
                if self.preempted_queried_tokens else 0.0)


def empty_stats() -> PrefixCacheStats:
    """Zero counters, with every miss reason present (so metrics export every label)."""
    return PrefixCacheStats(missed_tokens={r.value: 0 for r in MissReason})


class FlushResult(msgspec.Struct, frozen=True, gc=False):
    freed: int
    refused_reason: str | None = None


class PrefixCache:
    """Hash <-> block maps for full computed blocks of one ``BlockPool``."""

    def __init__(self, pool: BlockPool, block_size: int, *,
                 events: KVEventPublisher | None = None, evicted_memory: int | None = None,
                 medium: str | None = MEDIUM_GPU) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._pool = pool
        self._block_size = block_size
        self.events = events if events is not None else KVEventPublisher()
        self._medium = medium
        n = pool.num_blocks
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: list[BlockHash | None] = [None] * n
        # Per cached block: its content hash and its sibling key (parent, first token), so
        # both indexes can be decremented when it is evicted.
        self._content_of: list[BlockHash | None] = [None] * n
        self._sibling_of: list[tuple[BlockHash | None, int] | None] = [None] * n
        self._content_count: Counter[BlockHash] = Counter()
        self._sibling_count: Counter[tuple[BlockHash | None, int]] = Counter()
        # Bounded memory of evicted hashes (LRU), only to explain misses.
        self._evicted_limit = 4 * n if evicted_memory is None else evicted_memory
        self._evicted: OrderedDict[BlockHash, None] = OrderedDict()
        self._stats = empty_stats()
        # KV tiers (actors/kv/tiers): told of each block cached (committed=True) and of each
        # block about to be evicted (False), with what identifies it below the device.
        self.tier_sink: Callable[[int, BlockMeta, bool], None] | None = None
        self._tail_of: list[tuple[tuple[int, ...], str | None] | None] = [None] * n
        # Blocks cached without events (announce=False): their removal is not announced.
        self._quiet: set[int] = set()

    # ------------------------------------------------------------------ queries

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def is_cached(self, block_id: int) -> bool:
        return self._hash_of[block_id] is not None

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash_of[block_id]

    def cached_hashes(self) -> set[BlockHash]:
        return set(self._block_of)

    def has_hash(self, block_hash: BlockHash) -> bool:
        return block_hash in self._block_of

    def block_of(self, block_hash: BlockHash) -> int | None:
        """The block cached under `block_hash`, or None."""
        return self._block_of.get(block_hash)

    def match(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest leading run of ``block_hashes`` that is cached.
        Read-only: the blocks must be ``touch``ed before anything else allocates."""
        out: list[int] = []
        for h in block_hashes:
            block_id = self._block_of.get(h)
            if block_id is None:
                break
            out.append(block_id)
        return out

    def stats(self) -> PrefixCacheStats:
        """A copy of the counters."""
        return msgspec.structs.replace(self._stats,
                                       missed_tokens=dict(self._stats.missed_tokens))

    def classify_miss(self, query: PrefixQuery, first_miss_block: int) -> MissReason:
        """Why block ``first_miss_block`` of ``query`` did not hit (see module docstring).
        Read-only; call it before the allocation that may evict what it looks at."""
        if query.preempted:
            return MissReason.RECOMPUTE_AFTER_PREEMPT
        k = first_miss_block
        hashes = query.block_hashes
        if k < len(hashes):
            h = hashes[k]
            if h in self._block_of:
                return MissReason.PARTIAL_BLOCK  # cached, but holds the last prompt token
            if h in self._evicted:
                return MissReason.EVICTED
            content = query.content_hashes[k] if query.content_hashes is not None else h
            if self._content_count[content] > 0:
                return MissReason.ISOLATION
        start = k * self._block_size
        if start < len(query.token_ids):
            parent = hashes[k - 1] if k > 0 else None
            if self._sibling_count[(parent, query.token_ids[start])] > 0:
                return MissReason.PARTIAL_BLOCK
        return MissReason.NO_PREFIX

    # ---------------------------------------------------------------- mutations

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on each (distinct) matched block: free ones are reclaimed from
        the LRU free list (O(1) each), used ones get ref + 1."""
        free = [b for b in block_ids if self._pool.is_free(b)]
        used = [b for b in block_ids if not self._pool.is_free(b)]
        self._pool.reclaim(free)
        self._pool.incr_ref(used)

    def allocate(self, n: int) -> list[int] | None:
        """``BlockPool.allocate`` that evicts the cached blocks it pops from the LRU head."""
        block_ids = self._pool.allocate(n)
        if block_ids is None:
            return None
        cached = [b for b in block_ids if self._hash_of[b] is not None]
        if cached and self.tier_sink is not None:
            for b in cached:
                if b not in self._quiet:
                    self.tier_sink(b, self._meta(b), False)
        announced = [b for b in cached if b not in self._quiet]
        evicted = [self._unmap(b) for b in cached]
        if evicted:
            self._stats.evicted_blocks += len(evicted)
            self._remember_evicted(evicted)
        if announced:
            removed = [h for b, h in zip(cached, evicted) if b in announced]
            self.events.publish(BlockRemoved(block_hashes=removed, medium=self._medium))
        return block_ids

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash],
                     parent_hash: BlockHash | None,
                     token_ids_per_block: Sequence[Sequence[int]],
                     content_hashes: Sequence[BlockHash] | None = None, *,
                     cache_salt: str | None = None, lora_name: str | None = None,
                     announce: bool = True) -> int:
        """Register consecutive full, computed blocks of one chain; return how many became
        cached. ``parent_hash`` is the hash of the block before ``block_ids[0]`` (``None``
        at the start of a sequence). A block already cached under the same hash is left as
        is; a hash already cached elsewhere keeps its block (this one stays uncached).
        Emits one ``BlockStored`` per run of consecutive newly cached blocks; a run that
        starts the sequence carries ``cache_salt`` in its first block's extra keys.
        ``announce=False``: no events for these blocks (a layer group other than the one
        routers score, kv_manager.py), and no tier copies."""
        if not (len(block_ids) == len(block_hashes) == len(token_ids_per_block)):
            raise ValueError("cache_blocks needs one hash and one token list per block")
        if content_hashes is not None and len(content_hashes) != len(block_hashes):
            raise ValueError("cache_blocks needs one content hash per block")
        parent = parent_hash
        run: list[BlockHash] = []
        run_tokens: list[int] = []
        run_parent: BlockHash | None = None
        stored = 0
        for i, (block_id, h) in enumerate(zip(block_ids, block_hashes)):
            tokens = token_ids_per_block[i]
            if len(tokens) != self._block_size:
                raise ValueError(f"block {block_id} has {len(tokens)} tokens, not "
                                 f"{self._block_size}: only full blocks are cached")
            if self._pool.ref_count(block_id) < 1:
                raise AssertionError(f"cache_blocks of free block {block_id}")
            existing = self._hash_of[block_id]
            if existing is not None and existing != h:
                raise AssertionError(f"block {block_id} is cached as {existing.hex()[:16]} "
                                     f"but committed as {h.hex()[:16]}")
            if existing is None and h not in self._block_of:
                content = content_hashes[i] if content_hashes is not None else h
                self._map(block_id, h, content, (parent, tokens[0]))
                stored += 1
                if not announce:
                    self._quiet.add(block_id)
                elif self.tier_sink is not None:
                    salt = cache_salt if parent is None else None
                    self._tail_of[block_id] = (tuple(tokens), salt)
                    self.tier_sink(block_id, self._meta(block_id), True)
                if not announce:
                    parent = h
                    continue
                if not run:
                    run_parent = parent
                run.append(h)
                run_tokens.extend(tokens)
            elif run:
                self._publish_stored(run, run_parent, run_tokens, cache_salt, lora_name)
                run, run_tokens = [], []
            parent = h
        if run and announce:
            self._publish_stored(run, run_parent, run_tokens, cache_salt, lora_name)
        self._stats.stored_blocks += stored
        return stored

    def flush(self, force: bool, num_running: int) -> FlushResult:
        """Drop every unreferenced cached block (blocks in use stay cached); return how many.
        Refused, with a reason and nothing changed, while requests run unless ``force``.
        Emits ``AllBlocksCleared`` when the cache ends empty, else ``BlockRemoved``."""
        if num_running > 0 and not force:
            return FlushResult(0, f"{num_running} request(s) running; drain first or force")
        dropped = [b for b in self._block_of.values() if self._pool.is_free(b)]
        quiet = [b in self._quiet for b in dropped]
        hashes = [self._unmap(b) for b in dropped]
        self._remember_evicted(hashes)
        self._stats.flushed_blocks += len(hashes)
        announced = [h for h, q in zip(hashes, quiet) if not q]
        if not self._block_of:
            self.events.publish(AllBlocksCleared())
        elif announced:
            self.events.publish(BlockRemoved(block_hashes=announced, medium=self._medium))
        return FlushResult(len(dropped))

    def record(self, num_query_tokens: int, num_hit_tokens: int, reason: MissReason | str) -> None:
        """Count one request's lookup (called once per admission, by the KV manager).
        ``reason`` may be a ``MissReason`` with a tier suffix (``evicted_restored_from_host``:
        the missed blocks came back from that tier instead of being recomputed)."""
        s = self._stats
        if reason == MissReason.RECOMPUTE_AFTER_PREEMPT:
            s.preempted_requests += 1
            s.preempted_queried_tokens += num_query_tokens
            s.preempted_hit_tokens += num_hit_tokens
        else:
            s.requests += 1
            s.queried_tokens += num_query_tokens
            s.hit_tokens += num_hit_tokens
        key = str(reason)
        s.missed_tokens[key] = s.missed_tokens.get(key, 0) + num_query_tokens - num_hit_tokens

    # --------------------------------------------------------------- invariants

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` on the first broken invariant: the hash -> block and
        block -> hash maps agree (so no block is mapped twice), both indexes count exactly
        the cached blocks, and the evicted memory is bounded and disjoint from the cache."""
        for h, block_id in self._block_of.items():
            if self._hash_of[block_id] != h:
                raise AssertionError(f"hash {h.hex()[:16]} maps to block {block_id}, whose "
                                     f"reverse entry is {self._hash_of[block_id]!r}")
        num_reverse = sum(h is not None for h in self._hash_of)
        if num_reverse != len(self._block_of):
            raise AssertionError(f"{num_reverse} blocks have a hash but {len(self._block_of)} "
                                 f"hashes are cached")
        cached_ids = list(self._block_of.values())
        content = Counter(self._content_of[b] for b in cached_ids)
        if +self._content_count != content:
            raise AssertionError("content-hash index disagrees with the cached blocks")
        siblings = Counter(self._sibling_of[b] for b in cached_ids)
        if +self._sibling_count != siblings:
            raise AssertionError("sibling index disagrees with the cached blocks")
        for b, h in enumerate(self._hash_of):
            if h is None and (self._content_of[b] is not None or self._sibling_of[b] is not None):
                raise AssertionError(f"uncached block {b} keeps index entries")
        if len(self._evicted) > self._evicted_limit:
            raise AssertionError(f"evicted memory holds {len(self._evicted)} > "
                                 f"{self._evicted_limit} hashes")
        both = [h for h in self._evicted if h in self._block_of]
        if both:
            raise AssertionError(f"{len(both)} hashes are both cached and remembered as evicted")

    # ------------------------------------------------------------------ helpers

    def _map(self, block_id: int, h: BlockHash, content: BlockHash,
             sibling: tuple[BlockHash | None, int]) -> None:
        self._block_of[h] = block_id
        self._hash_of[block_id] = h
        self._content_of[block_id] = content
        self._sibling_of[block_id] = sibling
        self._content_count[content] += 1
        self._sibling_count[sibling] += 1
        self._evicted.pop(h, None)

    def meta(self, block_id: int) -> BlockMeta:
        """A cached block's identity below the device (needs ``tier_sink`` set when it
        was cached)."""
        return self._meta(block_id)

    def _meta(self, block_id: int) -> BlockMeta:
        tail = self._tail_of[block_id]
        assert tail is not None, f"block {block_id} was cached without its tokens"
        return BlockMeta(self._hash_of[block_id], self._sibling_of[block_id][0], *tail)

    def _unmap(self, block_id: int) -> BlockHash:
        h = self._hash_of[block_id]
        assert h is not None, f"block {block_id} is not cached"
        del self._block_of[h]
        self._hash_of[block_id] = None
        for counts, key in ((self._content_count, self._content_of[block_id]),
                            (self._sibling_count, self._sibling_of[block_id])):
            counts[key] -= 1
            if counts[key] == 0:
                del counts[key]
        self._content_of[block_id] = None
        self._sibling_of[block_id] = None
        self._tail_of[block_id] = None
        self._quiet.discard(block_id)
        return h

    def _remember_evicted(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            self._evicted[h] = None
            self._evicted.move_to_end(h)
        while len(self._evicted) > self._evicted_limit:
            self._evicted.popitem(last=False)

    def _publish_stored(self, hashes: list[BlockHash], parent: BlockHash | None,
                        token_ids: list[int], cache_salt: str | None,
                        lora_name: str | None = None) -> None:
        # vLLM's extra keys: one entry per block, the salt only in a sequence's first block
        # (the chain carries it into every later hash).
        extra_keys: list[tuple[str, ...] | None] = [None] * len(hashes)
        if parent is None and cache_salt is not None:
            extra_keys[0] = (cache_salt,)
        self.events.publish(BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                        token_ids=token_ids, block_size=self._block_size,
                                        medium=self._medium, extra_keys=extra_keys,
                                        lora_name=lora_name))

    def __repr__(self) -> str:
        return f"PrefixCache(cached={len(self._block_of)}, evicted_memory={len(self._evicted)})"
