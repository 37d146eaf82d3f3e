"""KV cache events on the wire, read with the rules of the consumers that subscribe to them:
llm-d's event adapter and pool, Dynamo's ZMQ wire decoder and radix tree, and vLLM's own
structs. The rules, and the source file each one comes from, are in tests/kv_consumers.py;
every decode here goes through plain ``msgpack`` (or vLLM's structs), never tokenloom's.

1. the default (map) encoding: every batch is ``[ts, events, 0]``; events are maps tagged
   ``"type"`` with vLLM's field names; hashes are the digests' last 8 bytes as uint64;
   ``len(token_ids) == len(block_hashes) * block_size``; ``extra_keys`` has one entry per
   block and the ``cache_salt`` in a chain's first block; ``lora_name`` and ``medium`` are
   there; llm-d, Dynamo and vLLM's structs all accept every batch;
2. an index built by each consumer from those events alone predicts exactly the blocks the
   KV manager then hits, for salted and unsalted requests (another salt predicts nothing);
3. the "array" option gives vLLM's older positional events, which all three still accept;
4. the old form (32-byte ``bytes`` hashes, a ``null`` rank) is what Dynamo refused — the
   rules are not vacuous;
5. a run whose parent was evicted (it was cached on a duplicate block) re-announces the
   parent first, so no consumer drops the store;
6. ``kv_events.encoding`` is validated naming the key; the default topic is
   ``kv@<host:port>@<model>``, which llm-d splits into a pod and a model.
"""

from __future__ import annotations

import msgspec
import pytest

from tokenloom.actors.kv.block_hash import CacheIdentity, hash_request_blocks
from tokenloom.actors.kv.events import EventBatch, EventCollector
from tokenloom.actors.kv.events_wire import WireEncoder
from tokenloom.actors.kv.kv_manager import KVCacheManager
from tokenloom.actors.kv.prefix_cache import PrefixQuery

from kv_consumers import (
    DYNAMO_SALT_PREFIX,
    VLLM_STRUCTS,
    DynamoIndex,
    LlmdIndex,
    Rejected,
    dynamo_decode,
    llmd_decode,
    llmd_topic,
    unpack,
    vllm_int_hash,
)

BS = 4
MODEL = "tiny"
POD = "10.0.0.7:8000"
STORED_KEYS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
               "lora_id", "medium", "lora_name", "extra_keys"}


def hashes(tokens, salt=None):
    return hash_request_blocks(tokens, BS, CacheIdentity("fp", salt).encode())


class World:
    """A KV manager with prefix caching whose events are collected into batches."""

    def __init__(self, num_blocks=64):
        self.kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True)
        self.collector = EventCollector()
        self.kv.events.subscribe(self.collector)
        self.batches: list[EventBatch] = []
        self.digests: set[bytes] = set()

    def run(self, rid, tokens, salt=None):
        """Admit, compute every token, commit, then finish (blocks stay cached)."""
        hs = hashes(tokens, salt)
        self.kv.admit(rid, len(tokens), PrefixQuery(tokens, hs))
        self.kv.commit_full_blocks(rid, len(tokens), hs, tokens, cache_salt=salt)
        self.digests.update(hs)
        self.flush_batch()
        self.kv.free(rid)

    def flush_batch(self):
        batch = self.collector.drain(ts=float(len(self.batches)))
        if batch is not None:
            self.batches.append(batch)

    def hit_blocks(self, tokens, salt=None):
        return self.kv.lookup("probe", PrefixQuery(tokens, hashes(tokens, salt))).num_hit_blocks


def prompt(seed, n):
    return [(seed * 31 + i * 7) % 1000 + 3 for i in range(n)]


def scenario(world: World):
    shared = prompt(1, 5 * BS)
    world.run("a", shared + [11, 12, 13])                       # unsalted
    world.run("b", shared + prompt(2, 2 * BS + 1))              # shares 5 blocks
    world.run("c", shared + [11], salt=DYNAMO_SALT_PREFIX + "t1")   # same tokens, salted
    return shared


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_every_consumer_accepts_the_batches_and_predicts_the_hits(encoding):
    world = World()
    shared = scenario(world)
    encoder = WireEncoder(encoding)
    llmd, dynamo = LlmdIndex(BS), DynamoIndex(BS)
    vllm_decode, v_stored, _, _ = VLLM_STRUCTS[encoding]
    for batch in world.batches:
        payload = encoder.encode(batch)
        raw = unpack(payload)
        assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0 and \
            isinstance(raw[2], int)
        for ev in raw[1]:
            if encoding == "map":
                assert isinstance(ev, dict) and isinstance(ev["type"], str)
                if ev["type"] == "BlockStored":
                    assert set(ev) == STORED_KEYS
            else:
                assert isinstance(ev, list) and isinstance(ev[0], str)
        _, rank, events = llmd_decode(payload)
        assert rank == 0
        llmd.apply(POD, MODEL, events)
        _, rank, events = dynamo_decode(payload)
        assert rank == 0
        dynamo.apply(events)
        decoded = vllm_decode.decode(payload)
        assert decoded.data_parallel_rank == 0
        for ev in decoded.events:
            if isinstance(ev, v_stored):
                assert all(isinstance(h, int) and 0 <= h < 2**64 for h in ev.block_hashes)
                assert set(ev.block_hashes) <= {vllm_int_hash(d) for d in world.digests}
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                assert ev.block_size == BS and ev.medium == "GPU" and ev.lora_name is None
                assert ev.extra_keys is not None and len(ev.extra_keys) == len(ev.block_hashes)
                assert all(k is None for k in ev.extra_keys[1:])
    assert llmd.skipped == [] and dynamo.dropped == []

    # The indexes know what the manager would hit (the last token's block is never a hit).
    salt = DYNAMO_SALT_PREFIX + "t1"
    for tokens, s in [(shared + [11, 12, 13, 14], None), (shared + prompt(2, 2 * BS) + [5], None),
                      (shared + [11], salt), (shared + [99], "other")]:
        expected = world.hit_blocks(tokens, s)
        reusable = (len(tokens) - 1) // BS
        extra = (s,) if s is not None else ()
        assert min(llmd.hit_blocks(POD, tokens, MODEL, extra), reusable) == expected
        namespace = s[len(DYNAMO_SALT_PREFIX):] if s and s.startswith(DYNAMO_SALT_PREFIX) else s
        assert min(dynamo.hit_blocks(tokens, namespace=namespace), reusable) == expected
    assert world.hit_blocks(shared + [11], salt) == 5
    assert world.hit_blocks(shared + [99], "other") == 0


def test_the_salt_rides_in_the_first_block_of_a_chain_only():
    world = World()
    scenario(world)
    stored = [e for b in world.batches for e in unpack(WireEncoder().encode(b))[1]
              if e["type"] == "BlockStored"]
    salted = [e for e in stored if any(k is not None for k in e["extra_keys"])]
    assert len(salted) == 1
    assert salted[0]["parent_block_hash"] is None
    assert salted[0]["extra_keys"][0] == [DYNAMO_SALT_PREFIX + "t1"]
    # b's run continues a's chain: its parent is a's 5th block, announced before.
    b = stored[1]
    assert b["parent_block_hash"] == stored[0]["block_hashes"][4]


def test_the_old_form_is_what_dynamo_refused():
    """tokenloom's former wire form (its internal structs: bytes digests, rank omitted)."""
    world = World()
    scenario(world)
    old = msgspec.msgpack.encode(world.batches[0])
    with pytest.raises(Rejected):
        dynamo_decode(old)
    with pytest.raises(Rejected):
        dynamo_decode(msgspec.msgpack.encode([1.0, [], None, 7]))   # not a 3-tuple


def test_a_run_whose_parent_was_evicted_reannounces_the_parent_first():
    """1. x and y compute the same two blocks at once: x's are cached, y's stay uncached
    duplicates; 2. x finishes and its blocks are evicted; 3. y commits its third block:
    the store must not name a parent the consumers have been told is gone."""
    world = World(num_blocks=8)
    tokens = prompt(3, 3 * BS + 1)
    hs = hashes(tokens)
    kv = world.kv
    for rid in ("x", "y"):
        kv.admit(rid, len(tokens), PrefixQuery(tokens[:2 * BS + 1], []))
    kv.commit_full_blocks("x", 2 * BS, hs, tokens)
    kv.commit_full_blocks("y", 2 * BS, hs, tokens)       # duplicates: not cached
    world.flush_batch()
    kv.free("x")
    assert kv.allocate([("z", 8 * BS - 4 * BS)]) is not None  # evicts x's cached blocks
    world.flush_batch()
    kv.commit_full_blocks("y", 3 * BS, hs, tokens)
    world.flush_batch()
    llmd, dynamo = LlmdIndex(BS), DynamoIndex(BS)
    for batch in world.batches:
        payload = WireEncoder().encode(batch)
        llmd.apply(POD, MODEL, llmd_decode(payload)[2])
        dynamo.apply(dynamo_decode(payload)[2])
    assert llmd.skipped == [] and dynamo.dropped == []
    assert llmd.hit_blocks(POD, tokens, MODEL) == 3 == dynamo.hit_blocks(tokens)
    kv.check_integrity()


def test_encoding_is_validated_and_the_default_topic_names_pod_and_model():
    from tokenloom.actors.kv.events_zmq import default_topic
    from tokenloom.config.load import load_config
    from tokenloom.config.schema import ConfigError
    with pytest.raises(ConfigError, match="kv_events.encoding must be one of 'array', 'map'"):
        load_config(overrides={"kv_events.encoding": "json"}, env=None)
    cfg = load_config(overrides={"kv_events.encoding": "array"}, env=None)
    assert cfg.kv_events.encoding == "array" and cfg.kv_events.topic == "auto"
    assert llmd_topic(default_topic("10.1.2.3", 8000, "chat", "/m/SmolLM2")) == \
        ("10.1.2.3:8000", "chat")
    assert llmd_topic(default_topic("10.1.2.3", 8000, "", "/m/SmolLM2")) == \
        ("10.1.2.3:8000", "SmolLM2")
    pod, _ = llmd_topic(default_topic("0.0.0.0", 80, "m", "/x"))
    assert not pod.startswith("0.0.0.0")                 # the host name stands in
    with pytest.raises(ValueError, match="encoding"):
        WireEncoder("json")
