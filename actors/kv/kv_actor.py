"""The KV manager actor: the only owner of KV blocks. A thin shell around KVCacheManager.

The scheduler sends one `KVUpdate` per iteration (frees, then grants, atomically) and gets
one `KVGrant` back: blocks for every grant, or a refusal with nothing allocated.
"""

from __future__ import annotations

import time

from tokenloom.actors.base import Actor, resolve
from tokenloom.actors.kv.events import EventCollector
from tokenloom.actors.kv.kv_manager import KVCacheManager
from tokenloom.actors.messages import (
    CheckIntegrity,
    FlushPrefixCache,
    GetKVStats,
    KVGrant,
    KVStats,
    KVUpdate,
    Shutdown,
    SubscribeKVEvents,
)
from tokenloom.arith import cdiv


class KVManagerActor(Actor):
    name = "kv_manager"

    def __init__(self, manager: KVCacheManager, publisher=None):
        super().__init__()
        self.manager = manager
        self.scheduler_inbox = None  # wired by the engine
        # KV events on the wire (actors/kv/events_zmq.py): each update's events, one batch.
        self.publisher = publisher
        self._collector = None
        if publisher is not None:
            self._collector = EventCollector()
            manager.events.subscribe(self._collector)
            publisher.publish_cleared(time.time())

    def _publish_events(self) -> None:
        if self._collector is not None:
            batch = self._collector.drain()
            if batch is not None:
                self.publisher.publish(batch)

    def apply(self, update: KVUpdate) -> KVGrant:
        m = self.manager
        # Commits first: a request finishing this step caches its last blocks, then frees.
        for c in update.commits:
            m.commit_full_blocks(c.request_id, c.num_computed_tokens, c.block_hashes,
                                 c.token_ids, c.content_hashes, cache_salt=c.cache_salt)
        swap_out = [pair for rid, slots in update.swap_outs
                    for pair in zip(m.block_table(rid), slots)]
        freed = sum(m.free(rid) for rid in update.frees)
        forked, copies = {}, []
        for parent, child, num_tokens in update.forks:
            made = m.fork(parent, child, num_tokens)
            if made is not None:  # None: no free block for the copy; the child waits
                forked[child] = m.block_table(child)
                copies.extend(made)
        new_blocks, failed = self._allocate(update.grants)
        admitted = {}
        swap_in = []
        if new_blocks is not None:
            # Each admission may use its reserved blocks plus whatever nobody reserved:
            # reclaiming cached hit blocks that sit free costs free blocks too.
            bs = m.block_size
            slack = m.num_free_blocks - sum(cdiv(a.planned_tokens, bs) for a in update.admissions)
            for a in update.admissions:
                reserved = cdiv(a.planned_tokens, bs)
                before = m.num_free_blocks
                admitted[a.request_id] = m.admit(a.request_id, a.planned_tokens, a.query,
                                                 budget=reserved + max(0, slack))
                slack -= max(0, before - m.num_free_blocks - reserved)
            swap_in = [pair for rid, slots in update.swap_ins
                       for pair in zip(slots, m.block_table(rid))]
        return KVGrant(new_blocks=new_blocks, num_free_blocks=m.num_free_blocks,
                       num_used_blocks=m.num_used_blocks, freed=freed, admitted=admitted,
                       held={rid: m.num_held(rid) for rid in update.report},
                       exclusive={rid: m.num_exclusive(rid) for rid in update.report},
                       tables={rid: m.block_table(rid) for rid in update.tables_for
                               if m.has_request(rid)},
                       forked=forked, copies=copies, swap_out=swap_out, swap_in=swap_in,
                       failed=failed)

    def _allocate(self, grants) -> tuple[dict[str, list[int]] | None, dict[str, str]]:
        """Every grant at once (atomic: all or nothing). If that raises (a fault, not a lack
        of room, which is a refusal), retry one grant at a time so that the failure ends
        only the requests it touches: those come back in `failed` with the error."""
        if not grants:
            return {}, {}
        try:
            return self.manager.allocate(grants), {}
        except Exception as e:  # noqa: BLE001
            self.log.error("KV allocation failed; retrying grant by grant", error=repr(e))
        new_blocks, failed = {}, {}
        for grant in grants:
            try:
                got = self.manager.allocate([grant])
            except Exception as e:  # noqa: BLE001
                failed[grant[0]] = f"KV block allocation failed: {e!r}"
                continue
            if got is None:  # cannot be, as all of them fitted together; refuse as usual
                return None, failed
            new_blocks.update(got)
        return new_blocks, failed

    def stats(self) -> KVStats:
        m = self.manager
        return KVStats(num_blocks=m.num_blocks, free=m.num_free_blocks, used=m.num_used_blocks,
                       usage=m.usage, block_size=m.block_size, cached_blocks=m.num_cached_blocks,
                       prefix_cache=m.prefix_stats())

    async def run(self) -> None:
        while True:
            msg = await self.inbox.get()
            match msg:
                case KVUpdate():
                    self.scheduler_inbox.put_nowait(self.apply(msg))
                    self._publish_events()
                case CheckIntegrity(reply=reply):
                    try:
                        self.manager.check_integrity()
                        resolve(reply, None)
                    except AssertionError as e:
                        resolve(reply, str(e))
                case GetKVStats(reply=reply):
                    resolve(reply, self.stats())
                case FlushPrefixCache(reply=reply, force=force):
                    # Running requests hold tables; refuse while any does, unless forced.
                    resolve(reply, self.manager.flush(force=force,
                                                      num_running=self.manager.num_requests))
                    self._publish_events()
                case SubscribeKVEvents(reply=reply, callback=callback):
                    self.manager.events.subscribe(callback)
                    resolve(reply, None)
                case Shutdown():
                    if self.publisher is not None:
                        self.publisher.shutdown()
                    return
