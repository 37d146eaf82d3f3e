"""WorkerRouterActor (the front's router with worker processes), in process, no workers:
its block hashes are the scheduler's own (salt included), and its message handling."""

from __future__ import annotations

import asyncio

from tokenloom.actors.front.router_actor import WorkerRouterActor
from tokenloom.actors.front.routing import RoutingCore
from tokenloom.actors.kv.events import BlockRemoved, BlockStored
from tokenloom.actors.messages import (
    AbortRequest,
    AddRequest,
    GetRoutingStats,
    RequestFinished,
    RequestMeta,
    RequestStarted,
    Shutdown,
    WorkerDown,
    WorkerKVEvents,
    WorkerUp,
)
from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.actors.scheduling.prefix_tracker import PrefixTracker
from tokenloom.actors.scheduling.request import Request

FP, BS = "fingerprint-1", 4
PROMPT = list(range(10, 30))          # 5 full blocks


def add(rid, salt=None, prompt=PROMPT, **meta):
    return AddRequest(request_id=rid, prompt_token_ids=list(prompt),
                      sampling_params=SamplingParams(max_tokens=4), arrival_time=0.0,
                      meta=RequestMeta(cache_salt=salt, **meta))


def test_hashes_are_the_schedulers():
    router = WorkerRouterActor(RoutingCore(2), None, None, FP, BS, prefix_caching=True)
    for salt in (None, "tenant-a"):
        req = Request("r", PROMPT, SamplingParams(max_tokens=4),
                      meta=RequestMeta(cache_salt=salt))
        expected = PrefixTracker(FP, BS, True).query(req).block_hashes
        assert router.hashes(add("r", salt)) == expected and len(expected) == 5
    assert router.hashes(add("r", "a")) != router.hashes(add("r", "b"))
    off = WorkerRouterActor(RoutingCore(2), None, None, FP, BS, prefix_caching=False)
    assert off.hashes(add("r")) == []


def test_routes_by_events_follows_siblings_and_aborts():
    async def scenario():
        sent, emitted = [], []
        router = WorkerRouterActor(RoutingCore(2), lambda w, m, d: sent.append((w, m, d)),
                                   emitted.append, FP, BS, prefix_caching=True)
        task = asyncio.create_task(router.run())
        hashes = router.hashes(add("x"))
        for w in (0, 1):
            router.send(WorkerUp(worker=w))
        router.send(WorkerKVEvents(worker=1, events=[BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=PROMPT, block_size=BS)]))
        router.send(add("a"))
        router.send(add("a-1", group_id="a", prompt=[1, 2, 3, 4, 5]))  # sibling: same worker
        router.send(AbortRequest(request_id="a"))
        router.send(RequestStarted(request_id="a"))
        stats_q = GetRoutingStats(reply=asyncio.get_running_loop().create_future())
        router.send(stats_q)
        stats = await stats_q.reply
        assert [(w, type(m).__name__) for w, m, _ in sent] == [
            (1, "AddRequest"), (1, "AddRequest"), (1, "AbortRequest")]
        assert sent[0][2].reason == "prefix" and sent[0][2].expected_hit_blocks == 5
        assert sent[1][2].reason == "sibling"
        assert stats.in_flight == [0, 2] and stats.decoding == [0, 1]
        # Evicted blocks no longer attract; a dead worker takes nothing, and its requests
        # leave the account without a finish.
        router.send(WorkerKVEvents(worker=1, events=[BlockRemoved(block_hashes=hashes)]))
        router.send(WorkerDown(worker=1))
        router.send(RequestFinished(request_id="a"))     # ignored: already dropped
        router.send(add("b"))
        stats_q = GetRoutingStats(reply=asyncio.get_running_loop().create_future())
        router.send(stats_q)
        stats = await stats_q.reply
        assert sent[-1][0] == 0 and sent[-1][2].expected_hit_blocks == 0
        assert stats.up == [True, False] and stats.in_flight == [1, 0]
        router.send(WorkerDown(worker=0))
        router.send(add("c"))
        router.send(Shutdown())
        await task
        assert emitted[-1].finished and "no engine worker is up" in emitted[-1].error

    asyncio.run(scenario())


def test_cost_mode_places_short_prompts_on_decode_workers_first():
    """Placement follows the roles: a prompt too short to hand off decodes on a decode
    worker even when the prefill worker is idler, and on the prefill worker only when no
    decode worker is up."""
    from tokenloom.actors.front.disaggregation import Rates, Settings

    async def scenario():
        sent = []
        disagg = Settings(mode="cost", prefill_workers=[0], decode_workers=[1],
                          min_remote_tokens=64, kv_bytes_per_token=1000,
                          rates=Rates([1e-3, 1e-3], 1e9))
        router = WorkerRouterActor(RoutingCore(2), lambda w, m, d: sent.append((w, m, d)),
                                   lambda out: None, FP, BS, prefix_caching=True,
                                   disagg=disagg)
        task = asyncio.create_task(router.run())
        for w in (0, 1):
            router.send(WorkerUp(worker=w))
        for i in range(3):          # worker 1 gets busier with each, worker 0 stays idle
            router.send(add(f"s{i}", prompt=list(range(100 + 20 * i, 120 + 20 * i))))
        router.send(WorkerDown(worker=1))
        router.send(add("alone", prompt=list(range(500, 520))))
        stats_q = GetRoutingStats(reply=asyncio.get_running_loop().create_future())
        router.send(stats_q)
        stats = await stats_q.reply
        router.send(Shutdown())
        await task
        assert [w for w, _, _ in sent] == [1, 1, 1, 0]
        assert [d.handoff["reason"] for _, _, d in sent] == ["short_prompt"] * 3 + [
            "no_decode_worker"]
        assert stats.disaggregation["decisions"] == {"local:short_prompt": 3,
                                                     "local:no_decode_worker": 1}

    asyncio.run(scenario())
