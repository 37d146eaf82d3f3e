"""The KV tiers' counters and stats, as /metrics, admin stats and the worker wire carry
them (typed, so they decode back into these structs across processes)."""

from __future__ import annotations

import msgspec


class TierCounters(msgspec.Struct, kw_only=True, gc=False):
    """One tier's monotonic counters (``/metrics``, admin stats)."""
    queries: int = 0            # blocks looked up in this tier (after the device's hits)
    hits: int = 0               # blocks restored from this tier into the device
    stored_blocks: int = 0
    evicted_blocks: int = 0
    dropped_writes: int = 0     # writes refused because the writer's queue was full
    failed_reads: int = 0
    bytes_to_device: int = 0
    seconds_to_device: float = 0.0
    bytes_from_device: int = 0
    seconds_from_device: float = 0.0


class TierStats(msgspec.Struct, kw_only=True, gc=False):
    name: str
    medium: str
    write_policy: str
    store_threshold: int
    num_blocks: int
    bytes_used: int
    bytes_capacity: int
    degraded: bool
    degraded_reason: str | None
    counters: TierCounters
    transfer_model: dict


class TiersStats(msgspec.Struct, kw_only=True, gc=False):
    planner: str
    tiers: list[TierStats]
    held_requests: int
    restores: int
    restored_blocks: int
    regret_buckets: list[float]
    regret_counts: list[int]          # cumulative per bucket, Prometheus-style
    regret_count: int
    regret_sum: float
    restore_error_median: float | None
    recompute_error_median: float | None
