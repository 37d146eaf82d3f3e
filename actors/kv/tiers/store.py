"""The interface every KV tier implements, and the host-RAM tier. Pure (numpy, no torch).

A tier is a map from block hash to ``BlockRecord`` with a byte budget and its own LRU. The
tier manager (``manager.py``) calls stores from its transfer threads, so every store is
thread-safe. A store never raises for trouble with its medium (a full disk, a dead server,
a corrupt file): it answers "not here" and reports it in ``health()``, which recovers by
itself once the medium answers again. Exceptions are for misuse only.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import msgspec

from tokenloom.actors.kv.tiers.record import BlockRecord, KVLayout

# KV events' `medium` per tier (vLLM names the device "GPU" and host memory "CPU").
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_REMOTE = "REMOTE"


class TierUsage(msgspec.Struct, frozen=True, gc=False):
    num_blocks: int
    bytes_used: int
    bytes_capacity: int      # 0: bounded by the server, not by this daemon (remote)


class TierHealth(msgspec.Struct, frozen=True, gc=False):
    """``degraded``: the medium failed recently (``reason``, at ``since`` wall-clock
    seconds); lookups skip it or fall back to recompute until it answers again."""
    degraded: bool = False
    reason: str | None = None
    since: float | None = None
    num_errors: int = 0


class Evicted(msgspec.Struct, frozen=True, gc=False):
    """What a ``put`` did: ``stored`` (the block is new here; False when it was already
    stored or the write failed) and what it pushed out: the hashes, and (host only) the
    records themselves, so that they can go down to a slower tier instead of vanishing."""
    hashes: list[bytes] = []
    records: list[BlockRecord] = []
    stored: bool = False


class TierStore(Protocol):
    name: str       # "host" | "disk" | "remote": metric labels and config keys
    medium: str     # MEDIUM_*: KV events
    layout: KVLayout

    def contains(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` are stored (stops at the first absent one)."""

    def present(self, hashes: Sequence[bytes]) -> list[bool]:
        """Which of ``hashes`` are stored (one round trip for a remote store)."""

    def get(self, block_hash: bytes) -> BlockRecord | None:
        """The block, or ``None`` when absent, unreadable or corrupt (then counted in
        ``health``). Refreshes its LRU position."""

    def put(self, record: BlockRecord) -> Evicted:
        """Store one block (a hash already stored is only refreshed); returns what the
        byte budget evicted. Trouble with the medium stores nothing and is reported in
        ``health``."""

    def discard(self, block_hash: bytes) -> None:
        """Forget one block (it failed its checks)."""

    def usage(self) -> TierUsage: ...

    def health(self) -> TierHealth: ...

    def close(self) -> None: ...


class HealthTracker:
    """Degraded-since bookkeeping shared by the stores: ``fail`` marks the medium degraded;
    ``ok`` clears it (the first success after a failure is the recovery)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._since: float | None = None
        self.num_errors = 0
        self.num_recoveries = 0

    def fail(self, reason: str) -> None:
        with self._lock:
            self.num_errors += 1
            if self._reason is None:
                self._since = time.time()
            self._reason = reason

    def ok(self) -> None:
        if self._reason is None:
            return
        with self._lock:
            if self._reason is not None:
                self.num_recoveries += 1
            self._reason, self._since = None, None

    @property
    def degraded(self) -> bool:
        return self._reason is not None

    def snapshot(self) -> TierHealth:
        with self._lock:
            return TierHealth(self._reason is not None, self._reason, self._since,
                              self.num_errors)


class HostStore:
    """Host RAM: records kept as they came (each payload its own array, never copied on
    ``get``: stored payloads are treated as immutable), LRU within ``capacity_bytes``."""

    name = "host"
    medium = MEDIUM_CPU

    def __init__(self, layout: KVLayout, capacity_bytes: int) -> None:
        if capacity_bytes < layout.block_bytes:
            raise ValueError(f"host tier of {capacity_bytes} bytes cannot hold one block of "
                             f"{layout.block_bytes}")
        self.layout = layout
        self.capacity_blocks = capacity_bytes // layout.block_bytes
        self._records: OrderedDict[bytes, BlockRecord] = OrderedDict()
        self._lock = threading.Lock()
        self._health = HealthTracker()

    def contains(self, hashes: Sequence[bytes]) -> int:
        with self._lock:
            n = 0
            for h in hashes:
                if h not in self._records:
                    break
                n += 1
            return n

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._records

    def present(self, hashes: Sequence[bytes]) -> list[bool]:
        return [h in self._records for h in hashes]

    def get(self, block_hash: bytes) -> BlockRecord | None:
        with self._lock:
            record = self._records.get(block_hash)
            if record is not None:
                self._records.move_to_end(block_hash)
            return record

    def put(self, record: BlockRecord) -> Evicted:
        if record.payload.nbytes != self.layout.block_bytes:
            raise ValueError(f"payload of {record.payload.nbytes} bytes, layout needs "
                             f"{self.layout.block_bytes}")
        h = record.meta.block_hash
        with self._lock:
            if h in self._records:
                self._records.move_to_end(h)
                return Evicted()
            self._records[h] = record
            out = []
            while len(self._records) > self.capacity_blocks:
                out.append(self._records.popitem(last=False)[1])
        return Evicted([r.meta.block_hash for r in out], out, stored=True)

    def discard(self, block_hash: bytes) -> None:
        with self._lock:
            self._records.pop(block_hash, None)

    def usage(self) -> TierUsage:
        n = len(self._records)
        return TierUsage(n, n * self.layout.block_bytes,
                         self.capacity_blocks * self.layout.block_bytes)

    def health(self) -> TierHealth:
        return self._health.snapshot()

    def close(self) -> None:
        with self._lock:
            self._records.clear()
