"""Integer arithmetic shared by every layer (no torch, no asyncio)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """`a / b` rounded up, for non-negative `a` and positive `b`: the blocks that hold `a`
    tokens at `b` per block, the partitions that cover a context, the grid of a kernel."""
    return -(a // -b)
