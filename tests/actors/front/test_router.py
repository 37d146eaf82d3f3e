"""The router: admission gate (pure) and the actor's forwarding, acknowledgements and refusals."""

from __future__ import annotations

import asyncio

from tokenloom.actors.front.router_actor import AdmissionGate, RouterActor
from tokenloom.actors.messages import (
    ERROR_OVERLOADED,
    AbortRequest,
    AddRequest,
    RequestFinished,
    Shutdown,
)
from tokenloom.actors.sampling_params import SamplingParams


def test_gate_bounds_requests_in_flight():
    gate = AdmissionGate(max_running=2, max_waiting=1)
    assert [gate.admit() for _ in range(4)] == [True, True, True, False]
    gate.done()
    assert gate.admit() is True
    assert gate.num_rejected == 1 and gate.in_flight == 3


def _add(rid: str) -> AddRequest:
    return AddRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                      sampling_params=SamplingParams(), arrival_time=0.0)


async def test_router_forwards_acknowledges_and_refuses():
    """1. two adds pass and are acknowledged with their prompt length; 2. a third is refused
    as overloaded; 3. aborts follow their request (an abort of a refused request reaches the
    scheduler, which ignores unknown ids); 4. a finish frees a slot."""
    emitted = []
    scheduler: asyncio.Queue = asyncio.Queue()
    router = RouterActor(max_running=1, max_waiting=1, emit=emitted.append,
                         next_inbox=scheduler)
    for msg in (_add("a"), _add("b"), _add("c"), AbortRequest(request_id="a"),
                AbortRequest(request_id="c"), RequestFinished(request_id="b"), _add("d"),
                Shutdown()):
        router.send(msg)
    await router.run()
    forwarded = [scheduler.get_nowait() for _ in range(scheduler.qsize())]
    assert [(type(m).__name__, m.request_id) for m in forwarded] == [
        ("AddRequest", "a"), ("AddRequest", "b"), ("AbortRequest", "a"), ("AbortRequest", "c"),
        ("AddRequest", "d")]
    acks = [o for o in emitted if not o.finished]
    assert [(o.request_id, o.num_prompt_tokens) for o in acks] == [("a", 3), ("b", 3), ("d", 3)]
    refused = {o.request_id: o.error_kind for o in emitted if o.finished}
    assert refused == {"c": ERROR_OVERLOADED}
