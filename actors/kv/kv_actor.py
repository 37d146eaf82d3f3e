"""The KV manager actor: the only owner of KV blocks. A thin shell around KVCacheManager.

The scheduler sends one `KVUpdate` per iteration (frees, forks, then grants, atomically)
and gets one `KVGrant` back on `replies`: blocks for every grant, or a refusal with nothing
allocated.

With KV tiers (actors/kv/tiers/manager.py) it also looks new requests up below the device
pool (`tier_queries`: the device hit is counted here, the tiers' runs and the restore
plan there), hands each admission its staged restore, and forwards the device blocks the
runner must copy down (`offloads`) and the tiers' KV events.
"""

from __future__ import annotations

import asyncio
import time

from tokenloom.actors.base import Actor, resolve
from tokenloom.actors.kv.events import EventCollector
from tokenloom.actors.kv.kv_manager import KVCacheManager, StagedBlocks
from tokenloom.actors.messages import (
    CheckIntegrity,
    FlushPrefixCache,
    GetKVStats,
    KVGrant,
    KVStats,
    KVUpdate,
    Shutdown,
    SubscribeKVEvents,
    TierReady,
)
from tokenloom.arith import cdiv


class KVManagerActor(Actor):
    name = "kv_manager"

    def __init__(self, manager: KVCacheManager, *, replies: asyncio.Queue,
                 scheduler_inbox: asyncio.Queue, publisher=None, tiers=None):
        """`replies`: where each update's KVGrant goes; `scheduler_inbox`: where a tier
        fetch's TierReady goes (it comes later, from a tier thread)."""
        super().__init__()
        self.manager = manager
        self.tiers = tiers   # actors/kv/tiers/manager.TierManager, or None
        if tiers is not None:
            manager.attach_tiers(tiers.wants)
        self.replies = replies
        self.scheduler_inbox = scheduler_inbox
        # KV events on the wire (actors/kv/events_zmq.py): each update's events, one batch.
        self.publisher = publisher
        self._collector = None
        if publisher is not None:
            self._collector = EventCollector()
            manager.events.subscribe(self._collector)
            publisher.publish_cleared(time.time())

    def _publish_events(self) -> None:
        if self.tiers is not None:
            for event in self.tiers.drain_events():
                self.manager.events.publish(event)
        if self._collector is not None:
            batch = self._collector.drain()
            if batch is not None:
                self.publisher.publish(batch)

    def apply(self, update: KVUpdate) -> KVGrant:
        m = self.manager
        held, ready = self._query_tiers(update) if self.tiers is not None else ([], [])
        plans: dict[str, dict] = {}
        # Commits first: a request finishing this step caches its last blocks, then frees.
        for c in update.commits:
            m.commit_full_blocks(c.request_id, c.num_computed_tokens, c.block_hashes,
                                 c.token_ids, c.content_hashes, cache_salt=c.cache_salt,
                                 lora_name=c.lora_name)
        swap_out = [pair for rid, slots in update.swap_outs
                    for pair in zip(m.swap_out_blocks(rid), slots)]
        freed = sum(m.free(rid) for rid in update.frees)
        forked, copies, unforkable = {}, [], []
        for parent, child, num_tokens in update.forks:
            if not m.can_fork(parent, num_tokens):
                unforkable.append(child)
                continue
            made = m.fork(parent, child, num_tokens)
            if made is not None:  # None: no free block for the copy; the child waits
                forked[child] = m.block_table(child)
                copies.extend(made)
        # Sliding groups let go of what is behind their windows before anything grows.
        freed += sum(m.drop_behind_windows(rid, n) for rid, n in update.computed.items())
        new_blocks, failed = self._allocate(update.grants, update.computed)
        admitted = {}
        swap_in = []
        if new_blocks is not None:
            # Each admission may use its reserved blocks plus whatever nobody reserved:
            # reclaiming cached hit blocks that sit free costs free blocks too.
            bs, groups = m.block_size, m.groups.num_groups
            slack = m.num_free_blocks - sum(groups * cdiv(a.planned_tokens, bs)
                                            for a in update.admissions)
            for a in update.admissions:
                reserved = groups * cdiv(a.planned_tokens, bs)
                before = m.num_free_blocks
                growth = admitted[a.request_id] = m.admit(
                    a.request_id, a.planned_tokens, a.query, budget=reserved + max(0, slack),
                    staged=self._staged(a, plans))
                if growth.restored_tiers:
                    self.tiers.restored(growth.restored_tiers)
                slack -= max(0, before - m.num_free_blocks - reserved)
            swap_in = [pair for rid, slots in update.swap_ins
                       for pair in m.swap_in_pairs(rid, slots)]
        return KVGrant(new_blocks=new_blocks, num_free_blocks=m.num_free_blocks,
                       num_used_blocks=m.num_used_blocks, freed=freed, admitted=admitted,
                       held={rid: m.num_held(rid) for rid in update.report},
                       exclusive={rid: m.num_exclusive(rid) for rid in update.report},
                       logical=({rid: m.table_length(rid) for rid in update.report}
                                if m.groups.hybrid else {}),
                       tables={rid: m.block_table(rid) for rid in update.tables_for
                               if m.has_request(rid)},
                       group_tables=({rid: m.block_tables(rid)[1:] for rid in update.tables_for
                                      if m.has_request(rid)}
                                     if m.groups.num_groups > 1 else {}),
                       forked=forked, copies=copies, unforkable=unforkable,
                       swap_out=swap_out, swap_in=swap_in,
                       failed=failed, tier_held=held, tier_ready=ready, tier_plans=plans,
                       offloads=m.take_offloads())

    def _query_tiers(self, update: KVUpdate) -> list[str]:
        """Drop the staging of requests that ended, look the new ones up: those whose
        fetch is under way are held (a TierReady follows for each)."""
        for rid in update.tier_cancels:
            self.tiers.cancel(rid)
        held, ready = [], []
        for q in update.tier_queries:
            query = q.query
            hit = self.manager.lookup(q.request_id, query).num_hit_blocks
            reusable = max(0, (len(query.token_ids) - 1) // self.manager.block_size)
            report = self.tiers.query(q.request_id, query.block_hashes[:reusable], hit,
                                      len(query.token_ids), q.recompute)
            if report is None:
                held.append(q.request_id)
            else:
                ready.append(report)
        return held, ready

    def _staged(self, admission, plans: dict) -> StagedBlocks | None:
        if self.tiers is None:
            return None
        query = admission.query
        hit = self.manager.lookup(admission.request_id, query).num_hit_blocks
        staged = self.tiers.take_staged(admission.request_id, hit, len(query.token_ids))
        if staged is None or not staged.records:
            return None
        if staged.plan is not None:
            plans[admission.request_id] = staged.plan.as_dict(self.manager.block_size)
        return StagedBlocks(start_block=staged.start_block,
                            payloads=[r.payload for r in staged.records], tiers=staged.tiers)

    def _allocate(self, grants, computed) -> tuple[dict[str, list[int]] | None,
                                                   dict[str, str]]:
        """Every grant at once (atomic: all or nothing). If that raises (a fault, not a lack
        of room, which is a refusal), retry one grant at a time so that the failure ends
        only the requests it touches: those come back in `failed` with the error."""
        if not grants:
            return {}, {}
        try:
            return self.manager.allocate(grants, computed), {}
        except Exception as e:  # noqa: BLE001
            self.log.error("KV allocation failed; retrying grant by grant", error=repr(e))
        new_blocks, failed = {}, {}
        for grant in grants:
            try:
                got = self.manager.allocate([grant], computed)
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
                       prefix_cache=m.prefix_stats(),
                       tiers=self.tiers.stats() if self.tiers is not None else None)

    async def run(self) -> None:
        if self.tiers is not None:
            loop = asyncio.get_running_loop()

            def notify(report) -> None:   # from a tier thread: hand it to the loop
                loop.call_soon_threadsafe(self.scheduler_inbox.put_nowait,
                                          TierReady(request_id=report.request_id,
                                                    report=report))
            self.tiers.notify = notify
            if self.tiers.announce_disk():   # a restart: what the disk tier still holds
                self._publish_events()
        while True:
            msg = await self.inbox.get()
            match msg:
                case KVUpdate():
                    self.replies.put_nowait(self.apply(msg))
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
                    if self.tiers is not None:
                        self.tiers.close()
                    return
