"""Disaggregated requests through the worker pool: `HandoffFlow` (docs/disaggregation.md).

The router decided that a request is prefilled on a prefill worker and decoded on a decode
worker. This module sends its prefill half (one greedy token, its KV exported to the
handoff tier), then its decode half once the tier holds the blocks; it re-homes a handoff
whose worker died, ends one whose client left, and feeds the disaggregation cost model
from what each half measured. The ledger of handoffs in flight and their leases is
`HandoffLedger` (handoff.py, pure); the pool owns the client-facing routes and hands this
module the prefill halves' outputs.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import msgspec
import structlog

from tokenloom.actors.front import disaggregation
from tokenloom.actors.front.routing import RouteDecision
from tokenloom.actors.messages import (
    AbortRequest,
    AddRequest,
    HandoffMeasured,
    RehomeRequest,
    RequestFinished,
    RequestOutput,
)
from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.daemon.workers import wire
from tokenloom.daemon.workers.handoff import HandoffLedger

log = structlog.get_logger("tokenloom.workers")

LEASE_CHECK_SECONDS = 0.25   # how often expired handoff leases and stray files are swept
# After a prefill half ends, its last blocks may still be on their way to the handoff tier
# (the prefill worker copies them out after the step and writes them on a thread): the
# decode half waits for them this long at most, then recomputes what is missing.
HANDOFF_WAIT_SECONDS = 2.0


class HandoffFlow:
    def __init__(self, ledger: HandoffLedger, slots: list, router, streams,
                 submit: Callable[[int, AddRequest], None],
                 spawn: Callable[[object, str], asyncio.Task], kv_bytes_per_token: int):
        """`slots`: the pool's worker slots; `router`: the WorkerRouterActor; `streams`: the
        front's stream registry; `submit(worker, request)`: the pool's way to run a client
        request on a worker; `spawn(coro, name)`: a task the pool keeps a reference to."""
        self.ledger = ledger
        self.slots = slots
        self.router = router
        self.streams = streams
        self.submit = submit
        self.spawn = spawn
        self.kv_bytes_per_token = kv_bytes_per_token
        self.halves: dict[str, int] = {}   # prefill half id -> the worker running it

    # -- the two halves ------------------------------------------------------------------
    def start(self, msg: AddRequest, decision: RouteDecision) -> None:
        """Prefill `msg` on decision.prefill_worker; its decode half goes to
        decision.worker when that ends."""
        p = decision.prefill_worker
        self.ledger.open(msg, p, decision.worker, self.router.hashes(msg))
        half = AddRequest(
            request_id=disaggregation.prefill_id(msg.request_id),
            prompt_token_ids=msg.prompt_token_ids,
            sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
            arrival_time=msg.arrival_time,
            meta=msgspec.structs.replace(msg.meta, kv_export=True, group_id=None, labels=None),
            tokenized_time=msg.tokenized_time, routed_time=msg.routed_time)
        slot = self.slots[p]
        if not slot.up or not slot.send(wire.Submit(request=half)):
            # Its prefill worker is gone: the decode worker prefills (the router's account
            # of the half is settled as if it ended).
            self.router.send(RequestFinished(request_id=half.request_id))
            self.decode_half(msg.request_id)
            return
        self.halves[half.request_id] = p

    def prefill_output(self, out: RequestOutput) -> None:
        """A prefill half's output: nothing of it reaches the client; when it ends, the
        decode half follows (or, if it failed, the decode worker prefills)."""
        if not out.finished:
            return
        pid = out.request_id
        rid = disaggregation.decode_id(pid)
        worker = self.halves.pop(pid, None)
        self.router.send(RequestFinished(request_id=pid))
        if worker is not None and not out.error:
            self.measure(worker, out)
        h = self.ledger.prefilled(rid)
        if h is None or h.state != "transferring":
            return                     # aborted meanwhile (or re-homed already)
        if out.error:
            log.warning("prefill half failed; the decode worker prefills", request_id=rid,
                        error=out.error)
            self.ledger.counts["prefill_failed"] += 1
            self.decode_half(rid)
            return
        self.spawn(self._after_prefill(rid), f"handoff-{rid}")

    async def _after_prefill(self, rid: str) -> None:
        """Send the decode half once the handoff tier holds every block (or after
        HANDOFF_WAIT_SECONDS: the decode worker recomputes what is missing)."""
        deadline = time.monotonic() + HANDOFF_WAIT_SECONDS
        while self.ledger.missing(rid) and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        h = self.ledger.get(rid)
        if h is not None and h.state == "transferring":
            self.decode_half(rid)

    def decode_half(self, rid: str) -> None:
        h = self.ledger.get(rid)
        self.ledger.decoding(rid)
        if self.slots[h.decode_worker].up:
            self.submit(h.decode_worker, h.request)
        else:                          # its decode worker died meanwhile: another one
            h.rehomed += 1
            self.ledger.counts["rehomed"] += 1
            self.router.send(RehomeRequest(request=h.request, exclude=h.decode_worker))

    # -- the client left, a worker died --------------------------------------------------
    def abortable(self, rid: str) -> bool:
        """Whether an abort of `rid` is this module's: a handoff not yet decoding."""
        return rid in self.ledger and self.ledger.get(rid).state != "decoding"

    def abort(self, rid: str) -> None:
        """The client left while its request was prefilling or on its way to decode."""
        h = self.ledger.close(rid, "aborted")
        pid = disaggregation.prefill_id(rid)
        if pid in self.halves and self.slots[h.prefill_worker].up:
            self.slots[h.prefill_worker].send(wire.Abort(abort=AbortRequest(request_id=pid)))
        self.streams.emit(RequestOutput(request_id=rid, new_token_ids=[], finished=True,
                                        finish_reason="abort"))
        self.router.send(RequestFinished(request_id=rid))

    def worker_died(self, dead: int) -> int:
        """The prefill halves `dead` was running: each handoff still prefilling goes to
        its decode worker, which prefills what the tier lacks. Returns how many halves."""
        lost = [pid for pid, w in self.halves.items() if w == dead]
        for pid in lost:
            del self.halves[pid]
            self.router.send(RequestFinished(request_id=pid))
            rid = disaggregation.decode_id(pid)
            h = self.ledger.get(rid)
            if h is not None and h.state == "prefilling":
                self.ledger.counts["prefill_lost"] += 1
                self.decode_half(rid)
        return len(lost)

    def rehome(self, rid: str, started: bool, dead: int) -> bool:
        """Worker `dead` died under client request `rid`: carry on elsewhere if nothing was
        streamed yet and its KV is (partly) in the handoff tier. True: re-homed."""
        h = self.ledger.get(rid)
        if h is None or started:
            return False
        h.rehomed += 1
        h.decode_worker = -1
        self.ledger.counts["rehomed"] += 1
        self.router.send(RehomeRequest(request=h.request, exclude=dead))
        return True

    # -- the cost model and the leases ---------------------------------------------------
    def measure(self, worker: int, out: RequestOutput) -> None:
        """Feed the disaggregation cost model from a finished request's timings."""
        t = out.timings
        if t is None or t.first_token is None or t.first_scheduled is None:
            return
        tokens = (out.num_prompt_tokens or 0) - t.num_cached_tokens
        peer = (t.cached_tokens_by_tier or {}).get("peer", 0)
        fetch_ms = ((t.trace or {}).get("kv_tiers") or {}).get("fetch_ms") or 0.0
        if peer and fetch_ms:
            self.ledger.observe_transfer(peer * self.kv_bytes_per_token, fetch_ms / 1e3)
        self.router.send(HandoffMeasured(
            worker=worker, prefill_tokens=max(0, tokens),
            prefill_seconds=t.first_token - t.first_scheduled,
            transfer_bytes=peer * self.kv_bytes_per_token if fetch_ms else 0,
            transfer_seconds=fetch_ms / 1e3,
            decode_tokens=max(0, len(t.token_times) - 1),
            decode_seconds=(t.token_times[-1] - t.token_times[0]
                            if len(t.token_times) > 1 else 0.0)))

    async def keep_leases(self) -> None:
        """Expire leases that were never claimed; delete files no lease covers."""
        while True:
            await asyncio.sleep(LEASE_CHECK_SECONDS)
            for rid in self.ledger.expired():
                h = self.ledger.get(rid)
                if h.state == "decoding" and 0 <= h.decode_worker < len(self.slots) \
                        and self.slots[h.decode_worker].up:
                    # Accepted by a live decode worker, still queued there: the claim is
                    # coming (or the worker dies and it is re-homed); deleting the blocks
                    # now would only make it recompute them.
                    self.ledger.renew(rid)
                    continue
                log.warning("handoff lease expired; its blocks are released", request_id=rid,
                            state=h.state)
                self.ledger.close(rid, "expired")
            self.ledger.sweep()
