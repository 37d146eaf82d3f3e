"""The front's record of disaggregated requests in flight: `HandoffLedger`. Pure (no asyncio).

A handoff is one request whose prompt is prefilled on a prefill worker and decoded on a
decode worker (docs/disaggregation.md). Its states:

    prefilling -> transferring -> decoding -> claimed       (the normal path)
         \\             \\            \\-> (decode worker died before its first token:
          \\             \\                re-homed, decoding again on another worker)
           \\             \\-> aborted   (the client left)
            \\-> (prefill worker died or failed: the decode worker prefills what the
                 handoff tier does not hold; only the missing suffix is recomputed)

Its blocks live in the handoff tier (actors/kv/tiers/handoff.py: one file per block hash
in a directory shared by the workers) under a lease held here from the moment the prefill
is dispatched: a file is deleted only when no live handoff needs its hash, i.e. when the
decode side has claimed it (its first token exists, so its restore is over), the request
ended, or the lease expired (`lease_seconds` after the prefill finished: the decode side
then recomputes instead). `sweep` also deletes files that no lease covers once they are
older than `grace_seconds` (a prefill worker's late write for a handoff already released),
so the directory holds only what live handoffs need.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from tokenloom.actors.kv.tiers.handoff import SUFFIX, handoff_file, remove_blocks
from tokenloom.actors.messages import AddRequest


def make_dir(configured: str, budget_bytes: int) -> Path:
    """A fresh handoff-tier directory: under `configured` when set, else in shared memory
    (/dev/shm) when the host has room for the budget there, else in the temp dir."""
    if configured:
        base = Path(configured)
        base.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="tokenloom-handoff-", dir=base))
    shm = Path("/dev/shm")
    try:
        roomy = shm.is_dir() and shutil.disk_usage(shm).free >= budget_bytes
    except OSError:
        roomy = False
    return Path(tempfile.mkdtemp(prefix="tokenloom-handoff-", dir=shm if roomy else None))


# Histogram upper bounds of one handoff's restore on the decode side.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BYTES_BUCKETS = tuple(float(1 << k) for k in range(16, 34, 2))    # 64 KiB .. 8 GiB


class Histogram:
    """A histogram: a count per bucket (`bounds` are upper bounds, the last bucket is
    +Inf) and the sum; /metrics makes the counts cumulative, as Prometheus wants. Pure."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, x: float) -> None:
        i = next((i for i, b in enumerate(self.bounds) if x <= b), len(self.bounds))
        self.counts[i] += 1
        self.sum += x

    def as_dict(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


@dataclasses.dataclass
class Handoff:
    request: AddRequest | None        # None: a handoff between daemons (daemon/kv_transfer)
    prefill_worker: int
    decode_worker: int
    hashes: list[bytes]
    state: str = "prefilling"
    opened: float = 0.0
    prefill_done: float | None = None
    expires: float | None = None      # set when the prefill ends
    rehomed: int = 0


class HandoffLedger:
    def __init__(self, root: str | os.PathLike, lease_seconds: float,
                 grace_seconds: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.root = root
        self.lease_seconds = lease_seconds
        self.grace_seconds = grace_seconds
        self.clock = clock
        self.handoffs: dict[str, Handoff] = {}
        self._held: Counter[bytes] = Counter()     # hash -> live handoffs needing it
        self.counts: Counter[str] = Counter()      # outcome -> handoffs
        self.files_removed = 0
        self.transfer_seconds = Histogram(SECONDS_BUCKETS)
        self.transfer_bytes = Histogram(BYTES_BUCKETS)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.handoffs

    def get(self, request_id: str) -> Handoff | None:
        return self.handoffs.get(request_id)

    def open(self, request: AddRequest | None, prefill_worker: int, decode_worker: int,
             hashes: list[bytes], request_id: str | None = None) -> Handoff:
        rid = request.request_id if request is not None else request_id
        if rid in self.handoffs:
            raise ValueError(f"request {rid!r} already has a handoff in flight")
        h = Handoff(request, prefill_worker, decode_worker, list(hashes), opened=self.clock())
        self.handoffs[rid] = h
        self._held.update(set(h.hashes))
        self.counts["started"] += 1
        return h

    def prefilled(self, request_id: str) -> Handoff | None:
        """The prefill half ended: the lease now runs out `lease_seconds` from here."""
        h = self.handoffs.get(request_id)
        if h is not None and h.state == "prefilling":
            now = self.clock()
            h.state, h.prefill_done, h.expires = "transferring", now, now + self.lease_seconds
        return h

    def missing(self, request_id: str) -> int:
        """Blocks of the handoff not (yet) in the handoff tier."""
        h = self.handoffs.get(request_id)
        if h is None:
            return 0
        return sum(not handoff_file(self.root, x).exists() for x in h.hashes)

    def decoding(self, request_id: str) -> None:
        h = self.handoffs.get(request_id)
        if h is not None:
            h.state = "decoding"
            if h.expires is None:          # sent on without a finished prefill (its worker died)
                h.expires = self.clock() + self.lease_seconds

    def renew(self, request_id: str) -> None:
        """Another lease period for a handoff its decode worker holds but has not started."""
        h = self.handoffs.get(request_id)
        if h is not None:
            h.expires = self.clock() + self.lease_seconds
            self.counts["renewed"] += 1

    def close(self, request_id: str, outcome: str) -> Handoff | None:
        """The handoff is over (`claimed`, `aborted`, `failed`, `expired`): its blocks are
        released, and deleted where no other live handoff needs them."""
        h = self.handoffs.pop(request_id, None)
        if h is None:
            return None
        free = []
        for x in set(h.hashes):
            self._held[x] -= 1
            if self._held[x] <= 0:
                del self._held[x]
                free.append(x)
        self.files_removed += remove_blocks(self.root, free)
        self.counts[outcome] += 1
        return h

    def expired(self) -> list[str]:
        """Handoffs whose lease ran out before their decode side claimed the blocks."""
        now = self.clock()
        return [rid for rid, h in self.handoffs.items()
                if h.expires is not None and now > h.expires]

    def sweep(self) -> int:
        """Delete files no live handoff covers, older than `grace_seconds`."""
        now = time.time()
        n = 0
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return 0
        for entry in entries:
            if not entry.name.endswith(SUFFIX):
                continue
            try:
                h = bytes.fromhex(entry.name[:-len(SUFFIX)])
                if h in self._held or now - entry.stat().st_mtime < self.grace_seconds:
                    continue
                os.unlink(entry.path)
                n += 1
            except (ValueError, OSError):
                continue
        self.files_removed += n
        return n

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        self.transfer_bytes.observe(nbytes)
        self.transfer_seconds.observe(seconds)

    def stats(self) -> dict:
        states = Counter(h.state for h in self.handoffs.values())
        return {"dir": str(self.root), "in_flight": len(self.handoffs),
                "by_state": dict(states), "leased_blocks": len(self._held),
                "outcomes": dict(self.counts), "files_removed": self.files_removed,
                "bytes_transferred": int(self.transfer_bytes.sum),
                "transfer_seconds": self.transfer_seconds.as_dict(),
                "transfer_bytes": self.transfer_bytes.as_dict()}
