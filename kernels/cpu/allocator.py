"""Keep freed activation memory in the process instead of handing it back to the kernel.

A prefill step allocates and frees hundreds of MB of temporaries (a 1,024-token chunk's
gate/up output alone is 6 MB in bf16, per layer). glibc serves every allocation above its
mmap threshold (128 KiB, grown only as such blocks are freed) with a fresh mmap and returns
it with munmap, so the next layer touches new pages: 20,000-116,000 minor page faults per
1,024-token forward of the default model, measured, and on a VM whose host reclaims freed
memory (this project's 2-core machines) each fault is slow and the step time swings by
30%. vLLM's CPU build avoids the same cost by preloading tcmalloc; an already running
Python process cannot swap allocators, but glibc's mallopt can make it keep what it frees:
blocks up to 32 MiB (glibc's upper bound for the threshold) come from the heap, and the heap
is not trimmed back until more than 1 GiB at its top is free. Measured: 0 page faults per
forward once warm.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20     # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 1 << 30

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; False where there is no glibc (musl, macOS)
    or TOKENLOOM_KEEP_FREED_MEMORY=0 turns it off."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("TOKENLOOM_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                    and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _applied
