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
import mmap
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


# -- decode-streamed weights in transparent huge pages --------------------------------------
#
# A batch-1 decode step reads every weight once from memory. On 4 KiB pages that is one TLB
# entry per 4 KiB of a stream (the default model in bf16: 66,000 pages a step). The same
# kernels over the same weights in memory madvised for transparent huge pages measured
# 1.12-1.13x faster on a 2-core AMD EPYC (bf16, 269 MB a step, side by side), where torch's
# allocator had given the weights 4 KiB pages (THP "madvise" mode, the common default).
# llama.cpp's weights come from its mmap'd GGUF, on the page cache's large folios.
# KernelSet (linear.py) places the forms its decode kernels stream here; the memory comes
# in chunks, so small tensors share huge pages instead of each rounding up to 2 MiB.

ARENA_CHUNK_BYTES = 64 << 20
ARENA_MIN_BYTES = 256 << 10   # smaller tensors stay where they are (norms, biases, scales)
ARENA_ALIGN = 64


def huge_pages_possible() -> bool:
    """Linux with transparent huge pages in "always" or "madvise" mode, and not turned off
    by TOKENLOOM_HUGE_PAGES=0."""
    if os.environ.get("TOKENLOOM_HUGE_PAGES", "1") == "0":
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode


class WeightArena:
    """Anonymous memory madvised for transparent huge pages, handed out in 64-byte aligned
    slices. A chunk is freed when the last tensor placed in it is (each slice holds its
    chunk's storage)."""

    def __init__(self) -> None:
        self._chunk = None
        self._used = 0
        self.placed_bytes = 0

    def place(self, t):
        """A contiguous copy of `t` in the arena, or `t` itself where the arena does not
        apply (too small, not a CPU tensor, no huge pages here)."""
        import torch

        if (t is None or t.device.type != "cpu" or t.nbytes < ARENA_MIN_BYTES
                or not huge_pages_possible()):
            return t
        need = -(-t.nbytes // ARENA_ALIGN) * ARENA_ALIGN
        if self._chunk is None or self._used + need > self._chunk.numel():
            size = max(ARENA_CHUNK_BYTES, -(-need // (2 << 20)) * (2 << 20))
            region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            region.madvise(mmap.MADV_HUGEPAGE)   # before the first touch: huge pages then
            self._chunk = torch.frombuffer(region, dtype=torch.uint8)
            self._used = 0
        out = self._chunk[self._used:self._used + t.nbytes].view(t.dtype).view(t.shape)
        out.copy_(t)
        self._used += need
        self.placed_bytes += t.nbytes
        return out


    def retire(self) -> None:
        """Start the next placement in a new chunk: the current one is freed when the last
        tensor placed in it is (an engine that stopped calls this; others keep theirs)."""
        self._chunk = None
        self._used = 0


_arena: WeightArena | None = None


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel once (glibc malloc_trim): after the
    weights have moved to the arena, their old memory would otherwise stay in the process
    (keep_freed_memory's trim threshold), counted in its resident size until reused."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return bool(trim(0))


def weight_arena() -> WeightArena:
    global _arena
    if _arena is None:
        _arena = WeightArena()
    return _arena


def huge_page_bytes() -> int:
    """This process's anonymous memory backed by huge pages (AnonHugePages), 0 if unknown."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
