"""The restore planner: which leading blocks of a request's prompt to bring back from a
tier, and which to recompute. Pure (no threads, no I/O).

At admission the device pool holds blocks ``0 .. h-1`` of the request's chain (a device
hit costs nothing). Each tier holds some of the blocks after those; the restorable ones
are the leading run ``h .. h+a-1`` that some tier holds. For a split point ``k`` (``h <=
k <= h + a``), blocks ``h .. k-1`` are restored, each from the fastest tier holding it, and
tokens from ``k * block_size`` on are recomputed:

    ttft(k) = restore(k) + recompute(k * block_size, prompt_len)
    restore(k) = max over the tiers used of (queue wait + latency + bytes / bandwidth)

(tiers are read in parallel; the per-tier models are ``calibration.TransferModel``s
learned from completed transfers). ``recompute`` is the engine's own step-cost model
(``actors/scheduling/cost_model.py``) at the current load: the suffix is prefilled in
chunks of the current chunk budget, each chunk's step also carrying the running decodes,
so a loaded engine makes recomputing dearer and restoring relatively cheaper. The chosen
``k`` minimises ``ttft``; the other modes exist to compare against (benchmarks/kv_tiers.py):
``always_restore`` (vLLM's offloading rule), ``always_recompute`` (tiers off) and
``threshold:N`` (restore everything available when it is at least N tokens, else nothing:
LMCache's ``min_retrieve_tokens``, SGLang HiCache's prefetch threshold).

Not modelled: the suffix's prefill cannot start before the restore is staged (the request
waits for its blocks), so the two times add instead of overlapping.
"""

from __future__ import annotations

import msgspec

from tokenloom.actors.scheduling.cost_model import attention_work

MODES = ("cost", "always_restore", "always_recompute")


def parse_mode(mode: str) -> tuple[str, int]:
    """(``cost`` | ``always_restore`` | ``always_recompute`` | ``threshold``, N tokens)."""
    if mode in MODES:
        return mode, 0
    if mode.startswith("threshold:"):
        tail = mode.removeprefix("threshold:")
        if tail.isdigit():
            return "threshold", int(tail)
    raise ValueError(f"planner mode {mode!r}: expected one of {', '.join(MODES)} or "
                     f"threshold:N (N tokens)")


class RecomputeCost(msgspec.Struct, frozen=True, gc=False):
    """The engine's prefill cost at the load of the moment of the query: the step-cost
    coefficients (``None`` before the model is fitted: ``prior_s_per_token`` is used), the
    running decodes (their tokens and keys read, in millions) that every chunk's step
    carries, and the chunk budget that splits the suffix into steps."""
    coef: tuple[float, ...] | None
    decode_tokens: int = 0
    decode_reads: float = 0.0
    chunk_tokens: int = 512
    prior_s_per_token: float = 5e-4

    def seconds(self, start: int, end: int) -> float:
        """Predicted seconds until tokens ``start .. end-1`` of a prompt are computed."""
        n = end - start
        if n <= 0:
            return 0.0
        if self.coef is None:
            return n * self.prior_s_per_token
        c0, c1, c2, c3, c4 = self.coef
        total, pos, chunk = 0.0, start, max(1, self.chunk_tokens)
        while pos < end:
            m = min(chunk, end - pos)
            work = attention_work(m, pos)
            last = pos + m >= end
            total += (c0 + c1 * (self.decode_tokens + m)
                      + c2 * (self.decode_reads + work.pairs)
                      + c3 * (self.decode_reads + work.reads)
                      + c4 * (self.decode_tokens + last))
            pos += m
        return total


class TierCost(msgspec.Struct, frozen=True, gc=False):
    """One tier at query time: which blocks after the device hit it holds (``held[i]``:
    block ``h + i``), its transfer model's latency and bandwidth, and its queue's wait."""
    name: str
    held: tuple[bool, ...]
    latency_s: float
    bandwidth: float
    queue_wait_s: float = 0.0

    @property
    def per_block_s(self) -> float:
        return self.latency_s + 1.0 / self.bandwidth

    def seconds(self, num_blocks: int, block_bytes: int) -> float:
        if num_blocks <= 0:
            return 0.0
        return self.queue_wait_s + self.latency_s + num_blocks * block_bytes / self.bandwidth


class RestorePlan(msgspec.Struct, frozen=True, gc=False):
    """The decision: restore blocks ``start_block .. start_block + num_restore_blocks - 1``
    in ``ranges`` ((tier, first block, end block), tiers fastest first), recompute the rest.
    Predictions in seconds; ``all_recompute_s``/``all_restore_s`` are the two extremes'
    predicted TTFTs (the alternatives the regret is measured against)."""
    mode: str
    start_block: int
    num_restore_blocks: int
    ranges: list[tuple[str, int, int]]
    predicted_restore_s: float
    predicted_recompute_s: float
    predicted_ttft_s: float
    all_recompute_s: float
    all_restore_s: float
    available_blocks: int

    def as_dict(self, block_size: int) -> dict:
        return {"mode": self.mode,
                "restore_tokens": self.num_restore_blocks * block_size,
                "available_tokens": self.available_blocks * block_size,
                "ranges": [{"tier": t, "tokens": [a * block_size, b * block_size]}
                           for t, a, b in self.ranges],
                "predicted_restore_ms": round(float(self.predicted_restore_s) * 1e3, 2),
                "predicted_recompute_ms": round(float(self.predicted_recompute_s) * 1e3, 2),
                "predicted_ttft_ms": round(float(self.predicted_ttft_s) * 1e3, 2),
                "predicted_all_recompute_ms": round(float(self.all_recompute_s) * 1e3, 2),
                "predicted_all_restore_ms": round(float(self.all_restore_s) * 1e3, 2)}


def available(tiers: list[TierCost]) -> int:
    """The leading run of blocks after the device hit that some tier holds."""
    n = 0
    while any(n < len(t.held) and t.held[n] for t in tiers):
        n += 1
    return n


def assign(tiers: list[TierCost], start: int, k: int) -> list[tuple[str, int, int]]:
    """Blocks ``start .. k-1`` (all held somewhere), each from the fastest tier (by its
    per-block time) holding it, as (tier, first, end) ranges of consecutive blocks."""
    order = sorted(tiers, key=lambda t: (t.per_block_s, t.name))
    out: list[tuple[str, int, int]] = []
    for i in range(k - start):
        name = next(t.name for t in order if i < len(t.held) and t.held[i])
        if out and out[-1][0] == name and out[-1][2] == start + i:
            out[-1] = (name, out[-1][1], start + i + 1)
        else:
            out.append((name, start + i, start + i + 1))
    return out


def restore_seconds(tiers: list[TierCost], ranges: list[tuple[str, int, int]],
                    block_bytes: int) -> float:
    by_name = {t.name: t for t in tiers}
    blocks: dict[str, int] = {}
    for name, a, b in ranges:
        blocks[name] = blocks.get(name, 0) + b - a
    return max((by_name[name].seconds(n, block_bytes) for name, n in blocks.items()),
               default=0.0)


def plan_restore(mode: str, start_block: int, tiers: list[TierCost], block_size: int,
                 block_bytes: int, prompt_len: int, recompute: RecomputeCost) -> RestorePlan:
    """Choose the split point (see the module docstring)."""
    kind, threshold = parse_mode(mode)
    avail = available(tiers)

    def ttft(k: int) -> tuple[float, float, float, list]:
        ranges = assign(tiers, start_block, k)
        r = restore_seconds(tiers, ranges, block_bytes)
        c = recompute.seconds(k * block_size, prompt_len)
        return r + c, r, c, ranges

    candidates = {k: ttft(k) for k in range(start_block, start_block + avail + 1)}
    all_recompute = candidates[start_block][0]
    all_restore = candidates[start_block + avail][0]
    if kind == "cost":
        k = min(candidates, key=lambda k: (candidates[k][0], k))
    elif kind == "always_restore":
        k = start_block + avail
    elif kind == "always_recompute":
        k = start_block
    else:
        k = start_block + avail if avail * block_size >= threshold else start_block
    total, r, c, ranges = candidates[k]
    return RestorePlan(mode=mode, start_block=start_block,
                       num_restore_blocks=sum(b - a for _, a, b in ranges), ranges=ranges,
                       predicted_restore_s=r, predicted_recompute_s=c, predicted_ttft_s=total,
                       all_recompute_s=all_recompute, all_restore_s=all_restore,
                       available_blocks=avail)
