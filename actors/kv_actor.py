"""The KV manager actor: the only owner of KV blocks. A thin shell around KVCacheManager.

The scheduler sends one `KVUpdate` per iteration (frees, then grants, atomically) and gets
one `KVGrant` back: blocks for every grant, or a refusal with nothing allocated.
"""

from __future__ import annotations

from tokenloom.actors.base import Actor, Control, resolve
from tokenloom.actors.kv_manager import KVCacheManager
from tokenloom.actors.messages import KVGrant, KVUpdate, Shutdown


class KVManagerActor(Actor):
    name = "kv_manager"

    def __init__(self, manager: KVCacheManager):
        super().__init__()
        self.manager = manager
        self.scheduler_inbox = None  # wired by the engine

    def apply(self, update: KVUpdate) -> KVGrant:
        freed = sum(self.manager.free(rid) for rid in update.frees)
        new_blocks = self.manager.allocate(update.grants) if update.grants else {}
        return KVGrant(new_blocks=new_blocks, num_free_blocks=self.manager.num_free_blocks,
                       num_used_blocks=self.manager.num_used_blocks, freed=freed)

    async def run(self) -> None:
        while True:
            msg = await self.inbox.get()
            match msg:
                case KVUpdate():
                    self.scheduler_inbox.put_nowait(self.apply(msg))
                case Control(op="integrity", reply=reply):
                    try:
                        self.manager.check_integrity()
                        resolve(reply, None)
                    except AssertionError as e:
                        resolve(reply, str(e))
                case Control(op="stats", reply=reply):
                    m = self.manager
                    resolve(reply, {"num_blocks": m.num_blocks, "free": m.num_free_blocks,
                                    "used": m.num_used_blocks, "usage": m.usage,
                                    "block_size": m.block_size})
                case Shutdown():
                    return
