"""The scheduler's view of the KV pool: the KV manager's last answer, plus the frees the
scheduler has queued and the blocks it has promised to forks since. Pure.

Not a mirror: nothing here is maintained by hand. Free, held and exclusive counts are read
from the last `KVGrant`, which the KV manager computed from its own tables after applying
everything the scheduler had sent; frees queued since are added by derivation (each
queued request frees what it held alone at that report), and blocks reserved for the next
update's forks are taken off. So the view cannot drift from the KV manager's state: the
policy always plans from a lower bound of what is free.
"""

from __future__ import annotations

from tokenloom.actors.messages import KVGrant


class KVView:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.grant = KVGrant(new_blocks={}, num_free_blocks=num_blocks, num_used_blocks=0,
                             freed=0)
        self._frees: dict[str, None] = {}   # queued frees, in order, once each
        self._reserved = 0                  # blocks promised to the next update's forks

    def update(self, grant: KVGrant) -> None:
        self.grant = grant
        self._reserved = 0

    def reserve(self, num_blocks: int) -> None:
        """Take `num_blocks` off the free count until the next update (which spends them)."""
        self._reserved += num_blocks

    def release(self, request_id: str) -> None:
        """Queue request_id's blocks to be freed by the next KV update."""
        self._frees[request_id] = None

    def take_frees(self) -> list[str]:
        frees, self._frees = list(self._frees), {}
        return frees

    @property
    def has_pending_frees(self) -> bool:
        return bool(self._frees)

    @property
    def num_free_blocks(self) -> int:
        """Free after the queued frees (the update applies frees before grants), less the
        blocks reserved for forks."""
        g = self.grant
        return (g.num_free_blocks + sum(g.exclusive.get(rid, 0) for rid in self._frees)
                - self._reserved)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def held(self, request_id: str) -> int:
        """Blocks in request_id's table at the last report (0 once queued to be freed)."""
        return 0 if request_id in self._frees else self.grant.held.get(request_id, 0)

    def table_blocks(self, request_id: str) -> int:
        """The length of request_id's tables in position blocks at the last report (with
        several layer groups; otherwise its held blocks)."""
        if request_id in self._frees:
            return 0
        g = self.grant
        return g.logical.get(request_id, g.held.get(request_id, 0))

    def freeable(self, request_id: str) -> int:
        """Blocks freeing request_id would return (fewer than held when prefix blocks
        are shared)."""
        return 0 if request_id in self._frees else self.grant.exclusive.get(request_id, 0)
