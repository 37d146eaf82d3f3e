"""The router actor: between the tokenizer and the scheduler.

It applies the admission gate, forwards (aborts keep their order behind their request),
and acknowledges each admitted request on its stream (an empty RequestOutput), so
that the front end knows the request passed validation before its first token exists.
The gate bounds memory under overload: at most `max_num_seqs` requests can run, and
at most `max_waiting` more may queue behind them; a request beyond that ends at once with an
"overloaded" error (HTTP 429 with Retry-After) instead of growing the queue without bound.

Everything in and out is a msgspec Struct, so the same seam routes across engine worker
processes: `WorkerRouterActor` (the front's router with `workers.count` > 1) picks a worker
for each request with the pure core in actors/front/routing.py and hands it to the worker pool's
transport; each worker's own engine still applies its admission gate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable

from tokenloom.actors.base import Actor, resolve
from tokenloom.actors.front import disaggregation
from tokenloom.actors.front.routing import RouteDecision, RoutingCore
from tokenloom.actors.kv.block_hash import Identities, hash_request_blocks
from tokenloom.actors.messages import (
    ERROR_INTERNAL,
    ERROR_OVERLOADED,
    AbortRequest,
    AddRequest,
    GetRouterStats,
    GetRoutingStats,
    HandoffMeasured,
    RehomeRequest,
    RequestFinished,
    RequestOutput,
    RequestStarted,
    RouterStats,
    RoutingStats,
    Shutdown,
    WorkerDown,
    WorkerKVEvents,
    WorkerReport,
    WorkerUp,
)
from tokenloom.arith import cdiv


class AdmissionGate:
    """Pure count of requests in flight (forwarded, not yet finished). A count, not a
    registry of ids: request ids are unique by the time they get here (the stream registry
    refuses a second stream with the same id), and the scheduler is the one registry of
    live requests on the engine side."""

    def __init__(self, max_running: int, max_waiting: int):
        self.capacity = max_running + max_waiting
        self.max_waiting = max_waiting
        self.in_flight = 0
        self.num_rejected = 0

    def admit(self) -> bool:
        """Count one more request in flight, or refuse it (False) when the queue is full."""
        if self.in_flight >= self.capacity:
            self.num_rejected += 1
            return False
        self.in_flight += 1
        return True

    def done(self) -> None:
        """A forwarded request has finished (its RequestFinished)."""
        assert self.in_flight > 0, "a request finished that the router never forwarded"
        self.in_flight -= 1


class RouterActor(Actor):
    name = "router"

    def __init__(self, max_running: int, max_waiting: int,
                 emit: Callable[[RequestOutput], None], next_inbox: asyncio.Queue):
        """`next_inbox`: the scheduler's."""
        super().__init__()
        self.gate = AdmissionGate(max_running, max_waiting)
        self.emit = emit
        self.next_inbox = next_inbox

    def _add(self, msg: AddRequest) -> None:
        if self.gate.admit():
            msg.routed_time = time.monotonic()
            self.next_inbox.put_nowait(msg)
            # The acknowledgement: an empty output telling the stream's owner that the request
            # is admitted (an HTTP handler can start its 200 stream) and how long its prompt is.
            self.emit(RequestOutput(request_id=msg.request_id, new_token_ids=[],
                                    num_prompt_tokens=len(msg.prompt_token_ids),
                                    max_tokens=msg.sampling_params.max_tokens))
            return
        error = (f"the server is overloaded: {self.gate.max_waiting} requests are already "
                 f"waiting; retry later")
        self.log.warning("request refused", request_id=msg.request_id, reason="overloaded")
        self.emit(RequestOutput(request_id=msg.request_id, new_token_ids=[], finished=True,
                                finish_reason="error", error=error, error_kind=ERROR_OVERLOADED))

    async def run(self) -> None:
        while True:
            msg = await self.inbox.get()
            match msg:
                case AddRequest():
                    self._add(msg)
                case RequestFinished():
                    self.gate.done()
                case GetRouterStats(reply=reply):
                    resolve(reply, RouterStats(in_flight=self.gate.in_flight,
                                               capacity=self.gate.capacity,
                                               num_rejected=self.gate.num_rejected))
                case Shutdown():
                    return
                case _:
                    self.next_inbox.put_nowait(msg)


class _Routed:
    __slots__ = ("worker", "charged", "started")

    def __init__(self, worker: int, charged: int):
        self.worker, self.charged, self.started = worker, charged, False


class WorkerRouterActor(Actor):
    """The front's router when requests run in worker processes.

    In: AddRequest / AbortRequest from the front's tokenizer (in order), RequestStarted and
    RequestFinished from the pool's output path, WorkerUp / WorkerDown / WorkerReport /
    WorkerKVEvents from the pool. Out: `send(worker, msg, decision)` — the pool's transport.

    Block hashes are computed exactly as the workers' PrefixTracker does (the workers'
    model fingerprint and block size, the request's cache_salt), so they match the hashes in
    the workers' KV events. Siblings of an n > 1 request go where their first sibling went
    (they reuse its prompt blocks inside that engine); an abort goes to the request's worker.
    """

    name = "router"
    MAX_AFFINITY_KEYS = 4096

    def __init__(self, core: RoutingCore, send: Callable[[int, object, RouteDecision | None],
                                                          None],
                 emit: Callable[[RequestOutput], None], fingerprint: str, block_size: int,
                 prefix_caching: bool, clock: Callable[[], float] = time.monotonic,
                 disagg: disaggregation.Settings | None = None,
                 variant: Callable[[int], str | None] | None = None):
        """`variant`: as PrefixTracker's (the workers hash with it)."""
        super().__init__()
        self.core = core
        self.disagg = disagg
        self.send_to = send
        self.emit = emit
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.fingerprint = fingerprint
        self.clock = clock
        self._identities = Identities(fingerprint)
        self._variant = variant
        self._requests: dict[str, _Routed] = {}
        self._affinity: dict[str, int] = {}     # affinity key -> worker it last went to
        self.num_rejected = 0

    def hashes(self, msg: AddRequest) -> list[bytes]:
        if not self.prefix_caching:
            return []
        # The workers' identity (salt and LoRA adapter): an adapter's prompts score only
        # against blocks computed with that adapter, which routes them to a worker holding it.
        n = len(msg.prompt_token_ids)
        variant = self._variant(n) if self._variant is not None else None
        ident, _ = self._identities.encoded(msg.meta.cache_salt, msg.meta.lora, variant)
        return hash_request_blocks(msg.prompt_token_ids, self.block_size, ident)

    def _add(self, msg: AddRequest, exclude: int | None = None) -> None:
        """Route a request (`exclude`: a re-homed one, never to that worker and never
        handed off again: its KV is in the handoff tier already)."""
        now = self.clock()
        hashes = self.hashes(msg)
        need = cdiv(len(msg.prompt_token_ids) + msg.sampling_params.max_tokens,
                    self.block_size)
        meta = msg.meta
        leader = self._requests.get(meta.group_id) if meta.group_id else None
        key = meta.affinity or meta.tenant
        among = None
        if self.disagg is not None:
            # Whole requests: on any worker (a prefill worker too, when that is cheapest),
            # except with "always", where prefill workers only prefill, and prompts too
            # short to hand off, which go to the decode workers while one is up (see
            # actors/front/disaggregation.py: placement follows the roles).
            d = self.disagg
            short = len(msg.prompt_token_ids) < d.min_remote_tokens
            decoders = [w for w in d.decode_workers if w != exclude]
            if d.mode == "always" or (d.mode == "cost" and short and any(
                    self.core.loads[w].up for w in decoders)):
                among = decoders
            else:
                among = [w for w in range(self.core.num_workers) if w != exclude]
        if leader is not None and self.core.loads[leader.worker].up:
            w = leader.worker
            decision = RouteDecision(w, self.core.policy, "sibling", len(hashes),
                                     self.core.indexes[w].overlap(hashes, now))
        else:
            decision = self.core.choose(hashes, need, now, self._affinity.get(key)
                                        if key is not None else None, adapter=meta.lora,
                                        among=among)
        if decision is None:
            self.num_rejected += 1
            what = "decode worker" if self.disagg is not None else "engine worker"
            self.emit(RequestOutput(request_id=msg.request_id, new_token_ids=[], finished=True,
                                    finish_reason="abort", error_kind=ERROR_INTERNAL,
                                    error=f"no {what} is up (restarting); retry later"))
            return
        if self.disagg is not None and exclude is None and decision.reason != "sibling":
            decision = self._disaggregate(msg, hashes, need, now, decision)
        self._requests[msg.request_id] = _Routed(decision.worker,
                                                 self.core.routed(decision, hashes, now,
                                                                  meta.lora))
        if key is not None:
            self._affinity.pop(key, None)
            self._affinity[key] = decision.worker
            if len(self._affinity) > self.MAX_AFFINITY_KEYS:
                self._affinity.pop(next(iter(self._affinity)))
        msg.routed_time = now
        self.send_to(decision.worker, msg, decision)

    def _disaggregate(self, msg: AddRequest, hashes: list[bytes], need: int, now: float,
                      decision: RouteDecision) -> RouteDecision:
        """Local (the whole request on `decision.worker`, the best worker for it) or remote
        (prefill on the best prefill worker, decode on the best decode worker). A remote
        one is charged to its prefill worker under the prefill half's id, and the decode
        worker is charged only the tail it recomputes."""
        d = self.disagg
        bs = self.block_size
        n = len(msg.prompt_token_ids)
        core = self.core
        lora = msg.meta.lora
        dd = decision if decision.worker in d.decode_workers else core.choose(
            hashes, need, now, adapter=lora, among=d.decode_workers)
        pd = core.choose(hashes, need, now, adapter=lora, among=d.prefill_workers)
        sp = msg.sampling_params
        eligible = (sp.prompt_logprobs is None and msg.meta.group_id is None
                    and self.prefix_caching)

        def side(r: RouteDecision | None) -> disaggregation.Side | None:
            if r is None:
                return None
            load = core.loads[r.worker]
            return disaggregation.Side(r.worker, n - r.expected_hit_blocks * bs,
                                       load.queued_prefill_blocks * bs, load.decoding)

        local = side(decision)
        if eligible and local.uncached_tokens >= d.min_remote_tokens:
            d.rates.observe_arrival(local.uncached_tokens, now)   # part of the forecast
        duty = d.prefill_duty(now) if decision.worker in d.prefill_workers else 0.0
        choice = disaggregation.choose(d.mode, n, bs, d.kv_bytes_per_token, side(dd), side(pd),
                                       d.rates, d.min_remote_tokens, eligible,
                                       local=local, decode_tokens=sp.max_tokens,
                                       local_duty=duty)
        d.count(choice)
        if not choice.remote:
            return dataclasses.replace(decision, handoff=choice.as_dict())
        pid = disaggregation.prefill_id(msg.request_id)
        self._requests[pid] = _Routed(pd.worker, core.routed(pd, hashes, now, lora))
        return dataclasses.replace(dd, expected_hit_blocks=len(hashes),
                                   prefill_worker=pd.worker, handoff=choice.as_dict())

    def _worker_down(self, w: int) -> None:
        self.core.worker_down(w)
        for rid in [rid for rid, r in self._requests.items() if r.worker == w]:
            del self._requests[rid]   # the pool ended them; their finish is not counted

    def stats(self) -> RoutingStats:
        c = self.core
        return RoutingStats(policy=c.policy, up=[w.up for w in c.loads],
                            in_flight=[w.in_flight for w in c.loads],
                            queued_prefill_blocks=[w.queued_prefill_blocks for w in c.loads],
                            decoding=[w.decoding for w in c.loads],
                            kv_usage=[w.kv_usage for w in c.loads],
                            routed=list(c.num_routed), prompt_blocks=list(c.prompt_blocks),
                            expected_hit_blocks=list(c.expected_hit_blocks),
                            num_rejected=self.num_rejected,
                            roles=self.disagg.roles(c.num_workers) if self.disagg else None,
                            disaggregation=(self.disagg.stats(self.clock()) if self.disagg
                                            else None))

    async def run(self) -> None:
        while True:
            msg = await self.inbox.get()
            match msg:
                case AddRequest():
                    self._add(msg)
                case AbortRequest(request_id=rid):
                    r = self._requests.get(rid)
                    if r is not None:
                        self.send_to(r.worker, msg, None)
                case RehomeRequest(request=add, exclude=w):
                    self._add(add, exclude=w)
                case HandoffMeasured() if self.disagg is not None:
                    rates = self.disagg.rates
                    rates.observe_prefill(msg.worker, msg.prefill_tokens, msg.prefill_seconds)
                    rates.observe_transfer(msg.transfer_bytes, msg.transfer_seconds)
                    rates.observe_decode(msg.decode_tokens, msg.decode_seconds)
                case RequestStarted(request_id=rid):
                    r = self._requests.get(rid)
                    if r is not None and not r.started:
                        r.started = True
                        self.core.first_token(r.worker, r.charged)
                case RequestFinished(request_id=rid):
                    r = self._requests.pop(rid, None)
                    if r is not None:
                        self.core.finished(r.worker, r.charged, r.started)
                case WorkerKVEvents(worker=w, events=events):
                    index = self.core.indexes[w]
                    for event in events:
                        index.apply(event)
                case WorkerReport(worker=w, free_blocks=free, kv_usage=usage,
                                  lora_adapters=adapters):
                    self.core.reported(w, free, usage, adapters)
                    self.core.indexes[w].expire(self.clock())
                case WorkerUp(worker=w):
                    self.core.worker_up(w)
                case WorkerDown(worker=w):
                    self._worker_down(w)
                case GetRoutingStats(reply=reply):
                    resolve(reply, self.stats())
                case GetRouterStats(reply=reply):
                    resolve(reply, RouterStats(in_flight=len(self._requests), capacity=0,
                                               num_rejected=self.num_rejected))
                case Shutdown():
                    return
