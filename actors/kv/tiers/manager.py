"""The tier manager: the KV blocks below the device pool (host RAM, local disk, a remote
store), what goes down to them, and what comes back at admission. Thread-safe; the only
threads of the tiers live here, so no transfer ever runs on the event loop or in a step.

Writes (``offer``: blocks the runner copied out of the device pool):
- a tier with write policy ``back`` receives a block when it leaves the tier above it
  (the device pool's evictions for the first tier, the first tier's evictions for the
  next, ...), so what leaves the pool goes down instead of vanishing;
- ``through``: a tier also receives every block the device commits (as it is computed);
- ``store_threshold`` N > 0: only blocks whose hash was looked up at least N times go to
  that tier (vLLM's ``store_threshold``; HiCache's selective write-through), so one-off
  prompts do not flood slow tiers.
Host writes happen in the caller's thread (a dict insert; the copy out of the device was
the runner's); disk and remote writes go to one writer thread per tier whose queue is
bounded in bytes: beyond it, writes are dropped and counted, never waited for.

Reads (``query``, then ``take_staged`` at admission): the planner (``planner.py``) decides
how many blocks after the device hit to restore; host blocks are staged at once (their
arrays are immutable, staging keeps a reference), disk and remote blocks are fetched by a
reader thread per tier, in parallel, under a deadline (a slow tier cannot delay a request
beyond what recomputing would have cost). Until the fetch ends the scheduler holds the
request out of admission (``query`` answers ``hold``) and ``notify`` is called with the
outcome; other requests and the step loop never wait for it. A block that fails (corrupt,
missing, the server gone) ends the restore there: the blocks before it are used, the rest
is recomputed. Fetched blocks are also put in the host tier (the next hit is cheaper).

Everything the tiers store is announced as KV events (``BlockStored``/``BlockRemoved``
with the tier's ``medium``), buffered here and drained by the KV manager actor so they go
out in order with the device's. A restarted daemon announces its disk tier's contents.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import structlog

from tokenloom.actors.kv.events import BlockRemoved, BlockStored, KVCacheEvent
from tokenloom.actors.kv.tiers.calibration import PredictionLog, TransferModel
from tokenloom.actors.kv.tiers.planner import (
    RecomputeCost,
    RestorePlan,
    TierCost,
    parse_mode,
    plan_restore,
)
from tokenloom.actors.kv.tiers.record import BlockMeta, BlockRecord, KVLayout
from tokenloom.actors.kv.tiers.stats import TierCounters, TiersStats, TierStats
from tokenloom.actors.kv.tiers.store import TierStore

log = structlog.get_logger("tokenloom.kv_tiers")

WRITE_POLICIES = ("back", "through", "off")
READ_BATCH = 8   # remote blocks per round trip of a restore
MAX_PENDING = 4096   # queried requests awaiting admission (their chains, their staging)
# Regret histogram upper bounds (seconds, signed: <= 0 means the choice beat the alternative).
REGRET_BUCKETS = (-1.0, -0.25, -0.1, -0.025, -0.005, 0.0, 0.005, 0.025, 0.1, 0.25, 1.0, 5.0)


class WritePolicy(msgspec.Struct, frozen=True):
    mode: str = "back"
    store_threshold: int = 0


class Staged(msgspec.Struct, gc=False):
    """A request's restored blocks, waiting for its admission: records for blocks
    ``start_block ..`` in order, the tier each came from, and the plan behind them."""
    start_block: int
    records: list[BlockRecord]
    tiers: list[str]
    plan: RestorePlan | None
    fetch_seconds: float = 0.0
    failed: str | None = None     # why the restore stopped short of the plan


class TierReport(msgspec.Struct, frozen=True, gc=False):
    """What ``notify`` tells the scheduler when a held request's fetch has ended."""
    request_id: str
    plan: dict | None
    staged_blocks: int
    fetch_seconds: float
    failed: str | None = None


class _Job:
    """A held request's fetch: ``cancelled`` when the request ended (nobody waits for the
    answer), ``stop`` when the deadline passed (readers stop; the answer still goes out)."""
    __slots__ = ("cancelled", "stop")

    def __init__(self) -> None:
        self.cancelled = False
        self.stop = False


class TierManager:
    def __init__(self, layout: KVLayout, stores: Sequence[TierStore],
                 policies: dict[str, WritePolicy], models: dict[str, TransferModel], *,
                 planner_mode: str = "cost", block_size: int = 16,
                 max_queued_write_bytes: int = 256 << 20, fetch_slack: float = 2.0) -> None:
        parse_mode(planner_mode)
        self.layout = layout
        self.block_size = block_size
        self.stores = list(stores)           # fastest first: host, disk, remote
        self.by_name = {s.name: s for s in self.stores}
        self.policies = {s.name: policies.get(s.name, WritePolicy()) for s in self.stores}
        self.models = models
        self.planner_mode = planner_mode
        self.fetch_slack = fetch_slack
        self.counters = {s.name: TierCounters() for s in self.stores}
        self._lock = threading.Lock()
        self._events: list[KVCacheEvent] = []
        self._lookups: OrderedDict[bytes, int] = OrderedDict()   # hash -> times looked up
        self._lookup_limit = 1 << 16
        self._staged: dict[str, Staged] = {}
        # Queried requests until admission: their chain and the recompute cost.
        self._queries: dict[str, tuple[list[bytes], RecomputeCost]] = {}
        self._jobs: dict[str, _Job] = {}
        self._max_queued = max_queued_write_bytes
        self._queued = {s.name: 0 for s in self.stores}
        self._readers = {s.name: cf.ThreadPoolExecutor(1, f"kv-tier-read-{s.name}")
                         for s in self.stores if s.name != "host"}
        self._writers = {s.name: cf.ThreadPoolExecutor(1, f"kv-tier-write-{s.name}")
                         for s in self.stores if s.name != "host"}
        self._planner = cf.ThreadPoolExecutor(2, "kv-tier-plan")
        self.notify: Callable[[TierReport], None] | None = None
        self.restores = 0
        self.restored_blocks = 0
        self._regret = [0] * (len(REGRET_BUCKETS) + 1)
        self._regret_sum = 0.0
        self._regret_count = 0
        self.restore_errors = PredictionLog()
        self.recompute_errors = PredictionLog()
        self._closed = False

    # ----------------------------------------------------------------- write side

    def wants(self, block_hash: bytes, committed: bool) -> bool:
        """Should the runner copy this device block out? ``committed``: it was just
        computed (write-through); else it is being evicted (write-back)."""
        for store in self._targets(committed):
            if self._eligible(store, block_hash) and not store.contains([block_hash]):
                return True
        return False

    def offer(self, metas: Sequence[BlockMeta], payloads: np.ndarray, committed: list[bool],
              seconds: float = 0.0) -> None:
        """Blocks copied out of the device pool (``payloads[i]`` is ``metas[i]``'s bytes;
        ``seconds``: the copy's time). Called from the runner's compute thread."""
        if not metas:
            return
        records = [BlockRecord(m, np.array(payloads[i], copy=True)) for i, m in enumerate(metas)]
        first = self.stores[0].name
        nbytes = len(records) * self.layout.block_bytes
        with self._lock:
            c = self.counters[first]
            c.bytes_from_device += nbytes
            c.seconds_from_device += seconds
        for rec, is_commit in zip(records, committed):
            for store in self._targets(is_commit):
                if self._eligible(store, rec.meta.block_hash):
                    self._write(store, rec)

    def _targets(self, committed: bool) -> list[TierStore]:
        """Tiers a device block goes to: write-through tiers on commit; on eviction, the
        first tier (whatever its policy but ``off``) and every ``through`` tier."""
        out = []
        for i, store in enumerate(self.stores):
            mode = self.policies[store.name].mode
            if mode == "off":
                continue
            if not committed and not getattr(store, "takes_evictions", True):
                continue      # the handoff tier carries computed blocks only
            if mode == "through" or (not committed and self._first_writable(i)):
                out.append(store)
        return out

    def _first_writable(self, index: int) -> bool:
        return all(self.policies[s.name].mode == "off" for s in self.stores[:index])

    def _eligible(self, store: TierStore, block_hash: bytes) -> bool:
        threshold = self.policies[store.name].store_threshold
        return threshold <= 0 or self._lookups.get(block_hash, 0) >= threshold

    def _write(self, store: TierStore, record: BlockRecord) -> None:
        if self._closed:          # (shutting down: the runner's last offloads are dropped)
            return
        if store.name not in self._writers:        # host: synchronous
            self._put(store, record)
            return
        nbytes = self.layout.block_bytes
        with self._lock:
            if self._queued[store.name] + nbytes > self._max_queued:
                self.counters[store.name].dropped_writes += 1
                return
            self._queued[store.name] += nbytes
        self._writers[store.name].submit(self._put_queued, store, record)

    def _put_queued(self, store: TierStore, record: BlockRecord) -> None:
        try:
            self._put(store, record)
        finally:
            with self._lock:
                self._queued[store.name] -= self.layout.block_bytes

    def _put(self, store: TierStore, record: BlockRecord) -> None:
        if self._closed:
            return
        t0 = time.perf_counter()
        evicted = store.put(record)
        dt = time.perf_counter() - t0
        stored = evicted.stored
        with self._lock:
            c = self.counters[store.name]
            announce = getattr(store, "announce_events", True)
            if stored:
                c.stored_blocks += 1
                if store.name != self.stores[0].name:
                    c.bytes_from_device += self.layout.block_bytes
                    c.seconds_from_device += dt
                m = record.meta
            if stored and announce:
                self._events.append(BlockStored(
                    block_hashes=[m.block_hash], parent_block_hash=m.parent_hash,
                    token_ids=list(m.token_ids), block_size=self.block_size,
                    medium=store.medium,
                    extra_keys=[(m.cache_salt,) if m.parent_hash is None and m.cache_salt
                                else None]))
            if evicted.hashes:
                c.evicted_blocks += len(evicted.hashes)
                self._events.append(BlockRemoved(block_hashes=list(evicted.hashes),
                                                 medium=store.medium))
        # What the tier pushed out goes down to the next tier that writes back.
        if evicted.records:
            below = self._next_back(store)
            if below is not None:
                for rec in evicted.records:
                    if self._eligible(below, rec.meta.block_hash):
                        self._write(below, rec)

    def _next_back(self, store: TierStore) -> TierStore | None:
        i = self.stores.index(store)
        for s in self.stores[i + 1:]:
            mode = self.policies[s.name].mode
            if mode == "back":
                return s
            if mode != "off":
                return None     # a write-through tier below already has it
        return None

    def drain_writes(self, timeout: float = 30.0) -> None:
        """Wait until every write queued so far has landed (benchmarks, tests, shutdown)."""
        futures = [pool.submit(lambda: None) for pool in self._writers.values()]
        cf.wait(futures, timeout=timeout)

    def drain_events(self) -> list[KVCacheEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out

    def announce_disk(self) -> int:
        """After a restart: announce what the disk tier already holds (parents first)."""
        disk = self.by_name.get("disk")
        if disk is None or not hasattr(disk, "metas"):
            return 0
        metas = disk.metas()
        with self._lock:
            for m in metas:
                self._events.append(BlockStored(
                    block_hashes=[m.block_hash], parent_block_hash=m.parent_hash,
                    token_ids=list(m.token_ids), block_size=self.block_size,
                    medium=disk.medium,
                    extra_keys=[(m.cache_salt,) if m.parent_hash is None and m.cache_salt
                                else None]))
        return len(metas)

    # ------------------------------------------------------------------ read side

    def query(self, request_id: str, hashes: Sequence[bytes], device_hit: int,
              prompt_len: int, recompute: RecomputeCost) -> TierReport | None:
        """A new request's chain (``hashes``: its reusable blocks) after ``device_hit``
        device hits. Returns None when the request must wait for ``notify`` (a fetch from
        disk or remote, or a remote lookup, is under way); else the report of a decision
        with nothing to wait for (host memory is read at admission, ``take_staged``)."""
        with self._lock:
            for h in hashes:
                self._lookups[h] = self._lookups.get(h, 0) + 1
                self._lookups.move_to_end(h)
            while len(self._lookups) > self._lookup_limit:
                self._lookups.popitem(last=False)
            self._queries[request_id] = (list(hashes), recompute)
            # Bounded: a request that never reached admission or cancel (a bug elsewhere)
            # must not grow these forever; the oldest entries go first.
            for table in (self._queries, self._staged):
                while len(table) > MAX_PENDING:
                    del table[next(iter(table))]
            for s in self.stores:
                self.counters[s.name].queries += max(0, len(hashes) - device_hit)
        rest = list(hashes[device_hit:])
        local = [s for s in self.stores if s.name != "remote"]
        runs = {s.name: tuple(s.present(rest)) for s in local} if rest else {}
        remote = self.by_name.get("remote")
        if remote is not None and rest and not self._remote_can_pay(
                len(rest), device_hit, prompt_len, recompute):
            remote = None     # even a full hit would lose to recomputing: skip the lookup
        slow = [s for s in local if s.name in self._readers]
        if not rest or (remote is None and not any(any(runs[s.name]) for s in slow)):
            plan = self._plan(device_hit, runs, prompt_len, recompute) if rest else None
            return TierReport(request_id, plan.as_dict(self.block_size) if plan else None,
                              0, 0.0)
        job = _Job()
        with self._lock:
            self._jobs[request_id] = job
        self._planner.submit(self._fetch_job, job, request_id, rest, device_hit, runs,
                             prompt_len, recompute)
        return None

    def _remote_can_pay(self, n: int, device_hit: int, prompt_len: int,
                        recompute: RecomputeCost) -> bool:
        """Could restoring all ``n`` blocks from the remote store beat recomputing them?
        If not (a slow link, a short prompt), its lookup — a round trip — is not worth
        making. Only the cost planner asks; the fixed rules always look."""
        if self.planner_mode != "cost":
            return True
        model = self.models["remote"]
        bs = self.block_size
        restore = model.predict(n * self.layout.block_bytes)
        return restore < recompute.seconds(device_hit * bs, (device_hit + n) * bs)

    def _tier_costs(self, runs: dict[str, tuple[bool, ...]]) -> list[TierCost]:
        out = []
        for s in self.stores:
            run = runs.get(s.name, ())
            if not any(run):
                continue
            model = self.models[s.name]
            with self._lock:
                queued = self._queued[s.name]
            # Reads go before writes (separate threads), but share the medium: count half
            # of the queued writes as the wait.
            wait = 0.5 * queued / model.bandwidth if queued else 0.0
            out.append(TierCost(s.name, run, model.latency_s, model.bandwidth, wait))
        return out

    def _plan(self, device_hit: int, runs: dict[str, tuple[bool, ...]], prompt_len: int,
              recompute: RecomputeCost) -> RestorePlan:
        return plan_restore(self.planner_mode, device_hit, self._tier_costs(runs),
                            self.block_size, self.layout.block_bytes, prompt_len, recompute)

    def _read_range(self, store: TierStore, hashes: Sequence[bytes],
                    job: _Job | None) -> list[BlockRecord]:
        """The leading blocks of ``hashes`` that read back intact (a remote store reads
        ``READ_BATCH`` blocks per round trip)."""
        out: list[BlockRecord] = []
        batch = READ_BATCH if hasattr(store, "get_many") else 1
        for i in range(0, len(hashes), batch):
            if job is not None and (job.cancelled or job.stop):
                break
            chunk = hashes[i:i + batch]
            got = store.get_many(chunk) if batch > 1 else [store.get(chunk[0])]
            for rec in got:
                if rec is None:
                    with self._lock:
                        self.counters[store.name].failed_reads += 1
                    return out
                out.append(rec)
        return out

    def _fetch_job(self, job: _Job, request_id: str, rest: list[bytes], device_hit: int,
                   runs: dict[str, tuple[bool, ...]], prompt_len: int,
                   recompute: RecomputeCost) -> None:
        t0 = time.perf_counter()
        plan, records, tiers, failed = None, [], [], None
        try:
            remote = self.by_name.get("remote")
            if remote is not None and self._remote_can_pay(len(rest), device_hit, prompt_len,
                                                           recompute):
                runs = {**runs, "remote": tuple(remote.present(rest))}
            plan = self._plan(device_hit, runs, prompt_len, recompute)
            records, tiers, failed = self._fetch(plan, rest, job)
            seconds = time.perf_counter() - t0
            if plan.num_restore_blocks and records and failed is None:
                self.restore_errors.add(plan.predicted_restore_s, seconds)
            # Fetched blocks are worth keeping in host memory for the next hit.
            host = self.stores[0]
            if host.name == "host":
                for rec, tier in zip(records, tiers):
                    if tier != "host":
                        self._put(host, rec)
        except Exception as e:  # noqa: BLE001 - a failed restore is a recompute, not a crash
            log.error("tier restore failed", request_id=request_id, error=repr(e))
            records, tiers, failed = [], [], repr(e)
        finally:
            # Whatever happened, the held request hears back (or it would wait forever).
            seconds = time.perf_counter() - t0
            with self._lock:
                self._jobs.pop(request_id, None)
                if not job.cancelled:
                    self._staged[request_id] = Staged(device_hit, records, tiers, plan,
                                                      seconds, failed)
            if not job.cancelled and self.notify is not None:
                self.notify(TierReport(request_id,
                                       plan.as_dict(self.block_size) if plan else None,
                                       len(records), seconds, failed))

    def _fetch(self, plan: RestorePlan, rest: list[bytes],
               job: _Job) -> tuple[list[BlockRecord], list[str], str | None]:
        """Each range from its tier, in parallel (slow tiers on their reader thread), under
        a deadline; the result is the contiguous run of blocks that arrived intact."""
        start = plan.start_block
        futures = []
        for name, a, b in plan.ranges:
            store = self.by_name[name]
            hashes = rest[a - start:b - start]
            if name in self._readers:
                futures.append((name, a, b, self._readers[name].submit(
                    self._timed_read, store, hashes, job)))
            else:
                fut: cf.Future = cf.Future()
                fut.set_result(self._timed_read(store, hashes, job))
                futures.append((name, a, b, fut))
        # The cost planner gives up on a fetch that outlasts recomputing (twice over); the
        # fixed rules wait, as the engines they stand for do.
        deadline = (self.fetch_slack * plan.all_recompute_s + 0.05 if plan.mode == "cost"
                    else 120.0)
        done, _ = cf.wait([f for *_, f in futures], timeout=deadline)
        records: list[BlockRecord] = []
        tiers: list[str] = []
        failed = None
        for name, a, b, fut in futures:
            if fut not in done:
                job.stop = True         # stops the reader at its next block
                failed = f"{name} too slow: no answer within {deadline * 1e3:.0f} ms"
                break
            got = fut.result()
            records += got
            tiers += [name] * len(got)
            if len(got) < b - a:
                failed = f"{name} returned {len(got)} of {b - a} blocks"
                break
        return records, tiers, failed

    def _timed_read(self, store: TierStore, hashes: Sequence[bytes],
                    job: _Job) -> list[BlockRecord]:
        t0 = time.perf_counter()
        got = self._read_range(store, hashes, job)
        dt = time.perf_counter() - t0
        if got:
            self.models[store.name].observe(len(got) * self.layout.block_bytes, dt)
        return got

    def take_staged(self, request_id: str, device_hit: int,
                    prompt_len: int) -> Staged | None:
        """At admission, with ``device_hit`` blocks hit on the device now: the fetched
        staging if it continues the device hit, else a restore from host memory planned
        now (the device may have lost blocks since the query, which host memory may have
        received meanwhile)."""
        with self._lock:
            staged = self._staged.pop(request_id, None)
            query = self._queries.pop(request_id, None)
        if staged is not None and staged.records and \
                staged.start_block <= device_hit < staged.start_block + len(staged.records):
            return staged
        host = self.stores[0] if self.stores and self.stores[0].name == "host" else None
        if query is None or host is None:
            return None
        hashes, recompute = query
        rest = hashes[device_hit:]
        run = tuple(host.present(rest))
        if not run or not run[0]:
            return None
        plan = self._plan(device_hit, {host.name: run}, prompt_len, recompute)
        records = self._read_range(host, rest[:plan.num_restore_blocks], None)
        return Staged(device_hit, records, [host.name] * len(records), plan)

    def cancel(self, request_id: str) -> None:
        """The request ended before admission: drop its staging, stop its fetch."""
        with self._lock:
            self._staged.pop(request_id, None)
            self._queries.pop(request_id, None)
            job = self._jobs.pop(request_id, None)
        if job is not None:
            job.cancelled = True

    def restored(self, tiers: Sequence[str]) -> None:
        """An admission restored these blocks (one tier name per block) into the device."""
        if not tiers:
            return
        with self._lock:
            self.restores += 1
            self.restored_blocks += len(tiers)
            for name in tiers:
                c = self.counters[name]
                c.hits += 1
                c.bytes_to_device += self.layout.block_bytes

    def observe_restore_copy(self, seconds: float) -> None:
        """The runner's copy of restored blocks into the device pool."""
        with self._lock:
            self.counters[self.stores[0].name].seconds_to_device += seconds

    def observe_outcome(self, predicted_recompute_s: float, actual_recompute_s: float,
                        regret_s: float | None) -> None:
        """A restored (or planned) request's prefill finished: the recompute prediction's
        error and the decision's regret (actual minus the better alternative's
        prediction; <= 0 when the choice beat the alternative)."""
        self.recompute_errors.add(predicted_recompute_s, actual_recompute_s)
        if regret_s is None:
            return
        with self._lock:
            i = 0
            while i < len(REGRET_BUCKETS) and regret_s > REGRET_BUCKETS[i]:
                i += 1
            self._regret[i] += 1
            self._regret_sum += regret_s
            self._regret_count += 1

    # ------------------------------------------------------------- observation

    @property
    def degraded(self) -> dict[str, str]:
        out = {}
        for s in self.stores:
            h = s.health()
            if h.degraded:
                out[s.name] = h.reason or "degraded"
        return out

    def stats(self) -> TiersStats:
        tiers = []
        for s in self.stores:
            u, h = s.usage(), s.health()
            with self._lock:
                counters = msgspec.structs.replace(self.counters[s.name])
            tiers.append(TierStats(
                name=s.name, medium=s.medium, write_policy=self.policies[s.name].mode,
                store_threshold=self.policies[s.name].store_threshold,
                num_blocks=u.num_blocks, bytes_used=u.bytes_used,
                bytes_capacity=u.bytes_capacity, degraded=h.degraded,
                degraded_reason=h.reason, counters=counters,
                transfer_model=self.models[s.name].as_dict()))
        with self._lock:
            cumulative, acc = [], 0
            for n in self._regret[:-1]:
                acc += n
                cumulative.append(acc)
            return TiersStats(
                planner=self.planner_mode, tiers=tiers, held_requests=len(self._jobs),
                restores=self.restores, restored_blocks=self.restored_blocks,
                regret_buckets=list(REGRET_BUCKETS), regret_counts=cumulative,
                regret_count=self._regret_count, regret_sum=self._regret_sum,
                restore_error_median=self.restore_errors.median(),
                recompute_error_median=self.recompute_errors.median())

    def close(self, drain_timeout: float = 5.0) -> None:
        """Let the writes already queued land (up to `drain_timeout` seconds: a graceful
        stop of a prefill worker must not lose the handoff blocks its last requests wrote
        through), then drop what is left and close the stores."""
        if self._writers and drain_timeout > 0:
            self.drain_writes(timeout=drain_timeout)
        self._closed = True
        for pool in (*self._readers.values(), *self._writers.values(), self._planner):
            pool.shutdown(wait=True, cancel_futures=True)
        for s in self.stores:
            s.close()
