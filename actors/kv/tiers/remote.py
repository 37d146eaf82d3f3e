"""The remote KV tier: a Redis-protocol server (Redis, Valkey, ...) shared by several daemons.

Every block is one key, ``tokenloom:kv:<layout.tag>:<block_hash.hex()>``, holding
``record.encode(record, layout)``. Daemons serving the same model with the same KV layout
share blocks through it; the layout tag in the key keeps other layouts apart, and the chain
hash (which covers the model and the ``cache_salt``) keeps other models and tenants apart.
The server evicts by its own policy (``maxmemory-policy``) and optional ``ttl_s``; this store
never evicts, so ``put`` always returns an empty ``Evicted``.

A dead or slow server must not slow serving down: every command has ``timeout_s``, and after
a failure the store answers "absent" / does nothing, without touching the network, for
``retry_after_s`` seconds. The first call after that window tries again (reconnecting), and
its success clears ``health()``. Values are verified on ``get``; a corrupt one is deleted.

``shaping=(latency_s, bytes_per_s)`` emulates a slower link client-side for benchmarks
(a loopback server answers in microseconds): after each read round trip (lookups and gets;
writes run on their own thread, off every request's path) the caller sleeps
``latency_s + nbytes / bytes_per_s``. Not for production use.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tokenloom.actors.kv.tiers.record import BlockRecord, CorruptRecord, KVLayout, decode, encode
from tokenloom.actors.kv.tiers.store import (
    MEDIUM_REMOTE,
    Evicted,
    HealthTracker,
    TierHealth,
    TierUsage,
)

KEY_PREFIX = "tokenloom:kv"


class RemoteStore:
    """Blocks as keys on a shared Redis-protocol server at ``url`` (``redis://host:port/db``).
    Thread-safe (redis-py's client keeps a connection pool)."""

    name = "remote"
    medium = MEDIUM_REMOTE

    def __init__(self, layout: KVLayout, url: str, timeout_s: float = 0.5,
                 ttl_s: int | None = None, retry_after_s: float = 1.0,
                 shaping: tuple[float, float] | None = None) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if shaping is not None and (shaping[0] < 0 or shaping[1] <= 0):
            raise ValueError(f"shaping needs latency_s >= 0 and bytes_per_s > 0, got {shaping}")
        self.layout = layout
        self.url = url
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s
        self.shaping = shaping
        self._prefix = f"{KEY_PREFIX}:{layout.tag}:"
        # One immediate retry: it replaces a pooled connection that went stale while the
        # server restarted. More would multiply the cost of a dead server.
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s,
                                            retry=Retry(NoBackoff(), 1))
        self._health = HealthTracker()
        self._lock = threading.Lock()
        self._down_until = 0.0      # time.monotonic() before which the server is skipped
        self._num_blocks = 0        # written by this daemon, minus what it discarded
        self._bytes_used = 0

    def key(self, block_hash: bytes) -> str:
        return self._prefix + block_hash.hex()

    # -- failure window and shaping ---------------------------------------------------

    def _skipping(self) -> bool:
        return time.monotonic() < self._down_until

    def _failed(self, what: str, e: BaseException) -> None:
        self._down_until = time.monotonic() + self.retry_after_s
        self._health.fail(f"remote {what} failed: {type(e).__name__}: {e}")

    def _shape(self, nbytes: int) -> None:
        if self.shaping is not None:
            latency_s, bytes_per_s = self.shaping
            time.sleep(latency_s + nbytes / bytes_per_s)

    # -- TierStore --------------------------------------------------------------------

    def contains(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for found in self.present(hashes):
            if not found:
                break
            n += 1
        return n

    def present(self, hashes: Sequence[bytes]) -> list[bool]:
        """Which of ``hashes`` the server holds: one pipeline of EXISTS."""
        if not hashes or self._skipping():
            return [False] * len(hashes)
        try:
            pipe = self._client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self.key(h))
            found = pipe.execute()
        except (redis.RedisError, OSError) as e:
            self._failed("contains", e)
            return [False] * len(hashes)
        self._health.ok()
        self._shape(0)
        return [bool(f) for f in found]

    def get_many(self, hashes: Sequence[bytes]) -> list[BlockRecord | None]:
        """Several blocks in one round trip (MGET): what a restore reads, a few blocks at a
        time. Each entry as ``get`` would answer it."""
        if not hashes:
            return []
        if self._skipping():
            return [None] * len(hashes)
        keys = [self.key(h) for h in hashes]
        try:
            values = self._client.mget(keys)
        except (redis.RedisError, OSError) as e:
            self._failed("get", e)
            return [None] * len(hashes)
        self._shape(sum(len(v) for v in values if v))
        out: list[BlockRecord | None] = []
        for h, key, data in zip(hashes, keys, values):
            if data is None:
                out.append(None)
                continue
            try:
                out.append(decode(data, self.layout, expect_hash=h))
            except CorruptRecord as e:
                self._health.fail(f"remote block {h.hex()[:12]}: {e}")
                try:
                    self._client.delete(key)
                except (redis.RedisError, OSError) as e2:
                    self._failed("delete", e2)
                out.append(None)
        if all(r is not None for r in out):
            self._health.ok()
        return out

    def get(self, block_hash: bytes) -> BlockRecord | None:
        if self._skipping():
            return None
        key = self.key(block_hash)
        try:
            data = self._client.get(key)
        except (redis.RedisError, OSError) as e:
            self._failed("get", e)
            return None
        self._shape(len(data) if data else 0)
        if data is None:
            self._health.ok()
            return None
        try:
            record = decode(data, self.layout, expect_hash=block_hash)
        except CorruptRecord as e:
            self._health.fail(f"remote block {block_hash.hex()[:12]}: {e}")
            try:
                self._client.delete(key)
            except (redis.RedisError, OSError) as e2:
                self._failed("delete", e2)
            return None
        self._health.ok()
        return record

    def put(self, record: BlockRecord) -> Evicted:
        if self._skipping():
            return Evicted()
        key = self.key(record.meta.block_hash)
        data = encode(record, self.layout)   # ValueError for a wrong payload: misuse
        try:
            if self.ttl_s is None:
                created = self._client.set(key, data, nx=True)
            else:
                # NX keeps a copy another daemon wrote; EXPIRE refreshes its ttl either way
                # (a block in use stays), in the same round trip.
                pipe = self._client.pipeline(transaction=False)
                pipe.set(key, data, nx=True, ex=self.ttl_s)
                pipe.expire(key, self.ttl_s)
                created = pipe.execute()[0]
        except (redis.RedisError, OSError) as e:
            self._failed("put", e)
            return Evicted()
        self._health.ok()
        if created:
            with self._lock:
                self._num_blocks += 1
                self._bytes_used += len(data)
        return Evicted(stored=bool(created))

    def discard(self, block_hash: bytes) -> None:
        if self._skipping():
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.strlen(self.key(block_hash))
            pipe.delete(self.key(block_hash))
            size, deleted = pipe.execute()
        except (redis.RedisError, OSError) as e:
            self._failed("discard", e)
            return
        self._health.ok()
        if deleted:
            with self._lock:
                self._num_blocks = max(0, self._num_blocks - 1)
                self._bytes_used = max(0, self._bytes_used - size)
        self._shape(0)

    def usage(self) -> TierUsage:
        """Blocks written by this daemon minus those it discarded (counting the server's
        keys would be too slow; expiry and the server's evictions are not seen). Capacity 0:
        the server bounds it."""
        with self._lock:
            return TierUsage(self._num_blocks, self._bytes_used, 0)

    def health(self) -> TierHealth:
        return self._health.snapshot()

    def close(self) -> None:
        self._client.close()
