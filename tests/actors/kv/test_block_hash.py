"""Block hash chain: every earlier token, the salt, the model and the adapter all matter."""

from __future__ import annotations

import pytest

from tokenloom.actors.kv.block_hash import (
    CacheIdentity,
    extend_block_hashes,
    hash_block_tokens,
    hash_request_blocks,
    model_fingerprint,
)

BS = 4
IDENT = CacheIdentity(model_fingerprint("w0", "float32", BS)).encode()
TOKENS = list(range(100, 118))  # 4 full blocks + 2 tokens


def test_only_full_blocks_are_hashed_and_hashes_are_sha256_sized():
    hashes = hash_request_blocks(TOKENS, BS, IDENT)
    assert len(hashes) == 4
    assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    assert len(set(hashes)) == 4
    assert hash_request_blocks(TOKENS[:3], BS, IDENT) == []
    assert hash_request_blocks(TOKENS, BS, IDENT) == hashes  # deterministic


@pytest.mark.parametrize("position", [0, 3, 4, 9, 15])
def test_a_block_hash_depends_on_every_earlier_token(position):
    base = hash_request_blocks(TOKENS, BS, IDENT)
    changed = list(TOKENS)
    changed[position] += 1
    other = hash_request_blocks(changed, BS, IDENT)
    block = position // BS
    assert other[:block] == base[:block]          # blocks before the change: same
    assert all(o != b for o, b in zip(other[block:], base[block:]))  # this one and later


def test_identity_salt_model_and_adapter_each_change_every_hash():
    base = hash_request_blocks(TOKENS, BS, IDENT)
    fp = model_fingerprint("w0", "float32", BS)
    variants = [
        CacheIdentity(fp, cache_salt="tenant-a"),
        CacheIdentity(fp, cache_salt="tenant-b"),
        CacheIdentity(fp, cache_salt=""),  # empty salt is not "no salt"
        CacheIdentity(model_fingerprint("w1", "float32", BS)),
        CacheIdentity(model_fingerprint("w0", "bfloat16", BS)),
        CacheIdentity(fp, adapter="lora-1"),
    ]
    seen = {tuple(base)}
    for ident in variants:
        hashes = hash_request_blocks(TOKENS, BS, ident.encode())
        assert all(h != b for h, b in zip(hashes, base)), ident
        seen.add(tuple(hashes))
    assert len(seen) == len(variants) + 1


def test_same_salt_gives_same_hashes():
    fp = model_fingerprint("w0", "float32", BS)
    a = hash_request_blocks(TOKENS, BS, CacheIdentity(fp, "t").encode())
    b = hash_request_blocks(TOKENS, BS, CacheIdentity(fp, "t").encode())
    assert a == b


def test_without_salt_is_the_unsalted_identity():
    fp = model_fingerprint("w0", "float32", BS)
    salted = CacheIdentity(fp, "t", "lora")
    assert salted.without_salt() == CacheIdentity(fp, None, "lora")


def test_fingerprint_is_unambiguous():
    assert model_fingerprint("a:b", "c", 16) != model_fingerprint("a", "b:c", 16)
    assert model_fingerprint("a", "b", 16) != model_fingerprint("a", "b", 32)
    assert model_fingerprint("a", "b", 16) == model_fingerprint("a", "b", 16)


def test_salt_that_looks_like_tokens_does_not_alias():
    # Moving material between the token list and the identity must change the hash.
    fp = "fp"
    h1 = hash_block_tokens(None, [1, 2], CacheIdentity(fp, "3").encode())
    h2 = hash_block_tokens(None, [1, 2, 3], CacheIdentity(fp).encode())
    assert h1 != h2


def test_chain_continuation_and_incremental_extension_match_one_shot():
    full = hash_request_blocks(TOKENS, BS, IDENT)
    assert hash_request_blocks(TOKENS, BS, IDENT, start=2, parent=full[1]) == full[2:]
    hashes: list[bytes] = []
    for n in range(len(TOKENS) + 1):  # one token at a time, as decode would
        extend_block_hashes(hashes, TOKENS[:n], BS, IDENT)
        assert hashes == full[: n // BS]


def test_misuse_raises():
    with pytest.raises(TypeError):
        hash_request_blocks(TOKENS, BS, CacheIdentity("fp"))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        hash_request_blocks(TOKENS, 0, IDENT)
    with pytest.raises(ValueError):
        hash_request_blocks(TOKENS, BS, IDENT, start=1)  # no parent to continue from
