"""The host-memory swap space's slot bookkeeping. Pure: the bytes live in the runner's
`HostKVPool` (kernels/kv_store.py); the scheduler decides which slots hold what.

Swap preemption copies a victim's KV blocks to host slots (in block-table order) and frees
its device blocks; re-admission takes fresh device blocks and copies the slots back, so
the request resumes where it stopped instead of recomputing its tokens.
"""

from __future__ import annotations


class SwapSpace:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """`n` slots, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def release(self, slots: list[int]) -> None:
        taken = set(range(self.num_slots)) - set(self._free)
        bad = [s for s in slots if s not in taken]
        if bad:
            raise ValueError(f"swap slots released twice or never allocated: {bad}")
        self._free.extend(reversed(slots))
