"""One KV block as the tiers below the device pool hold it. Pure (numpy, no torch).

A block leaves the device pool as raw bytes (every layer's K and V for its ``block_size``
tokens, in the pool's dtype) plus what identifies it: its chain hash, its parent's hash,
its tokens and the request's ``cache_salt``. The hash is the key in every tier, and the
chain hash covers the model fingerprint and the salt (``block_hash.py``), so a tier can only
ever answer a lookup with KV computed for the same model, tokens and tenant.

``KVLayout`` says how the bytes are laid out; its ``tag`` (a digest of the layout) is part of
every key on disk and in the remote store, so KV written by a daemon with another dtype,
head layout or block size is never read back as this one's.

On disk and on the wire a block is one self-checking record (``encode``/``decode``):

    magic "TLKV" | u16 version | u32 header length | header (msgpack) | payload | u32 crc32

The crc covers header and payload: a truncated or corrupted record raises ``CorruptRecord``
(the caller falls back to recompute for that block and everything after it).
"""

from __future__ import annotations

import hashlib
import struct
import zlib

import msgspec
import numpy as np

MAGIC = b"TLKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")
_CRC = struct.Struct("<I")


class CorruptRecord(ValueError):
    """A stored block failed its checks (magic, version, length, crc or key)."""


class KVLayout(msgspec.Struct, frozen=True, gc=False):
    """The shape of one block's bytes: ``shape`` (layers, 2, block_size, kv_heads, head_dim
    in the device pool's order) of ``dtype`` (a torch dtype name, e.g. ``float32``), for
    the model ``fingerprint`` (so a disk tier shared by two models never announces one's
    blocks as the other's; the hashes themselves already differ)."""
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    fingerprint: str = ""
    # A quantized pool's per-block scales, appended to the values (kernels/kv_store.py).
    scale_bytes: int = 0

    @property
    def block_bytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n + self.scale_bytes

    @property
    def tag(self) -> str:
        """16 hex digits naming the layout, used in on-disk paths and remote keys."""
        text = (f"{self.dtype}:{','.join(map(str, self.shape))}:{self.itemsize}:v{VERSION}:"
                f"{self.fingerprint}")
        if self.scale_bytes:
            text += f":scales{self.scale_bytes}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class BlockMeta(msgspec.Struct, frozen=True, gc=False):
    """What identifies a block: its chain hash, its parent's (``None`` for a sequence's
    first block), its tokens, and the salt announced with a sequence's first block."""
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    cache_salt: str | None = None


class BlockRecord(msgspec.Struct, frozen=True, gc=False):
    """A block's identity and its bytes (``uint8``, ``layout.block_bytes`` long)."""
    meta: BlockMeta
    payload: np.ndarray


class _Header(msgspec.Struct, frozen=True, array_like=True):
    layout_tag: str
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: list[int]
    cache_salt: str | None
    payload_bytes: int


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(_Header)


def encode(record: BlockRecord, layout: KVLayout) -> bytes:
    """The record's self-checking bytes (see the module docstring)."""
    payload = np.ascontiguousarray(record.payload, dtype=np.uint8).reshape(-1)
    if payload.nbytes != layout.block_bytes:
        raise ValueError(f"payload of {payload.nbytes} bytes for a layout of "
                         f"{layout.block_bytes}")
    m = record.meta
    header = _enc.encode(_Header(layout.tag, m.block_hash, m.parent_hash, list(m.token_ids),
                                 m.cache_salt, payload.nbytes))
    body = _PREFIX.pack(MAGIC, VERSION, len(header)) + header
    crc = zlib.crc32(payload, zlib.crc32(header))
    return b"".join((body, payload.tobytes(), _CRC.pack(crc)))


def decode(data: bytes | memoryview, layout: KVLayout,
           expect_hash: bytes | None = None) -> BlockRecord:
    """Parse and check a record written by ``encode`` for ``layout``; ``expect_hash``: the
    key it was read under (a record filed under another hash is corrupt). Raises
    ``CorruptRecord`` naming what failed."""
    view = memoryview(data)
    if len(view) < _PREFIX.size + _CRC.size:
        raise CorruptRecord(f"record of {len(view)} bytes is truncated")
    magic, version, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptRecord("bad magic")
    if version != VERSION:
        raise CorruptRecord(f"record version {version}, this build reads {VERSION}")
    start = _PREFIX.size
    if start + header_len + _CRC.size > len(view):
        raise CorruptRecord("record is truncated inside its header")
    try:
        header = _dec.decode(view[start:start + header_len])
    except msgspec.DecodeError as e:
        raise CorruptRecord(f"unreadable header: {e}") from None
    if header.layout_tag != layout.tag:
        raise CorruptRecord(f"layout {header.layout_tag}, expected {layout.tag}")
    if header.payload_bytes != layout.block_bytes:
        raise CorruptRecord(f"payload of {header.payload_bytes} bytes, layout needs "
                            f"{layout.block_bytes}")
    p0 = start + header_len
    p1 = p0 + header.payload_bytes
    if p1 + _CRC.size != len(view):
        raise CorruptRecord(f"record of {len(view)} bytes, expected {p1 + _CRC.size}")
    payload = np.frombuffer(view[p0:p1], dtype=np.uint8)
    (crc,) = _CRC.unpack_from(view, p1)
    if zlib.crc32(payload, zlib.crc32(view[start:p0])) != crc:
        raise CorruptRecord("crc mismatch")
    if expect_hash is not None and header.block_hash != expect_hash:
        raise CorruptRecord("record is filed under another block hash")
    meta = BlockMeta(header.block_hash, header.parent_hash, tuple(header.token_ids),
                     header.cache_salt)
    return BlockRecord(meta, payload)
