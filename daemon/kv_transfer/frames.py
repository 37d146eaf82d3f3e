"""The KV pull protocol between daemons (pure framing; asyncio streams do the I/O).

A decode daemon connects to the ``remote_host:remote_port`` a prefill daemon announced in
``kv_transfer_params`` and sends one request frame; the prefill daemon answers with exactly
one frame per block asked for, in order, then closes:

    request  = u32 length | msgpack {"v": 1, "request_id": str, "engine_id": str,
                                     "block_ids": [hex block hash, ...]}
    response = (u32 length | record bytes) * len(block_ids)     length 0: not held

A record is the KV tiers' own self-checking block record (actors/kv/tiers/record.py:
magic, version, layout tag, hash, crc32); the decode daemon writes it to its handoff tier
as it arrives and its engine verifies it on restore, so a torn or foreign block is
recomputed, never used.
"""

from __future__ import annotations

import struct

import msgspec

VERSION = 1
LENGTH = struct.Struct("<I")
MAX_REQUEST_BYTES = 16 << 20
MAX_RECORD_BYTES = 1 << 30


class PullRequest(msgspec.Struct, frozen=True):
    v: int
    request_id: str
    engine_id: str
    block_ids: list[str]


class FrameError(ValueError):
    """A frame that breaks the protocol (length, version, hash format)."""


def encode_request(request_id: str, engine_id: str, hashes: list[bytes]) -> bytes:
    body = msgspec.msgpack.encode(PullRequest(VERSION, request_id, engine_id,
                                              [h.hex() for h in hashes]))
    return LENGTH.pack(len(body)) + body


def decode_request(body: bytes) -> tuple[PullRequest, list[bytes]]:
    try:
        req = msgspec.msgpack.decode(body, type=PullRequest)
        hashes = [bytes.fromhex(x) for x in req.block_ids]
    except (msgspec.DecodeError, ValueError) as e:
        raise FrameError(f"bad pull request: {e}") from None
    if req.v != VERSION:
        raise FrameError(f"pull request version {req.v}, this daemon speaks {VERSION}")
    return req, hashes


def check_length(n: int, limit: int) -> int:
    if n > limit:
        raise FrameError(f"frame of {n} bytes exceeds {limit}")
    return n
