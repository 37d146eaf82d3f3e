"""The handoff tier: KV a prefill worker computed, read back by a decode worker.

Disaggregated serving (docs/disaggregation.md) moves a request's prompt KV from the worker
that prefilled it to the worker that decodes it. Both sides see this store as one more KV
tier (``name = "peer"``): the prefill worker writes every block it computes through to it
(the tier manager's ``through`` policy, on its writer thread, while the next chunk computes,
so the copy is chunk-pipelined with the prefill), and the decode worker's restore planner
reads the request's chain back from it exactly as it would from disk: a transfer is a
restore from a peer, verified record by record (``record.py``: versioned, crc-checked, the
key checked against the hash it was filed under).

The medium is a directory shared by the processes of one host, by default under
``/dev/shm`` (memory, never a disk): one file per block, ``<hex>.kvb``, written to a temp
name and renamed, so a reader sees a whole record or none. Unlike the disk tier there is
no index in memory: several processes write and the front deletes, so the file system is
the only truth (``present`` is one ``stat`` a block).

Who deletes: not this store. The front (``daemon/workers/handoff.py``) holds each
handoff's blocks under a lease and removes the files once the decode side has claimed them
or the lease expired. The store only refuses to write beyond ``capacity_bytes`` (a stuck
front must not fill the host's memory): such a block is recomputed by the decode side.
Handoff blocks are not announced as KV events: they are in flight between two workers,
not a cache either of them holds.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenloom.actors.kv.tiers.record import BlockRecord, CorruptRecord, KVLayout, decode, encode
from tokenloom.actors.kv.tiers.store import Evicted, HealthTracker, TierHealth, TierUsage

MEDIUM_PEER = "PEER"
SUFFIX = ".kvb"
_TMP_SUFFIX = ".tmp"
# Recount the directory's bytes after this many writes (other processes delete files).
_RECOUNT_EVERY = 64


def handoff_file(root: str | os.PathLike, block_hash: bytes) -> Path:
    return Path(root) / f"{block_hash.hex()}{SUFFIX}"


def remove_blocks(root: str | os.PathLike, hashes: Iterable[bytes]) -> int:
    """Delete these blocks' files (the front's lease release); returns how many existed."""
    n = 0
    for h in hashes:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(handoff_file(root, h))
            n += 1
    return n


def stored_blocks(root: str | os.PathLike) -> list[bytes]:
    """Every block hash with a file in ``root`` (tests and the leak check)."""
    out = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(root):
            if entry.name.endswith(SUFFIX):
                with contextlib.suppress(ValueError):
                    out.append(bytes.fromhex(entry.name[:-len(SUFFIX)]))
    return out


class HandoffStore:
    """Blocks as files in the shared directory ``path`` (created if absent)."""

    name = "peer"
    medium = MEDIUM_PEER
    announce_events = False
    takes_evictions = False

    def __init__(self, layout: KVLayout, path: str | os.PathLike,
                 capacity_bytes: int) -> None:
        if capacity_bytes < layout.block_bytes:
            raise ValueError(f"handoff tier of {capacity_bytes} bytes cannot hold one block "
                             f"of {layout.block_bytes}")
        self.layout = layout
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self._health = HealthTracker()
        self._lock = threading.Lock()
        self._bytes_estimate = self._count_bytes()
        self._writes_since_count = 0
        self.num_refused = 0

    def _file(self, block_hash: bytes) -> Path:
        return handoff_file(self.root, block_hash)

    def _count(self) -> tuple[int, int]:
        """Block files in the directory and their bytes (a file is a header, the payload
        and a crc: bytes / block_bytes would overcount the blocks)."""
        n = total = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root):
                if entry.name.endswith(SUFFIX):
                    with contextlib.suppress(OSError):
                        total += entry.stat().st_size
                        n += 1
        return n, total

    def _count_bytes(self) -> int:
        return self._count()[1]

    def contains(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if not self._file(h).exists():
                break
            n += 1
        return n

    def present(self, hashes: Sequence[bytes]) -> list[bool]:
        return [self._file(h).exists() for h in hashes]

    def get(self, block_hash: bytes) -> BlockRecord | None:
        path = self._file(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None      # released (claimed or expired) meanwhile: recompute it
        except OSError as e:
            self._health.fail(f"read {path.name}: {e}")
            return None
        try:
            record = decode(data, self.layout, expect_hash=block_hash)
        except CorruptRecord as e:
            self._health.fail(f"{path.name}: {e}")
            self.discard(block_hash)
            return None
        self._health.ok()
        return record

    def put(self, record: BlockRecord) -> Evicted:
        path = self._file(record.meta.block_hash)
        if path.exists():
            return Evicted()
        data = encode(record, self.layout)
        with self._lock:
            self._writes_since_count += 1
            if self._writes_since_count >= _RECOUNT_EVERY or (
                    self._bytes_estimate + len(data) > self.capacity_bytes):
                self._bytes_estimate = self._count_bytes()
                self._writes_since_count = 0
            if self._bytes_estimate + len(data) > self.capacity_bytes:
                self.num_refused += 1
                return Evicted()
            self._bytes_estimate += len(data)
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".", suffix=_TMP_SUFFIX)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:
            self._health.fail(f"write {path.name}: {e}")
            return Evicted()
        self._health.ok()
        return Evicted(stored=True)

    def discard(self, block_hash: bytes) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self._file(block_hash))

    def usage(self) -> TierUsage:
        n, used = self._count()
        return TierUsage(n, used, self.capacity_bytes)

    def health(self) -> TierHealth:
        return self._health.snapshot()

    def close(self) -> None:
        pass    # the files belong to the handoffs in flight; the front removes them
