"""Decode batch-size buckets for CUDA graphs: which sizes to capture, and padding.

Pure: no torch, no asyncio. A decode batch of n sequences replays the graph captured for
the smallest bucket >= n; the extra rows are padding (they compute garbage that nobody
reads and write their KV nowhere). The fewer buckets, the less capture time and memory;
the closer the buckets sit to the batch sizes that really occur, the less padding.

Contract:
- every function returns sizes sorted ascending, unique, each >= 1;
- `PaddedSizeTable(sizes).padded(n)` is the smallest size >= n, or None when n exceeds the
  largest bucket (such a batch runs eager);
- `sizes_from_histogram` always keeps the largest size, so deriving buckets from a
  histogram never sends a batch that used to get a graph to the eager path.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Mapping, Sequence

# Small batches are where launch overhead dominates: capture each power of two up to 8,
# then every multiple of 8 (tensor-core friendly tiles, bounded padding of 7 rows).
_SMALL = (1, 2, 4, 8)
_STEP = 8


def default_capture_sizes(max_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, 32, ... up to and including `max_size` (which is always a bucket)."""
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    sizes = [s for s in _SMALL if s <= max_size]
    sizes += range(2 * _STEP, max_size + 1, _STEP)
    sizes.append(max_size)
    return normalise_sizes(sizes)


def default_token_sizes(max_tokens: int) -> tuple[int, ...]:
    """Token-count buckets for piecewise graphs (steps with prefill tokens): 8, 16, 24, 32,
    48, 64, then eight steps per doubling (72, 80, ... 128, 144, ... 256, 288, ...), up to
    and including `max_tokens`. A step is padded by at most 1/8 of its tokens from 64 up
    (the padded tokens are computed for nothing), with 8 buckets per doubling."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = [s for s in (8, 16, 24, 32, 48, 64) if s <= max_tokens]
    lo = 64
    while lo < max_tokens:
        sizes += range(lo + lo // 8, min(2 * lo, max_tokens) + 1, lo // 8)
        lo *= 2
    sizes.append(max_tokens)
    return normalise_sizes(sizes)


def normalise_sizes(sizes: Iterable[int]) -> tuple[int, ...]:
    out = sorted(set(int(s) for s in sizes))
    if not out or out[0] < 1:
        raise ValueError(f"capture sizes must be a non-empty set of integers >= 1, got {out}")
    return tuple(out)


def capture_sizes(max_num_seqs: int, explicit: Sequence[int] = (), max_size: int = 0,
                  histogram: Mapping[int, int] | None = None,
                  max_graphs: int = 16) -> tuple[int, ...]:
    """The sizes to capture, from config.

    `max_size` (0: `max_num_seqs`) caps the largest bucket; no decode batch is ever larger
    than `max_num_seqs`, so a bigger bucket would be wasted memory. `explicit` sizes win
    over the default series; a `histogram` of observed batch sizes wins over both.
    """
    cap = min(max_size or max_num_seqs, max_num_seqs)
    if histogram:
        return sizes_from_histogram(histogram, max_graphs, cap)
    if explicit:
        kept = [s for s in normalise_sizes(explicit) if s <= cap]
        if not kept:
            raise ValueError(f"no capture size is <= {cap} (the largest decode batch)")
        return tuple(kept)
    return default_capture_sizes(cap)


class PaddedSizeTable:
    """batch size -> padded size, precomputed for every size up to the largest bucket."""

    def __init__(self, sizes: Sequence[int]):
        self.sizes = normalise_sizes(sizes)
        self.max_size = self.sizes[-1]
        # _table[n] for n in 0..max_size; a zero-row batch never replays (index 0 unused).
        self._table = [self.sizes[bisect.bisect_left(self.sizes, n)]
                       for n in range(1, self.max_size + 1)]
        self._table.insert(0, self.sizes[0])

    def padded(self, n: int) -> int | None:
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        return self._table[n] if n <= self.max_size else None

    def as_dict(self) -> dict[int, int]:
        return {n: self._table[n] for n in range(1, self.max_size + 1)}


@dataclasses.dataclass(frozen=True)
class PaddingWaste:
    real_rows: int      # sequences actually decoded through graphs
    padded_rows: int    # rows computed only to fill a bucket
    eager_rows: int     # rows of batches too large for any bucket

    @property
    def fraction(self) -> float:
        """Share of graph-computed rows that were padding."""
        total = self.real_rows + self.padded_rows
        return self.padded_rows / total if total else 0.0


def padding_waste(histogram: Mapping[int, int], sizes: Sequence[int]) -> PaddingWaste:
    """What `sizes` would have cost on the batches of `histogram` (size -> count)."""
    table = PaddedSizeTable(sizes)
    real = pad = eager = 0
    for n, count in histogram.items():
        if n < 1 or count <= 0:
            continue
        p = table.padded(n)
        if p is None:
            eager += n * count
        else:
            real += n * count
            pad += (p - n) * count
    return PaddingWaste(real_rows=real, padded_rows=pad, eager_rows=eager)


def sizes_from_histogram(histogram: Mapping[int, int], max_graphs: int,
                         max_size: int) -> tuple[int, ...]:
    """At most `max_graphs` buckets (always including `max_size`) that minimise the padded
    rows over the observed batches.

    An optimal bucket set only ever uses observed sizes (lowering a bucket to the largest
    observed size it serves never adds padding), so a dynamic program over the m distinct
    observed sizes, O(max_graphs * m^2), finds the exact optimum.
    """
    if max_graphs < 1:
        raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    counts: dict[int, int] = {}
    for n, c in histogram.items():
        n, c = int(n), int(c)
        if 1 <= n <= max_size and c > 0:
            counts[n] = counts.get(n, 0) + c
    points = sorted(counts)
    if not points or points[-1] != max_size:
        points.append(max_size)   # forced bucket; count 0 if never observed
        counts.setdefault(max_size, 0)
    m = len(points)
    k = min(max_graphs, m)
    # Prefix sums so the cost of serving points[i..j] with bucket points[j] is O(1):
    # sum c * (points[j] - n) = points[j] * C - S over that range.
    pc = [0] * (m + 1)
    ps = [0] * (m + 1)
    for i, n in enumerate(points):
        pc[i + 1] = pc[i] + counts[n]
        ps[i + 1] = ps[i] + counts[n] * n

    def cost(i: int, j: int) -> int:  # points[i..j] padded up to points[j]
        return points[j] * (pc[j + 1] - pc[i]) - (ps[j + 1] - ps[i])

    inf = float("inf")
    # best[g][j]: least padding serving points[0..j] with g buckets, the last at points[j].
    best = [[inf] * m for _ in range(k + 1)]
    back = [[-1] * m for _ in range(k + 1)]
    for j in range(m):
        best[1][j] = cost(0, j)
    for g in range(2, k + 1):
        for j in range(g - 1, m):
            for i in range(g - 2, j):
                c = best[g - 1][i] + cost(i + 1, j)
                if c < best[g][j]:
                    best[g][j], back[g][j] = c, i
    g = min(range(1, k + 1), key=lambda gg: (best[gg][m - 1], gg))
    chosen, j = [], m - 1
    while j >= 0 and g >= 1:
        chosen.append(points[j])
        j, g = back[g][j], g - 1
    return normalise_sizes(chosen)
