"""The local-disk KV tier: one self-checking file per block, LRU within a byte budget.

Layout on disk::

    <path>/<layout.tag>/<hex[:2]>/<hex>.kvb      hex = block_hash.hex()

holding ``record.encode(record, layout)``. The layout tag in the path keeps KV of other
models, dtypes or block sizes sharing ``path`` apart (each ``DiskStore`` sees only its own
tag's directory). A file is written to a temp file next to it and renamed into place, so a
reader (or a restart after a crash) sees a whole record or none; leftover temp files are
deleted at start.

The index (hash -> file size, in LRU order) lives in memory. At start it is rebuilt from the
files' names and mtimes, without reading them (a large cache would take minutes); a file is
verified when it is read (``get``, ``metas``), and a corrupt or unreadable one is deleted,
forgotten and reported in ``health()``. Trouble writing (a full disk) stores nothing and is
reported the same way; the first success afterwards clears it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tokenloom.actors.kv.tiers.record import (
    BlockMeta,
    BlockRecord,
    CorruptRecord,
    KVLayout,
    decode,
    encode,
)
from tokenloom.actors.kv.tiers.store import (
    MEDIUM_DISK,
    Evicted,
    HealthTracker,
    TierHealth,
    TierUsage,
)

SUFFIX = ".kvb"
_TMP_SUFFIX = ".tmp"


class DiskStore:
    """Blocks as files under ``path``; at most ``capacity_bytes`` of them (file sizes), the
    least recently used evicted first. ``fsync``: make each write durable before it counts
    (slower; without it a power loss may lose recent blocks, never corrupt the index: a
    torn file fails its crc and is dropped)."""

    name = "disk"
    medium = MEDIUM_DISK

    def __init__(self, layout: KVLayout, path: str | os.PathLike, capacity_bytes: int,
                 fsync: bool = False) -> None:
        # The smallest record this layout can produce (no tokens): a budget below it could
        # never hold a block.
        smallest = len(encode(BlockRecord(BlockMeta(bytes(32), None, ()),
                                          np.zeros(layout.block_bytes, np.uint8)), layout))
        if capacity_bytes < smallest:
            raise ValueError(f"disk tier of {capacity_bytes} bytes cannot hold one block "
                             f"record of {smallest} bytes")
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        self.root = Path(path) / layout.tag
        self._fsync = fsync
        self._lock = threading.Lock()
        self._health = HealthTracker()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._bytes_used = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()

    # -- paths and files --------------------------------------------------------------

    def _file(self, block_hash: bytes) -> Path:
        h = block_hash.hex()
        return self.root / h[:2] / f"{h}{SUFFIX}"

    def _scan(self) -> None:
        """Index the files a previous run left, oldest mtime first (the LRU head)."""
        found: list[tuple[float, bytes, int]] = []
        for sub in os.scandir(self.root):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                if entry.name.endswith(_TMP_SUFFIX):
                    # A write interrupted by a crash: never renamed, never indexed.
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                    continue
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    h = bytes.fromhex(entry.name[:-len(SUFFIX)])
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime, h, st.st_size))
        found.sort(key=lambda f: f[0])
        for _, h, size in found:
            self._index[h] = size
            self._bytes_used += size
        # The budget may have shrunk since the files were written.
        for h in self._evict_locked(keep=None):
            self._unlink(h)

    def _write(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=_TMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self._fsync:
            # The rename itself is only durable once the directory is.
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _unlink(self, block_hash: bytes) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self._file(block_hash))

    def _evict_locked(self, keep: bytes | None) -> list[bytes]:
        """Drop LRU-head entries until the budget holds (never ``keep``, the block just
        written); the caller deletes their files."""
        out = []
        while self._bytes_used > self.capacity_bytes and self._index:
            h = next(iter(self._index))
            if h == keep:
                break
            self._bytes_used -= self._index.pop(h)
            out.append(h)
        return out

    def _drop_bad(self, block_hash: bytes, why: str) -> None:
        """Forget and delete an unreadable or corrupt file, and report it."""
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._bytes_used -= size
            self._unlink(block_hash)
        self._health.fail(f"disk block {block_hash.hex()[:12]}: {why}")

    # -- TierStore --------------------------------------------------------------------

    def contains(self, hashes: Sequence[bytes]) -> int:
        with self._lock:
            n = 0
            for h in hashes:
                if h not in self._index:
                    break
                n += 1
            return n

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def present(self, hashes: Sequence[bytes]) -> list[bool]:
        return [h in self._index for h in hashes]

    def _read(self, block_hash: bytes) -> BlockRecord | None:
        """Read and verify one indexed file (I/O outside the lock: ``os.replace`` makes
        every read see a whole file)."""
        try:
            data = self._file(block_hash).read_bytes()
            return decode(data, self.layout, expect_hash=block_hash)
        except FileNotFoundError:
            with self._lock:
                evicted_meanwhile = block_hash not in self._index
            if evicted_meanwhile:   # a concurrent put evicted it: a miss, not a fault
                return None
            self._drop_bad(block_hash, "file is missing")
        except (CorruptRecord, OSError) as e:
            self._drop_bad(block_hash, f"{type(e).__name__}: {e}")
        return None

    def get(self, block_hash: bytes) -> BlockRecord | None:
        if block_hash not in self._index:
            return None
        record = self._read(block_hash)
        if record is None:
            return None
        self._health.ok()
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        return record

    def put(self, record: BlockRecord) -> Evicted:
        h = record.meta.block_hash
        with self._lock:
            if h in self._index:
                self._index.move_to_end(h)
                return Evicted()
        data = encode(record, self.layout)   # ValueError for a wrong payload: misuse
        try:
            self._write(self._file(h), data)
        except OSError as e:
            self._health.fail(f"disk write failed: {type(e).__name__}: {e}")
            return Evicted()
        self._health.ok()
        with self._lock:
            if h in self._index:    # another thread wrote the same block meanwhile
                self._index.move_to_end(h)
                return Evicted()
            self._index[h] = len(data)
            self._bytes_used += len(data)
            evicted = self._evict_locked(keep=h)
            # Deleted under the lock: a concurrent put of the same hash must not have its
            # fresh file removed by this eviction.
            for e in evicted:
                self._unlink(e)
        return Evicted(hashes=evicted, stored=True)

    def discard(self, block_hash: bytes) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._bytes_used -= size
                self._unlink(block_hash)

    def metas(self) -> list[BlockMeta]:
        """The stored blocks' identities, every block after its parent when the parent is
        stored too (so that announcing them as KV events in this order rebuilds chains),
        otherwise least recently used first. Reads and verifies every file: corrupt ones
        are deleted and reported, as on ``get``."""
        with self._lock:
            hashes = list(self._index)
        metas: dict[bytes, BlockMeta] = {}
        for h in hashes:
            record = self._read(h)
            if record is not None:
                metas[h] = record.meta
        depth: dict[bytes, int] = {}
        for h in metas:
            # Walk up to a block of known depth or a root, then number the way back down
            # (iteratively: chains can be thousands of blocks long).
            path: list[bytes] = []
            on_path: set[bytes] = set()     # guards against a cycle (forged records)
            cur: bytes | None = h
            while cur is not None and cur in metas and cur not in depth and cur not in on_path:
                path.append(cur)
                on_path.add(cur)
                cur = metas[cur].parent_hash
            d = depth[cur] + 1 if cur is not None and cur in depth else 0
            for p in reversed(path):
                depth[p] = d
                d += 1
        return sorted(metas.values(), key=lambda m: depth[m.block_hash])

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(len(self._index), self._bytes_used, self.capacity_bytes)

    def health(self) -> TierHealth:
        return self._health.snapshot()

    def close(self) -> None:
        """Nothing to flush (every put is a complete file); the files stay for the next
        run."""
