"""Physical KV block pool: reference-counted block ids with an LRU free list.

Pure module (no torch, no asyncio). The pool knows nothing about requests or tokens; the
KV manager (`kv_manager.py`) is its only caller and the only owner of block tables.

Contract:
- Block ids are the integers ``0 .. num_blocks - 1``.
- ``allocate(n)`` is all-or-nothing and returns ``None`` when fewer than ``n`` blocks are
  free; it never raises for lack of room.
- A block is *used* while its ``ref_cnt >= 1`` and *free* while ``ref_cnt == 0``.
- Freed blocks are appended at the tail of the free list and allocation pops from the head,
  so the least recently freed block is reused first and allocation order is deterministic.
- Misuse (double free, sharing a free block, unknown ids) is a bug in the caller and raises
  ``AssertionError`` with a message, leaving the pool unchanged.

The free list is an ``OrderedDict`` used as an O(1) ordered set: pop from the head, append
at the tail, and delete from the middle. Prefix caching needs the last one: a free block
that still holds cached KV can be taken back out of the LRU queue on a cache hit
(see ``reclaim``) without scanning the queue.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable


class BlockPool:
    """Owns physical KV block ids ``0..num_blocks-1`` and their reference counts."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockPool needs at least one block, got num_blocks={num_blocks}")
        self._num_blocks = num_blocks
        self._ref_cnt = [0] * num_blocks
        # Keys are free block ids in LRU order (head = next to allocate); values unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Maintained incrementally (not derived) so check_integrity can cross-check it.
        self._num_used = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    def can_allocate(self, n: int) -> bool:
        """True iff ``allocate(n)`` would succeed now."""
        _check_count(n)
        return n <= len(self._free)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_cnt[block_id]

    def is_free(self, block_id: int) -> bool:
        self._check_id(block_id)
        return block_id in self._free

    # ---------------------------------------------------------------- mutations

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks from the head of the free list, each with ``ref_cnt == 1``.

        All-or-nothing: returns ``None`` (and changes nothing) when fewer than ``n`` blocks
        are free. Never raises for lack of room. ``allocate(0)`` returns ``[]``.
        """
        _check_count(n)
        if n > len(self._free):
            return None
        block_ids = [self._free.popitem(last=False)[0] for _ in range(n)]
        for block_id in block_ids:
            self._ref_cnt[block_id] = 1
        self._num_used += n
        return block_ids

    def free(self, block_ids: Iterable[int], *, front: bool = False) -> None:
        """Drop one reference per listed id; blocks reaching 0 go to the free-list tail.

        Blocks are appended in the order given, so a caller that wants some blocks reused
        last should list them first. With ``front=True`` the blocks reaching 0 go to the
        *head* instead (still first listed, first reused): for blocks whose contents are
        worthless (no cached hash), so that they are reused before any cached block is
        evicted. An id may appear several times (one reference each). Dropping more
        references than a block holds is a double free: ``AssertionError``, and nothing is
        freed.
        """
        block_ids = list(block_ids)
        for block_id, count in Counter(block_ids).items():
            self._check_id(block_id)
            if self._ref_cnt[block_id] < count:
                raise AssertionError(
                    f"double free of block {block_id}: freeing {count} reference(s) but "
                    f"ref_cnt is {self._ref_cnt[block_id]}"
                )
        released: list[int] = []
        for block_id in block_ids:
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                released.append(block_id)
                self._num_used -= 1
        for block_id in reversed(released) if front else released:
            self._free[block_id] = None
            if front:
                self._free.move_to_end(block_id, last=False)

    def incr_ref(self, block_ids: Iterable[int]) -> None:
        """Add one reference per listed id (sharing). Every block must be in use.

        A free block cannot be shared this way: its contents may be overwritten by the
        next allocation. Taking a specific free block back is ``reclaim``'s job.
        """
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_cnt[block_id] == 0:
                raise AssertionError(f"incr_ref of free block {block_id}; use reclaim()")
        for block_id in block_ids:
            self._ref_cnt[block_id] += 1

    def reclaim(self, block_ids: Iterable[int]) -> None:
        """Take specific free blocks out of the free list (O(1) each), with ``ref_cnt == 1``.

        This is the hook for prefix caching: a cached block that was freed still holds
        valid KV until it reaches the head of the LRU queue and is reallocated. Every id
        must be free and listed once; otherwise ``AssertionError`` and nothing changes.
        """
        block_ids = list(block_ids)
        if len(set(block_ids)) != len(block_ids):
            raise AssertionError(f"reclaim got duplicate block ids: {block_ids}")
        for block_id in block_ids:
            self._check_id(block_id)
            if block_id not in self._free:
                raise AssertionError(
                    f"reclaim of block {block_id}, which is in use "
                    f"(ref_cnt {self._ref_cnt[block_id]})"
                )
        for block_id in block_ids:
            del self._free[block_id]
            self._ref_cnt[block_id] = 1
        self._num_used += len(block_ids)

    # --------------------------------------------------------------- invariants

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` describing the first broken invariant, if any.

        Invariants: free + used == total; the free list has no duplicates and only valid
        ids; every free block has ``ref_cnt == 0``; every block not in the free list is
        used with ``ref_cnt >= 1``; so no block is both free and used.
        """
        free_ids = list(self._free)
        if len(set(free_ids)) != len(free_ids):
            raise AssertionError(f"free list has duplicate block ids: {free_ids}")
        bad_ids = [b for b in free_ids if not (isinstance(b, int) and 0 <= b < self._num_blocks)]
        if bad_ids:
            raise AssertionError(f"free list holds invalid block ids {bad_ids}")
        if len(free_ids) + self._num_used != self._num_blocks:
            raise AssertionError(
                f"free ({len(free_ids)}) + used ({self._num_used}) != total ({self._num_blocks})"
            )
        if len(self._ref_cnt) != self._num_blocks:
            raise AssertionError(
                f"ref_cnt table has {len(self._ref_cnt)} entries for {self._num_blocks} blocks"
            )
        used_count = 0
        for block_id, ref_cnt in enumerate(self._ref_cnt):
            in_free = block_id in self._free
            if in_free and ref_cnt != 0:
                raise AssertionError(
                    f"block {block_id} is both free and used: in the free list with "
                    f"ref_cnt {ref_cnt}"
                )
            if not in_free:
                if ref_cnt < 1:
                    raise AssertionError(
                        f"block {block_id} is neither free nor used: not in the free list "
                        f"but ref_cnt {ref_cnt}"
                    )
                used_count += 1
        if used_count != self._num_used:
            raise AssertionError(
                f"used-block counter says {self._num_used} but {used_count} blocks have "
                f"ref_cnt >= 1"
            )

    # ------------------------------------------------------------------ helpers

    def _check_id(self, block_id: int) -> None:
        if not (isinstance(block_id, int) and 0 <= block_id < self._num_blocks):
            raise AssertionError(
                f"invalid block id {block_id!r} (pool has blocks 0..{self._num_blocks - 1})"
            )

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self._num_blocks}, free={len(self._free)}, "
            f"used={self._num_used})"
        )


def _check_count(n: int) -> None:
    if n < 0:
        raise ValueError(f"block count must be >= 0, got {n}")
