"""Which engine worker a request goes to: the pure core of the router (no asyncio, no torch).

Prefix-aware routing (policy "prefix") prices each worker in prefill blocks:

    cost(w) = blocks of the prompt w must compute (its prompt blocks minus the expected
              prefix overlap on w)
            + blocks of prompt still queued for prefill on w
            + decode_weight * requests decoding on w
            + blocks the request needs beyond w's free blocks (it would evict or preempt)

            + ADAPTER_MISS_BLOCKS when the request names a LoRA adapter w does not hold

and takes the cheapest. Equal costs go to the worker named by the request's affinity key
(`user` / tenant: the same client keeps its worker), then to the worker with fewer requests
in flight, then in turn, so a cold start spreads groups instead of piling onto worker 0.

The expected overlap of a worker is the number of leading prompt blocks it holds, as the
hashes (actors/kv/block_hash.py, same identity and salt as the workers compute them) its KV
events reported stored and not yet removed, together with the hashes of prompts routed there
recently (a time-to-live index). The routed index covers the gap before a worker's events
confirm a prompt (a burst of one group arriving together), and is the whole index when a
worker publishes no events (prefix caching off): then it is an approximation that expires.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Sequence

from tokenloom.actors.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

POLICIES = ("prefix", "round_robin", "least_load")
# A worker without the request's LoRA adapter must load it into a slot first (and may evict
# one another request wants): priced as one prompt block, so between equally loaded workers
# with the same prefix the one holding the adapter wins, while a real prefix or load
# difference still decides. (The adapter's prefix blocks already count: its block hashes
# include the adapter, so only a worker that ran it holds them.)
ADAPTER_MISS_BLOCKS = 1.0


class PrefixIndex:
    """What one worker holds: hashes its KV events stored (until removed), and hashes of
    prompts routed to it, each expiring `ttl` seconds after it was last routed. The routed
    index is bounded (`max_routed`, least recently routed dropped first)."""

    def __init__(self, ttl: float, max_routed: int = 200_000):
        self.ttl = ttl
        self.max_routed = max_routed
        # hash -> the media holding it (GPU, and the KV tiers' CPU/DISK/REMOTE): a block in
        # any of them spares the prefill, and a tier's eviction must not hide the device's.
        self.stored: dict[bytes, set[str | None]] = {}
        self.routed: OrderedDict[bytes, float] = OrderedDict()   # hash -> expiry
        self.num_events = 0

    def apply(self, event: KVEvent) -> None:
        self.num_events += 1
        match event:
            case BlockStored(block_hashes=hashes, medium=medium):
                for h in hashes:
                    self.stored.setdefault(h, set()).add(medium)
            case BlockRemoved(block_hashes=hashes, medium=medium):
                for h in hashes:
                    media = self.stored.get(h)
                    if media is not None:
                        media.discard(medium)
                        if not media:
                            del self.stored[h]
                    if h not in self.stored:
                        self.routed.pop(h, None)   # evicted: the routed guess is stale too
            case AllBlocksCleared():
                self.clear()

    def clear(self) -> None:
        self.stored.clear()
        self.routed.clear()

    def note_routed(self, hashes: Sequence[bytes], now: float) -> None:
        expiry = now + self.ttl
        for h in hashes:
            self.routed[h] = expiry
            self.routed.move_to_end(h)
        while len(self.routed) > self.max_routed:
            self.routed.popitem(last=False)

    def overlap(self, hashes: Sequence[bytes], now: float) -> int:
        """Leading blocks of `hashes` this worker is expected to hold (a chain: a block
        is only reusable when every block before it is)."""
        n = 0
        for h in hashes:
            if h in self.stored:
                n += 1
                continue
            expiry = self.routed.get(h)
            if expiry is None or expiry < now:
                break
            n += 1
        return n

    def expire(self, now: float) -> None:
        """Drop expired routed entries (oldest first; cheap when called regularly)."""
        while self.routed:
            h, expiry = next(iter(self.routed.items()))
            if expiry >= now:
                break
            del self.routed[h]


@dataclasses.dataclass
class WorkerLoad:
    """The router's own account of one worker (it routed every request there, so it knows
    them exactly), plus what the worker last reported about its KV pool."""
    up: bool = False
    in_flight: int = 0
    queued_prefill_blocks: int = 0      # routed, first token not yet seen: blocks to compute
    decoding: int = 0                   # first token seen, not finished
    free_blocks: int | None = None      # reported; None until the first report
    kv_usage: float = 0.0               # reported
    # LoRA adapters it holds: as last reported, plus those routed to it since.
    adapters: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(frozen=True)
class RouteDecision:
    worker: int
    policy: str
    reason: str                  # prefix | affinity | balance | sibling | round_robin | ...
    prompt_blocks: int
    expected_hit_blocks: int
    costs: tuple[float | None, ...] = ()   # per worker (None: down); prefix/least_load only
    # Disaggregation: the worker that prefills it (None: prefilled where it decodes) and
    # the choice with its prediction (actors/front/disaggregation.py).
    prefill_worker: int | None = None
    handoff: dict | None = None

    def as_dict(self) -> dict:
        out = {"worker": self.worker, "policy": self.policy, "reason": self.reason,
               "prompt_blocks": self.prompt_blocks,
               "expected_hit_blocks": self.expected_hit_blocks,
               "costs": list(self.costs)}
        if self.handoff is not None:
            out["prefill_worker"] = self.prefill_worker
            out["disaggregation"] = self.handoff
        return out


class RoutingCore:
    """Chooses workers and keeps the load account. Not thread-safe; owned by one actor."""

    def __init__(self, num_workers: int, policy: str = "prefix", decode_weight: float = 1.0,
                 ttl: float = 120.0):
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.decode_weight = decode_weight
        self.loads = [WorkerLoad() for _ in range(num_workers)]
        self.indexes = [PrefixIndex(ttl) for _ in range(num_workers)]
        self._turn = itertools.count()
        # Per worker since start-up: requests routed, prompt blocks and expected hit blocks.
        self.num_routed = [0] * num_workers
        self.prompt_blocks = [0] * num_workers
        self.expected_hit_blocks = [0] * num_workers

    @property
    def num_workers(self) -> int:
        return len(self.loads)

    def up_workers(self) -> list[int]:
        return [i for i, w in enumerate(self.loads) if w.up]

    # -- choosing ------------------------------------------------------------------------
    def cost(self, w: int, hashes: Sequence[bytes], need_blocks: int, now: float,
             prefix_aware: bool = True, adapter: str | None = None) -> tuple[float, int]:
        """(cost in blocks, expected overlap) of sending a request to worker `w`."""
        load = self.loads[w]
        overlap = self.indexes[w].overlap(hashes, now) if prefix_aware else 0
        to_compute = need_blocks - overlap
        cost = (len(hashes) - overlap) + load.queued_prefill_blocks \
            + self.decode_weight * load.decoding
        if load.free_blocks is not None:
            cost += max(0, to_compute - load.free_blocks)
        if adapter is not None and adapter not in load.adapters:
            cost += ADAPTER_MISS_BLOCKS
        return cost, overlap

    def choose(self, hashes: Sequence[bytes], need_blocks: int, now: float,
               affinity: int | None = None, adapter: str | None = None,
               among: Sequence[int] | None = None) -> RouteDecision | None:
        """The worker for a request whose full prompt blocks hash to `hashes` and that needs
        `need_blocks` blocks in all; `affinity`: the worker its affinity key last went to;
        `among`: the workers of the role it needs (None: any). None when none is up."""
        up = [w for w in self.up_workers() if among is None or w in among]
        if not up:
            return None
        n = len(hashes)
        if self.policy == "round_robin":
            w = self._next_in_turn(up)
            return RouteDecision(w, self.policy, "round_robin", n,
                                 self.indexes[w].overlap(hashes, now))
        prefix_aware = self.policy == "prefix"
        costs: list[float | None] = [None] * self.num_workers
        overlaps = [0] * self.num_workers
        for w in up:
            costs[w], overlaps[w] = self.cost(w, hashes, need_blocks, now, prefix_aware,
                                              adapter)
        best = min(costs[w] for w in up)
        tied = [w for w in up if costs[w] <= best + 1e-9]
        if len(tied) == 1:
            w = tied[0]
            reason = "prefix" if overlaps[w] else "balance"
        elif affinity is not None and affinity in tied:
            w, reason = affinity, "affinity"
        else:
            fewest = min(self.loads[w].in_flight for w in tied)
            w = self._next_in_turn([w for w in tied if self.loads[w].in_flight == fewest])
            reason = "balance"
        return RouteDecision(w, self.policy, reason, n, overlaps[w], tuple(costs))

    def _next_in_turn(self, candidates: list[int]) -> int:
        return candidates[next(self._turn) % len(candidates)]

    # -- the account ---------------------------------------------------------------------
    def routed(self, d: RouteDecision, hashes: Sequence[bytes], now: float,
               adapter: str | None = None) -> int:
        """Record a decision; returns the prefill blocks charged to the worker (pass them
        back to `first_token`/`finished`)."""
        load = self.loads[d.worker]
        charged = d.prompt_blocks - d.expected_hit_blocks
        load.in_flight += 1
        load.queued_prefill_blocks += charged
        self.num_routed[d.worker] += 1
        self.prompt_blocks[d.worker] += d.prompt_blocks
        self.expected_hit_blocks[d.worker] += d.expected_hit_blocks
        self.indexes[d.worker].note_routed(hashes, now)
        if adapter is not None:
            load.adapters.add(adapter)
        return charged

    def first_token(self, w: int, charged: int) -> None:
        load = self.loads[w]
        load.queued_prefill_blocks -= charged
        load.decoding += 1

    def finished(self, w: int, charged: int, started: bool) -> None:
        """A request routed to `w` ended; `started`: its first token had been seen."""
        load = self.loads[w]
        load.in_flight -= 1
        if started:
            load.decoding -= 1
        else:
            load.queued_prefill_blocks -= charged
        assert load.in_flight >= 0 and load.decoding >= 0 and load.queued_prefill_blocks >= 0, \
            f"worker {w}'s load account went negative: {load}"

    def worker_up(self, w: int) -> None:
        self.loads[w] = WorkerLoad(up=True)
        self.indexes[w].clear()   # a fresh process holds nothing

    def worker_down(self, w: int) -> None:
        """The worker died: its requests are gone (their streams end with an error, and
        `finished` is not called for them) and so is its cache."""
        self.loads[w] = WorkerLoad(up=False)
        self.indexes[w].clear()

    def reported(self, w: int, free_blocks: int, kv_usage: float,
                 adapters: list[str] | None = None) -> None:
        self.loads[w].free_blocks = free_blocks
        self.loads[w].kv_usage = kv_usage
        if adapters is not None:   # what its slots hold now (routing adds between reports)
            self.loads[w].adapters = set(adapters)
