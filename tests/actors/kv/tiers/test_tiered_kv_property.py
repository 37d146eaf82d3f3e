"""Property test: the KV manager with a host and a disk tier under random admissions,
steps, frees and tier faults, with the runner simulated block by block.

Every block's bytes are a function of its chain hash, so the test can check, after every
rule, that no device block cached under a hash holds anything but that hash's KV, whether
it was computed, restored from host memory or from disk, after evictions during a
restore (other admissions between the lookup and the admission) and restores that fail
part-way (a tier entry discarded or corrupted in between)."""

from __future__ import annotations

import hashlib

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tokenloom.actors.kv.block_hash import CacheIdentity, hash_request_blocks
from tokenloom.actors.kv.kv_manager import KVCacheManager, StagedBlocks
from tokenloom.actors.kv.prefix_cache import PrefixQuery
from tokenloom.actors.kv.tiers.calibration import TransferModel
from tokenloom.actors.kv.tiers.disk import DiskStore
from tokenloom.actors.kv.tiers.manager import TierManager, WritePolicy
from tokenloom.actors.kv.tiers.planner import RecomputeCost
from tokenloom.actors.kv.tiers.record import KVLayout
from tokenloom.actors.kv.tiers.store import HostStore

BS = 4
LAYOUT = KVLayout("float32", (1, 2, BS, 1, 2), 4)      # 64 bytes a block
IDENT = CacheIdentity("tiny").encode()
# Prompts share leading blocks: 3 stems x 3 tails, 3..6 blocks long.
STEMS = [[10 + s] * (2 * BS) for s in range(3)]
PROMPTS = [stem + [20 + t + i for i in range((1 + t) * BS)] + [99] for stem in STEMS
           for t in range(3)]
COST = RecomputeCost(coef=None, prior_s_per_token=1.0)   # recompute is dear: restore


def content(block_hash: bytes) -> np.ndarray:
    digest = hashlib.sha256(block_hash).digest()
    return np.frombuffer(digest * 2, dtype=np.uint8)[:LAYOUT.block_bytes].copy()


class TieredKVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        import tempfile
        self.dir = tempfile.TemporaryDirectory()
        self.kv = KVCacheManager(10, BS, enable_prefix_caching=True)
        stores = [HostStore(LAYOUT, 6 * LAYOUT.block_bytes),
                  DiskStore(LAYOUT, self.dir.name, 1 << 20)]
        models = {"host": TransferModel(0.0, 4e9), "disk": TransferModel(1e-4, 5e8)}
        self.tiers = TierManager(LAYOUT, stores, {"host": WritePolicy("back"),
                                                  "disk": WritePolicy("back")}, models,
                                 block_size=BS)
        self.kv.attach_tiers(self.tiers.wants)
        self.device: dict[int, bytes] = {}       # block id -> bytes, as the runner holds them
        self.running: dict[str, tuple[list[int], list[bytes]]] = {}
        self.n = 0

    def teardown(self) -> None:
        self.tiers.close()
        self.dir.cleanup()

    def _runner(self, restores=()) -> None:
        """What a batch does, in the runner's order: offloads out first, restores in."""
        offloads = self.kv.take_offloads()
        if offloads:
            rows = np.stack([np.frombuffer(self.device[b], dtype=np.uint8) for b, _, _ in offloads])
            self.tiers.offer([m for _, m, _ in offloads], rows, [c for *_, c in offloads])
        for b, payload in restores:
            self.device[b] = bytes(payload)
        self._drain()

    def _drain(self) -> None:
        for pool in self.tiers._writers.values():   # let queued disk writes land
            pool.submit(lambda: None).result()

    @rule(p=st.sampled_from(range(len(PROMPTS))), fault=st.sampled_from(
        ["none", "none", "discard_host", "corrupt_disk", "evict_between"]))
    def admit(self, p, fault):
        if len(self.running) >= 3:
            return
        tokens = PROMPTS[p]
        hashes = hash_request_blocks(tokens, BS, IDENT)
        rid = f"r{self.n}"
        self.n += 1
        query = PrefixQuery(token_ids=tokens, block_hashes=hashes)
        reusable = (len(tokens) - 1) // BS
        hit = self.kv.lookup(rid, query).num_hit_blocks
        report = self.tiers.query(rid, hashes[:reusable], hit, len(tokens), COST)
        if report is None:                       # a disk fetch: wait for it
            import time
            for _ in range(200):
                if rid not in self.tiers._jobs:
                    break
                time.sleep(0.005)
        if fault == "discard_host" and hashes:
            self.tiers.stores[0].discard(hashes[min(len(hashes) - 1, hit + 1)])
        elif fault == "corrupt_disk":
            for f in list((self.tiers.stores[1].root).rglob("*.kvb"))[:1]:
                f.write_bytes(b"garbage")
        elif fault == "evict_between" and self.running:
            victim = next(iter(self.running))
            self.free_one(victim)
        need = -(-len(tokens) // BS)
        if need > self.kv.num_free_blocks:
            self.tiers.cancel(rid)
            return
        hit = self.kv.lookup(rid, query).num_hit_blocks
        staged = self.tiers.take_staged(rid, hit, len(tokens))
        blocks = None
        if staged is not None and staged.records:
            blocks = StagedBlocks(start_block=staged.start_block,
                                  payloads=[r.payload for r in staged.records],
                                  tiers=staged.tiers)
        growth = self.kv.admit(rid, len(tokens), query, staged=blocks)
        table = self.kv.block_table(rid)
        cached = growth.num_cached_tokens // BS
        restored = len(growth.restores)
        for b, payload in growth.restores:          # restored bytes are that hash's KV
            i = table.index(b)
            assert bytes(payload) == bytes(content(hashes[i])), "a tier served wrong KV"
        self._runner(growth.restores)
        for i in range(cached, len(table)):          # the forward computes the rest
            self.device[table[i]] = bytes(content(hashes[i])) if i < len(hashes) else b"?"
        self.kv.commit_full_blocks(rid, len(tokens), hashes, tokens)
        self._runner()
        assert cached - restored <= hit or restored == 0
        self.running[rid] = (table, hashes)

    @rule(data=st.data())
    def free(self, data):
        if self.running:
            self.free_one(data.draw(st.sampled_from(sorted(self.running))))

    def free_one(self, rid):
        del self.running[rid]
        self.kv.free(rid)

    @invariant()
    def device_and_tiers_hold_only_their_own_kv(self):
        self.kv.check_integrity()
        cache = self.kv._cache
        for h, b in cache._block_of.items():
            assert self.device[b] == bytes(content(h)), f"device block {b} holds wrong KV"
        host = self.tiers.stores[0]
        for h, rec in list(host._records.items()):
            assert bytes(rec.payload) == bytes(content(h)), "host tier holds wrong KV"


TieredKVMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25,
                                              deadline=None)
test_tiered_kv_state_machine = TieredKVMachine.TestCase


def test_scripted_restores_come_from_host_and_disk():
    """The machine's paths, scripted: prompts evicted from the device come back from host
    memory and, once host memory has passed them down, from disk."""
    m = TieredKVMachine()
    try:
        restored: dict[str, int] = {}
        orig = m.kv.admit

        def admit(*a, **k):
            g = orig(*a, **k)
            for t in g.restored_tiers:
                restored[t] = restored.get(t, 0) + 1
            return g

        m.kv.admit = admit
        # Forward, then backward: the first prompts come back from disk (host memory passed
        # them down), the last ones from host memory (recently evicted from the device).
        for order in (range(len(PROMPTS)), reversed(range(len(PROMPTS))), range(len(PROMPTS))):
            for p in order:
                m.admit(p, "none")
                for rid in list(m.running):
                    m.free_one(rid)
                m.device_and_tiers_hold_only_their_own_kv()
        assert restored.get("host", 0) > 0 and restored.get("disk", 0) > 0, restored
    finally:
        m.teardown()
