"""KV cache manager: the only owner of block tables.

Pure module (no torch, no asyncio); the KV-manager actor is a thin shell around it.

Contract:
- Each request id owns one block table (a list of physical block ids, in token order).
  Tables only grow while a request runs; ``free`` releases a whole table.
- ``allocate(grants)`` is atomic across all grants: either every table grows to hold its
  requested token count, or nothing changes and it returns ``None``. It never raises for
  lack of room: ``None`` means "does not fit" and the scheduler preempts or waits.
- ``free`` is idempotent: freeing an unknown (or already freed) request releases nothing.
- Misuse (negative token counts, the same request twice in one ``allocate``, asking for the
  table of an unknown request) raises; those are scheduler bugs, not memory pressure.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec

from tokenloom.actors.block_pool import BlockPool


class KVSnapshot(msgspec.Struct, frozen=True, gc=False):
    """Block counts at one instant, sent to the scheduler and to metrics."""

    num_free_blocks: int
    num_used_blocks: int
    num_blocks: int
    block_size: int


class KVCacheManager:
    """Maps request ids to block tables over one ``BlockPool``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._pool = BlockPool(num_blocks)
        self._block_size = block_size
        self._tables: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ queries

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self._pool.num_used_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (vLLM's ``kv_cache_usage_perc``)."""
        return self._pool.num_used_blocks / self._pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self._pool.num_blocks * self._block_size

    def num_held(self, request_id: str) -> int:
        """Blocks currently held by ``request_id`` (0 if unknown)."""
        return len(self._tables.get(request_id, ()))

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table. ``KeyError`` if the request holds no table."""
        return list(self._tables[request_id])

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def num_blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        """Extra blocks ``request_id`` needs to hold ``num_total_tokens`` tokens (>= 0)."""
        if num_total_tokens < 0:
            raise ValueError(f"num_total_tokens must be >= 0, got {num_total_tokens}")
        blocks_for_tokens = -(-num_total_tokens // self._block_size)
        return max(0, blocks_for_tokens - self.num_held(request_id))

    def snapshot(self) -> KVSnapshot:
        return KVSnapshot(
            num_free_blocks=self._pool.num_free_blocks,
            num_used_blocks=self._pool.num_used_blocks,
            num_blocks=self._pool.num_blocks,
            block_size=self._block_size,
        )

    # ---------------------------------------------------------------- mutations

    def allocate(self, grants: Sequence[tuple[str, int]]) -> dict[str, list[int]] | None:
        """Grow every listed table to hold its token count, atomically.

        ``grants`` is a sequence of ``(request_id, num_total_tokens)`` with distinct ids.
        Returns ``{request_id: newly_added_block_ids}`` for every entry (``[]`` when the
        table is already large enough; tables never shrink), or ``None`` when the blocks
        needed by all entries together exceed the free blocks, in which case nothing is
        allocated. Never raises for lack of room. A request id seen here for the first
        time gets a table, even if it needs no blocks yet.
        """
        duplicates = [rid for rid, count in Counter(rid for rid, _ in grants).items() if count > 1]
        if duplicates:
            raise ValueError(f"allocate got request ids more than once: {duplicates}")
        needed = [self.num_blocks_needed(rid, num_tokens) for rid, num_tokens in grants]
        new_blocks = self._pool.allocate(sum(needed))
        if new_blocks is None:
            return None
        # Split one all-or-nothing pool allocation in grant order: deterministic, and no
        # partial state to roll back.
        result: dict[str, list[int]] = {}
        start = 0
        for (rid, _), count in zip(grants, needed):
            added = new_blocks[start : start + count]
            start += count
            self._tables.setdefault(rid, []).extend(added)
            result[rid] = added
        return result

    def free(self, request_id: str) -> int:
        """Release ``request_id``'s whole table; return the number of blocks released.

        Idempotent: an unknown or already freed request releases 0 blocks.
        """
        table = self._tables.pop(request_id, None)
        if table is None:
            return 0
        # Reversed so a request's tail blocks are reused first: its leading blocks are the
        # ones most likely to be a shared prefix once prefix caching keeps freed blocks.
        self._pool.free(reversed(table))
        return len(table)

    # --------------------------------------------------------------- invariants

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` describing the first broken invariant, if any.

        Pool invariants, plus: every block in a table is used; no block is in two tables
        (or twice in one); each table block's ref_cnt equals the number of tables holding
        it; the table lengths sum to the used blocks.
        """
        self._pool.check_integrity()
        owners: dict[int, str] = {}
        for rid, table in self._tables.items():
            for block_id in table:
                if self._pool.is_free(block_id):
                    raise AssertionError(f"request {rid!r} holds free block {block_id}")
                if block_id in owners:
                    # Relax once prefix sharing arrives: then shared blocks are expected.
                    raise AssertionError(
                        f"block {block_id} is held by both {owners[block_id]!r} and {rid!r}"
                    )
                owners[block_id] = rid
                if self._pool.ref_count(block_id) != 1:
                    raise AssertionError(
                        f"block {block_id} of request {rid!r} has ref_cnt "
                        f"{self._pool.ref_count(block_id)}, expected 1 (one table holds it)"
                    )
        total_held = sum(len(table) for table in self._tables.values())
        if total_held != self._pool.num_used_blocks:
            raise AssertionError(
                f"tables hold {total_held} blocks but the pool has "
                f"{self._pool.num_used_blocks} used"
            )

    def __repr__(self) -> str:
        return (
            f"KVCacheManager(num_blocks={self.num_blocks}, block_size={self._block_size}, "
            f"free={self.num_free_blocks}, requests={len(self._tables)})"
        )
