"""The messages between the front and a worker process, and their encoding.

Each direction is one tagged union of msgspec Structs carrying the engine's own message
structs (AddRequest, AbortRequest, RequestOutput, KV events...), msgpack-encoded, one ZMQ
message per envelope. Front -> worker i: a PUSH socket bound at `ipc://<dir>/in-<i>-<k>`
(a new path for every incarnation k, so nothing queued for a dead process reaches its
successor). Workers -> front: PUSH sockets connected to the front's one PULL at
`ipc://<dir>/out`; every envelope names its worker and incarnation, and the front drops
what a dead incarnation left in flight.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from tokenloom.actors.kv.events import KVEvent
from tokenloom.actors.kv.prefix_cache import FlushResult
from tokenloom.actors.messages import (
    AbortRequest,
    AddRequest,
    EngineStats,
    RequestOutput,
    RuntimeInfo,
)


class _Wire(msgspec.Struct, tag=True, kw_only=True, gc=False):
    pass


# -- front -> worker ---------------------------------------------------------------------
class Submit(_Wire):
    request: AddRequest


class Abort(_Wire):
    abort: AbortRequest


# -- control queries: each names the type of its answer ---------------------------------------
class _Query(msgspec.Struct, tag=True, kw_only=True, frozen=True):
    reply_type: ClassVar[type | None] = None


class StatsQuery(_Query):
    reply_type = EngineStats


class FlushQuery(_Query):
    reply_type = FlushResult
    force: bool = False


class TraceQuery(_Query):
    """-> the worker engine's trace (dict) or None"""
    request_id: str


class DrainQuery(_Query):
    """Refuse (draining) or take again new requests -> bool: it was draining before."""
    reply_type = bool
    draining: bool


class LoRAQuery(_Query):
    """Serve the adapter at `path` as `name` (None: stop serving it) -> bool: it was
    served before."""
    reply_type = bool
    name: str
    path: str | None = None


WorkerQuery = StatsQuery | FlushQuery | TraceQuery | DrainQuery | LoRAQuery


class Control(_Wire):
    """An admin/test query; answered by one Reply with the same id."""
    id: int
    query: WorkerQuery


class Stop(_Wire):
    """Finish what is in flight no further: shut the engine down and exit."""


ToWorker = Submit | Abort | Control | Stop


# -- worker -> front ---------------------------------------------------------------------
class _FromWorker(_Wire):
    worker: int
    incarnation: int


class Hello(_FromWorker):
    """The worker loaded its model, warmed up and serves. What the front needs to build
    its tokenizer, validate requests and hash blocks exactly as the workers do: the
    worker engine's own RuntimeInfo."""
    pid: int
    info: RuntimeInfo


class Failed(_FromWorker):
    """The worker could not start (the error, e.g. a config or model error)."""
    error: str
    bad_config: bool = False    # a ConfigError / ValueError: the daemon exits 2, as in-process


class Outputs(_FromWorker):
    outputs: list[RequestOutput]


class KVEvents(_FromWorker):
    events: list[KVEvent]


class Report(_FromWorker):
    """Sent periodically: the worker's KV pool and whether its engine is stalled."""
    free_blocks: int
    num_blocks: int
    kv_usage: float
    stalled_seconds: float
    draining: bool
    lora_adapters: list[str] | None = None   # in its device slots (None: [lora] off)


class Reply(_FromWorker):
    id: int
    payload: msgspec.Raw = msgspec.Raw(b"\xc0")   # msgpack of the answer (nil by default)
    error: str | None = None


FromWorker = Hello | Failed | Outputs | KVEvents | Report | Reply

encode = msgspec.msgpack.Encoder().encode
decode_to_worker = msgspec.msgpack.Decoder(ToWorker).decode
decode_from_worker = msgspec.msgpack.Decoder(FromWorker).decode
