"""The one interface the daemon and the offline API drive an engine through: `EngineClient`.

Two implementations: the in-process `Engine` (actors/engine.py) and the `WorkerPool` of
engine worker processes (daemon/workers/pool.py). Both share `EngineFront`, the front half
of a client written once: request ids, the stream registry, and submit / generate / abort
through the front's tokenizer actor (an abort travels the same inbox as its request, so it
can never overtake it). Nothing above this interface asks which one it has.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, AsyncIterator, Protocol

from tokenloom.actors.front.streams import StreamRegistry
from tokenloom.actors.kv.prefix_cache import FlushResult
from tokenloom.actors.messages import (
    AbortRequest,
    EngineStats,
    GenerateRequest,
    RequestOutput,
    RuntimeInfo,
    WorkerStats,
    WorkerStatus,
)
from tokenloom.config.schema import EngineConfig


class EngineClient(Protocol):
    config: EngineConfig
    info: RuntimeInfo
    tokenizer: Any                  # the HF tokenizer (chat templates, /tokenize)
    streams: StreamRegistry

    def new_request_id(self) -> str: ...

    def submit(self, request: GenerateRequest,
               queue: asyncio.Queue[RequestOutput] | None = None
               ) -> asyncio.Queue[RequestOutput]: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    async def trace(self, request_id: str) -> dict | None: ...

    async def stats(self) -> EngineStats: ...

    async def flush_prefix_cache(self, force: bool = False) -> FlushResult: ...

    def stalled_seconds(self) -> float: ...

    def worker_status(self) -> list[WorkerStatus]:
        """One entry per engine worker process; empty for the in-process engine."""
        ...

    def degraded_tiers(self) -> dict[str, str]:
        """KV tiers failing now (tier -> reason); in-process only (workers: {})."""
        ...

    async def worker_stats(self) -> WorkerStats | None:
        """Per worker process: status, the router's account, its own stats; None
        in-process."""
        ...

    async def set_draining(self, draining: bool) -> None:
        """Stop (or resume) taking requests below the front (worker processes)."""
        ...

    # LoRA adapters a request may name (name -> directory); None when [lora] is off.
    lora_adapters: dict[str, str] | None

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Check and start serving an adapter (kernels/lora/peft_adapter.LoRAAdapterError
        naming it when it cannot be served), on every worker."""
        ...

    async def unload_lora_adapter(self, name: str) -> bool:
        """Stop serving an adapter; whether it was loaded."""
        ...

    async def run(self) -> None: ...

    def shutdown(self) -> None: ...


class EngineFront:
    """The shared front half. A subclass sets `tokenizer_actor` (the front's first actor)
    before the first submit."""

    def __init__(self) -> None:
        self.streams = StreamRegistry()
        self.streams.on_delivery_failure = self.abort   # a broken stream ends its request
        self.tokenizer_actor = None
        self._ids = itertools.count()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.info.eos_token_ids

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def submit(self, request: GenerateRequest,
               queue: asyncio.Queue[RequestOutput] | None = None) -> asyncio.Queue[RequestOutput]:
        """Submit; outputs go to the returned queue (`queue` if given: it may be shared by
        several requests). The stream closes itself on the finished output; a caller that
        stops listening before that must `abort(request_id)` and `streams.close(request_id)`."""
        queue = self.streams.open(request.request_id, asyncio.Queue() if queue is None else queue)
        if not request.arrival_time:
            request.arrival_time = time.monotonic()
        self.tokenizer_actor.send(request)
        return queue

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Submit and stream outputs; leaving the iterator early aborts the request."""
        queue = self.submit(request)
        finished = False
        try:
            while True:
                out = await queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request.request_id)
            self.streams.close(request.request_id)

    def abort(self, request_id: str) -> None:
        # Through the tokenizer and router, so an abort can never overtake its own request.
        self.tokenizer_actor.send(AbortRequest(request_id=request_id))


def merge_traces(request_id: str, traces: list[dict]) -> dict | None:
    """The trace served for the id a client saw: one engine request's trace, or
    {"request_id", "choices": [...]} (in choice order) when the id stands for several (n > 1
    or several prompts); None when none is in the bounded history."""
    if not traces:
        return None
    if len(traces) == 1 and traces[0]["request_id"] == request_id:
        return traces[0]
    return {"request_id": request_id,
            "choices": sorted(traces, key=lambda t: _choice_index(t["request_id"]))}


def _choice_index(engine_request_id: str) -> int:
    """Choice i of a request runs as "<id>-<i>" (front/fan_out.py choice_request_id)."""
    tail = engine_request_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0
