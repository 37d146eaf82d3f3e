"""Block hashes for prefix caching: a chain over full blocks, keyed by the cache identity.

    h_i = SHA-256(msgpack([h_{i-1} or b"", tokens of block i, identity]))

`identity` is one typed, length-prefixed encoding computed once per request
(`CacheIdentity.encode()`): the model fingerprint (weights digest + dtype + block size), the
tenant's `cache_salt` and an adapter slot. msgpack length-prefixes every string and array
and tags every type, so two different identities (or a salt that happens to look like token
ids, or ``None`` vs ``""``) never encode to the same bytes, and the chain makes a block's
hash depend on every token before it. The root's parent is ``b""``, which no real hash
(32 bytes) can equal.

Why SHA-256 and not a faster non-cryptographic hash: a collision would silently serve one
tenant's KV to another request. SHA-256 is collision-resistant even against crafted
prompts, and at ~1 µs per block it costs nothing next to the prefill it saves.

Content hashes: the same chain computed with the identity's salt removed
(`CacheIdentity.without_salt()`). They are never used to share KV — only to *explain* a
miss as ``isolation`` (the same tokens are cached under another salt). For an unsalted
identity they equal the block hashes, so callers pass ``None`` instead of a second list.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

_encode = msgspec.msgpack.Encoder().encode

BlockHash = bytes


class CacheIdentity(msgspec.Struct, frozen=True, array_like=True):
    """Everything besides the tokens that decides whether KV can be shared. `variant`: what
    else the request's KV depends on — a longrope model rotates a whole sequence with its
    long factors when the prompt outgrows the original window ("long"); None."""
    model_fingerprint: str
    cache_salt: str | None = None
    adapter: str | None = None
    variant: str | None = None

    def encode(self) -> bytes:
        if self.variant is None:   # (so identities without a variant keep their hashes)
            return _encode((self.model_fingerprint, self.cache_salt, self.adapter))
        return _encode(self)

    def without_salt(self) -> CacheIdentity:
        """The identity whose chain gives a request's *content* hashes (miss explanation)."""
        return CacheIdentity(self.model_fingerprint, None, self.adapter, self.variant)


class Identities:
    """The encoded identities of one model's requests, per (cache_salt, adapter): computed
    once each, for the scheduler's chains and the worker router's scoring alike (so the two
    hash exactly the same way). Bounded: tenants are few, salts may not be."""

    MAX_ENTRIES = 4096

    def __init__(self, model_fingerprint: str):
        self.model_fingerprint = model_fingerprint
        self._cache: dict[tuple, tuple[bytes, bytes | None]] = {}

    def encoded(self, salt: str | None, adapter: str | None = None,
                variant: str | None = None) -> tuple[bytes, bytes | None]:
        """(identity bytes, content-identity bytes — the salt-free one — or None when
        unsalted, where the content hashes equal the block hashes)."""
        key = (salt, adapter, variant)
        ids = self._cache.get(key)
        if ids is None:
            ident = CacheIdentity(self.model_fingerprint, salt, adapter, variant)
            ids = (ident.encode(), ident.without_salt().encode() if salt is not None else None)
            if len(self._cache) < self.MAX_ENTRIES:
                self._cache[key] = ids
        return ids


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      identity: bytes) -> BlockHash:
    """Hash of one full block, chained on ``parent`` (``None`` for the first block)."""
    return hashlib.sha256(_encode((parent or b"", list(token_ids), identity))).digest()


def hash_request_blocks(token_ids: Sequence[int], block_size: int, identity: bytes,
                        start: int = 0, parent: BlockHash | None = None) -> list[BlockHash]:
    """Hashes of every FULL block of token_ids, from block index `start` (continuing the
    chain from `parent`, the hash of block start - 1). A partial last block has no hash."""
    if not isinstance(identity, bytes):
        # A CacheIdentity would encode differently from its .encode() bytes: refuse loudly
        # rather than hash under a second, silently different identity.
        raise TypeError(f"identity must be CacheIdentity.encode() bytes, got {type(identity)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if start > 0 and parent is None:
        raise ValueError("continuing a chain from block start > 0 needs its parent hash")
    out: list[BlockHash] = []
    for i in range(start, len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], identity)
        out.append(parent)
    return out


def group_hashes(hashes: Sequence[BlockHash], group: int) -> Sequence[BlockHash]:
    """The keys a layer group's blocks are cached under (kv_manager.py): the chain's own
    hashes for group 0, derived ones for the others (a block of group 2 holds other
    layers' KV than group 0's block of the same tokens, so it must never be found for it).
    Derived from the chain hash, so isolation carries over."""
    if group == 0:
        return hashes
    tag = b"kv-group" + group.to_bytes(2, "little")
    return [hashlib.sha256(tag + h).digest() for h in hashes]


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        identity: bytes) -> list[BlockHash]:
    """Append to ``hashes`` (a request's chain so far) the hashes of blocks of ``token_ids``
    that have become full since; return the appended ones. Incremental: each block is
    hashed once over a request's life, however many tokens it generates."""
    new = hash_request_blocks(token_ids, block_size, identity, start=len(hashes),
                              parent=hashes[-1] if hashes else None)
    hashes.extend(new)
    return new


LONG_ROPE = "long_rope"


def long_rope_window(spec) -> int | None:
    """A longrope model's original window (a longer sequence rotates with the long factors
    throughout), else None."""
    rope = spec.rope
    return rope.original_max_position_embeddings if rope.rope_type == "longrope" else None


def rope_variant(spec, num_prompt_tokens: int) -> str | None:
    """The identity variant of a new request's KV (CacheIdentity.variant) under `spec`."""
    window = long_rope_window(spec)
    return LONG_ROPE if window is not None and num_prompt_tokens > window else None


def model_fingerprint(weights_digest: str, dtype: str, block_size: int) -> str:
    """An unambiguous fingerprint: hex SHA-256 of the msgpack triple. (A joined string such
    as ``f"{digest}:{dtype}"`` would alias ``("a:b", "c")`` with ``("a", "b:c")``.)"""
    return hashlib.sha256(_encode((weights_digest, dtype, block_size))).hexdigest()
