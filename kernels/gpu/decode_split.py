"""How the decode-attention kernel splits each row's context into partitions (flash-decoding).

A decode step has only rows x KV heads units of work, far fewer than an H200's 132 SMs at
small batches, so each row's context is cut into partitions that run as separate programs
and are merged by a reduce. The rule (FlashDecoding / FlashInfer): pick the partition so that
rows x KV heads x partitions reaches ~2 programs per SM, sized from the context the step
really has, never from max_model_len (a 128k model used to get 2048-token partitions, i.e. 8
programs at batch 1 under 2k context).

- Tokens per partition are a power of two >= BLOCK_N, so the kernel has few variants.
- The fp32 scratch (partials [rows, heads, parts, head_dim] + lse) stays within a budget, and
  the reduce sees at most `max_partitions`: the partition doubles until both hold.
- Eager steps size it from the step's longest context. A CUDA graph is captured once at the
  full block-table width and replayed for any context, so its partition is fixed at capture:
  sized for `reference_context` (programs enough at short contexts) while its grid covers the
  width (partitions past a row's context exit at once).

The partition depends on the number of rows and on the step's longest context, so a row's
rounding (not its value) may differ between two steps of different shape; see docs/gpu.md.
"""

from __future__ import annotations

import dataclasses

from tokenloom.arith import cdiv

PROGRAMS_PER_SM = 2


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pow2_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


@dataclasses.dataclass(frozen=True)
class Variant:
    """What a launch compiles on: tokens per partition and whether the single partition
    writes the output directly (no reduce)."""
    partition: int
    direct: bool


@dataclasses.dataclass(frozen=True)
class SplitRule:
    heads: int
    kv_heads: int
    head_dim: int
    sm_count: int
    block_n: int = 64
    scratch_bytes: int = 64 << 20
    max_partitions: int = 1024
    reference_context: int = 2048

    def __post_init__(self):
        for name in ("heads", "kv_heads", "head_dim", "sm_count", "block_n", "scratch_bytes",
                     "max_partitions", "reference_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"SplitRule.{name} must be >= 1, got {getattr(self, name)}")
        if self.block_n & (self.block_n - 1):
            raise ValueError(f"SplitRule.block_n must be a power of two, got {self.block_n}")

    def max_parts(self, rows: int) -> int:
        """Partitions per row that the scratch budget and the reduce allow (>= 1)."""
        per_part = rows * self.heads * (self.head_dim + 1) * 4      # partial + lse, fp32
        return max(1, min(self.max_partitions, self.scratch_bytes // per_part))

    def partition(self, rows: int, context: int, cover: int) -> int:
        """Tokens per partition: the largest power of two that still cuts `context` into
        enough partitions per row for >= PROGRAMS_PER_SM x SMs programs (but >= block_n),
        doubled while covering `cover` tokens (>= context) would break the scratch bound.
        So each row gets at least min(per_row, context // block_n, max_parts // 2 + 1)
        partitions with work."""
        target = PROGRAMS_PER_SM * self.sm_count
        per_row = cdiv(target, rows * self.kv_heads)
        if per_row == 1:    # the rows alone fill the GPU: one partition, no reduce
            part = max(self.block_n, _pow2_at_least(context))
        else:
            part = max(self.block_n, _pow2_at_most(context // per_row))
        limit = self.max_parts(rows)
        while cdiv(cover, part) > limit:
            part *= 2
        return part

    def eager(self, rows: int, max_context: int) -> Variant:
        part = self.partition(rows, max_context, max_context)
        return Variant(part, cdiv(max_context, part) == 1)

    def graph(self, rows: int, width: int) -> Variant:
        """A graph bucket of `rows` captured at block-table width `width` (tokens)."""
        part = self.partition(rows, min(width, self.reference_context), width)
        return Variant(part, cdiv(width, part) == 1)

    def eager_variants(self, max_rows: int, max_context: int) -> set[Variant]:
        """Every variant `eager(rows, context)` returns for 1 <= rows <= max_rows and
        1 <= context <= max_context: the result is piecewise constant in the context, with
        steps only where a ceil-division or power of two changes, so evaluating it on both
        sides of each such boundary is exhaustive."""
        out = set()
        seen = set()
        target = PROGRAMS_PER_SM * self.sm_count
        for rows in range(1, max_rows + 1):
            key = (cdiv(target, rows * self.kv_heads), self.max_parts(rows))
            if key in seen:      # same per-row target and bound: same variants
                continue
            seen.add(key)
            per_row, limit = key
            edges = {1, max_context}
            k = 1
            while k <= max_context:
                for edge in (k, per_row * k, limit * k):
                    edges.update((edge, edge + 1))
                k *= 2
            out.update(self.eager(rows, c) for c in edges if 1 <= c <= max_context)
        return out

    def graph_variants(self, sizes, width: int) -> set[Variant]:
        return {self.graph(rows, width) for rows in sizes}
