"""The KV manager actor: the only owner of KV blocks. A thin shell around KVCacheManager.

The scheduler sends one `KVUpdate` per iteration (frees, then grants, atomically) and gets
one `KVGrant` back: blocks for every grant, or a refusal with nothing allocated.
"""

from __future__ import annotations

import msgspec

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
        m = self.manager
        # Commits first: a request finishing this step caches its last blocks, then frees.
        for c in update.commits:
            m.commit_full_blocks(c.request_id, c.num_computed_tokens, c.block_hashes,
                                 c.token_ids, c.content_hashes)
        freed = sum(m.free(rid) for rid in update.frees)
        new_blocks = m.allocate(update.grants) if update.grants else {}
        admitted = {}
        if new_blocks is not None:
            # Each admission may use its reserved blocks plus whatever nobody reserved:
            # reclaiming cached hit blocks that sit free costs free blocks too.
            bs = m.block_size
            slack = m.num_free_blocks - sum(-(-a.planned_tokens // bs) for a in update.admissions)
            for a in update.admissions:
                reserved = -(-a.planned_tokens // bs)
                before = m.num_free_blocks
                admitted[a.request_id] = m.admit(a.request_id, a.planned_tokens, a.query,
                                                 budget=reserved + max(0, slack))
                slack -= max(0, before - m.num_free_blocks - reserved)
        forked, copies = {}, []
        for parent, child, num_tokens in update.forks:
            made = m.fork(parent, child, num_tokens)
            if made is not None:  # None: no free block for the copy; the child waits
                forked[child] = m.block_table(child)
                copies.extend(made)
        return KVGrant(new_blocks=new_blocks, num_free_blocks=m.num_free_blocks,
                       num_used_blocks=m.num_used_blocks, freed=freed, admitted=admitted,
                       exclusive={rid: m.num_exclusive(rid) for rid in update.report},
                       forked=forked, copies=copies)

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
                                    "block_size": m.block_size,
                                    "cached_blocks": m.num_cached_blocks,
                                    "prefix_cache": msgspec.to_builtins(m.prefix_stats())})
                case Control(op="flush_cache", reply=reply, args=args):
                    # Running requests hold tables; refuse while any does, unless forced.
                    r = self.manager.flush(force=bool(args.get("force")),
                                           num_running=self.manager.num_requests)
                    resolve(reply, {"freed": r.freed, "refused_reason": r.refused_reason})
                case Control(op="subscribe_kv_events", reply=reply, args=args):
                    self.manager.events.subscribe(args["callback"])
                    resolve(reply, None)
                case Shutdown():
                    return
