"""KV cache events inside tokenloom, and an in-process publisher. Pure: no asyncio, no torch.

The prefix cache emits one event per change to the set of cached block hashes, synchronously
and in order: ``BlockStored`` when full blocks become reusable, ``BlockRemoved`` when cached
blocks are evicted or flushed, ``AllBlocksCleared`` when a flush leaves the cache empty. A
subscriber that replays the events therefore knows exactly which hashes this worker holds
(the contract a KV-aware router needs). A stored run's parent is always cached (so already
announced, and not removed since) when the run is announced.

These events carry the full 32-byte chain digests (``block_hash.py``): in-process subscribers
(the worker router, ``LLM.subscribe_kv_events``) compare them with hashes they compute
themselves. Field names follow vLLM's (``vllm/distributed/kv_events.py``); what goes on the
ZMQ wire for external routers — vLLM's current encoding, 64-bit hashes — is
``events_wire.py``'s job.

Subscriber callbacks run inside KV-manager mutations: they must be quick and must not call
back into the manager. An exception in one is counted (``num_callback_errors``), logged and
swallowed, so that a faulty subscriber cannot break the atomicity of an allocation.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import structlog

log = structlog.get_logger("tokenloom.kv_events")

MEDIUM_GPU = "GPU"


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True,
                   frozen=True):
    """Base class of every KV cache event."""


class BlockStored(KVCacheEvent):
    """Consecutive blocks of one hash chain became cached. ``parent_block_hash`` is the hash
    of the block before ``block_hashes[0]`` (``None`` for the first block of a sequence);
    ``token_ids`` are the tokens of all listed blocks, concatenated. ``extra_keys`` has one
    entry per block: what besides the tokens went into its hash that an external indexer
    must fold into its own keys (vLLM's rule: the request's ``cache_salt`` in the first
    block of a sequence, ``None`` for a block with none). ``lora_name`` names the adapter
    (``None`` for the base model)."""
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[str, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None = MEDIUM_GPU


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


Subscriber = Callable[[KVEvent], None]


class KVEventPublisher:
    """Delivers each event to every subscriber, synchronously, in emission order."""

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []
        self.num_callback_errors = 0

    @property
    def has_subscribers(self) -> bool:
        return bool(self._subscribers)

    def subscribe(self, callback: Subscriber) -> None:
        self._subscribers.append(callback)

    def unsubscribe(self, callback: Subscriber) -> None:
        """Remove ``callback`` (idempotent: an unknown callback is ignored)."""
        if callback in self._subscribers:
            self._subscribers.remove(callback)

    def publish(self, event: KVEvent) -> None:
        for callback in list(self._subscribers):
            try:
                callback(event)
            except Exception:  # noqa: BLE001 - see module docstring
                self.num_callback_errors += 1
                log.exception("kv event subscriber failed", kv_event=type(event).__name__)


class EventCollector:
    """A subscriber that buffers events until drained into one ``EventBatch`` (e.g. once
    per engine step, as vLLM's publisher does)."""

    def __init__(self) -> None:
        self._events: list[KVEvent] = []

    def __call__(self, event: KVEvent) -> None:
        self._events.append(event)

    def drain(self, ts: float | None = None) -> EventBatch | None:
        """The buffered events as one batch (``None`` if there are none); empties the buffer."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return EventBatch(ts=time.time() if ts is None else ts, events=events)
