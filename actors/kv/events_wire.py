"""KV cache events as external KV-aware routers read them: vLLM's wire encoding. Pure.

One ``EventBatch`` (``events.py``) becomes one msgpack payload:

    [ts, [event, ...], data_parallel_rank]

The batch is always positional with an integer rank (0 without data parallelism): Dynamo
decodes it as a ``(f64, Vec<event>, Option<i32>)`` tuple and llm-d as an ``array`` struct,
and vLLM's publisher always fills the rank in. Each event is, with ``encoding = "map"``
(vLLM's current form, the default), a map tagged under ``"type"``:

    {"type": "BlockStored", "block_hashes": [u64, ...], "parent_block_hash": u64 | None,
     "token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU",
     "lora_name": None, "extra_keys": [["salt"] | None, ...]}
    {"type": "BlockRemoved", "block_hashes": [u64, ...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

or, with ``encoding = "array"`` (vLLM's earlier ``array_like`` form, for consumers that
predate the maps), the same fields positionally after the tag: ``["BlockStored", hashes,
parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys]``. Field names and
order are vLLM's; fields vLLM declares with a default are left out when they hold it.

Block and parent hashes go out as vLLM's ``ExternalBlockHash`` with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (its default): the last 8 bytes of the 32-byte
digest read big-endian, an unsigned 64-bit int. Dynamo accepts nothing else (a ``bytes``
hash fails the whole batch); llm-d folds ``bytes`` to the same 64 bits, so both name a block
alike. Inside tokenloom the full digests stay the keys (``block_hash.py``).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from tokenloom.actors.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

Encoding = Literal["map", "array"]
ENCODINGS: tuple[str, ...] = ("map", "array")

_STORED_FIELDS = [
    ("block_hashes", list[int]),
    ("parent_block_hash", int | None),
    ("token_ids", list[int]),
    ("block_size", int),
    ("lora_id", int | None),
    ("medium", str | None),
    ("lora_name", str | None),
    ("extra_keys", list[tuple[str, ...] | None] | None, None),
]
_REMOVED_FIELDS = [("block_hashes", list[int]), ("medium", str | None)]


def _event_types(array_like: bool) -> tuple[type, type, type]:
    """(BlockStored, BlockRemoved, AllBlocksCleared) wire structs: msgspec's tagged unions,
    tag values the class names as vLLM's ``tag=True`` gives them, tag field ``"type"``."""
    opts: dict[str, Any] = dict(array_like=array_like, omit_defaults=True, gc=False)
    return (msgspec.defstruct("BlockStored", _STORED_FIELDS, tag="BlockStored", **opts),
            msgspec.defstruct("BlockRemoved", _REMOVED_FIELDS, tag="BlockRemoved", **opts),
            msgspec.defstruct("AllBlocksCleared", [], tag="AllBlocksCleared", **opts))


_TYPES = {"map": _event_types(array_like=False), "array": _event_types(array_like=True)}

# No default on the rank: it is always encoded (an omitted trailing field would shorten the
# array Dynamo reads as a 3-tuple).
_Batch = msgspec.defstruct("EventBatch", [("ts", float), ("events", list[Any]),
                                          ("data_parallel_rank", int)],
                           array_like=True, gc=False)


def external_hash(digest: bytes) -> int:
    """A block's 64-bit name on the wire: the digest's last 8 bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")


class WireEncoder:
    """Encodes internal ``EventBatch``es for the wire in one ``encoding``, stamped with
    ``data_parallel_rank``."""

    def __init__(self, encoding: str = "map", data_parallel_rank: int = 0) -> None:
        if encoding not in _TYPES:
            raise ValueError(f"KV event encoding must be one of {ENCODINGS}, got {encoding!r}")
        if data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be >= 0, got {data_parallel_rank}")
        self.encoding = encoding
        self.data_parallel_rank = data_parallel_rank
        self._stored, self._removed, self._cleared = _TYPES[encoding]
        self._encode = msgspec.msgpack.Encoder().encode

    def encode(self, batch: EventBatch) -> bytes:
        return self._encode(_Batch(batch.ts, [self._event(e) for e in batch.events],
                                   self.data_parallel_rank))

    def _event(self, event):
        match event:
            case BlockStored():
                parent = event.parent_block_hash
                return self._stored(
                    [external_hash(h) for h in event.block_hashes],
                    None if parent is None else external_hash(parent),
                    event.token_ids, event.block_size, event.lora_id, event.medium,
                    event.lora_name, event.extra_keys)
            case BlockRemoved():
                return self._removed([external_hash(h) for h in event.block_hashes],
                                     event.medium)
            case AllBlocksCleared():
                return self._cleared()
        raise TypeError(f"not a KV cache event: {event!r}")
