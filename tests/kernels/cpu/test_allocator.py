"""The allocator setting (kernels/cpu/allocator.py): once set, a forward-sized allocation
that was freed is served again without page faults; and the arena that gives the weights a
decode step streams memory madvised for transparent huge pages."""

import os
import subprocess
import sys

import pytest

from tokenloom.kernels.cpu import allocator

CHILD = """
import ctypes, resource, sys, torch
from tokenloom.kernels.cpu.allocator import M_MMAP_THRESHOLD, keep_freed_memory
# A fixed 128 KiB threshold first: every 12 MiB tensor is then its own mapping, whatever
# glibc's dynamic threshold would have learnt (measured 0 to 245,120 faults without this).
assert ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 << 10)
if sys.argv[1] == "on":
    assert keep_freed_memory() and keep_freed_memory()   # idempotent
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):             # warm: the heap grows to hold the temporaries once
    [torch.ones(3 << 20) for _ in range(4)]
before = faults()
for _ in range(20):
    [torch.ones(3 << 20) for _ in range(4)]   # 12 MiB tensors, freed each round
print(faults() - before)
"""


def _faults(mode: str, env_off: bool = False) -> int:
    env = {"TOKENLOOM_KEEP_FREED_MEMORY": "0"} if env_off else {}
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                         check=True, env={**os.environ, **env}, timeout=120)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensors_are_reused_without_page_faults():
    off, on = _faults("off"), _faults("on")
    # Off: 80 tensors x 3,072 pages, each faulted in again. On: nothing is handed back by the
    # process; usually 0 faults, but a VM whose host reclaims cold memory (DAMON, on this
    # project's machines) may take back a kept block between rounds: 12,288 faults (one
    # round's 4 tensors) measured in 2 runs of ~10. A tenth of "off" or less.
    assert off > 100_000 and on <= off // 10


def test_env_switch_turns_it_off(monkeypatch):
    from tokenloom.kernels.cpu import allocator
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setenv("TOKENLOOM_KEEP_FREED_MEMORY", "0")
    assert allocator.keep_freed_memory() is False


# -- the weight arena ---------------------------------------------------------------------
def _vma_flags(address: int) -> dict[str, str]:
    """/proc/self/smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and ":" in head:
                fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


def test_the_arena_copies_large_weights_into_memory_madvised_for_huge_pages(monkeypatch):
    import torch

    monkeypatch.delenv("TOKENLOOM_HUGE_PAGES", raising=False)
    arena = allocator.WeightArena()
    big = torch.randn(1024, 576).to(torch.bfloat16)            # 1.1 MiB
    small = torch.randn(64, 64)                                  # 16 KiB: stays put
    placed = arena.place(big)
    assert torch.equal(placed, big) and placed.is_contiguous() and placed.dtype == big.dtype
    assert arena.place(small) is small
    if not allocator.huge_pages_possible():
        assert placed is big
        return
    assert placed.data_ptr() != big.data_ptr() and placed.data_ptr() % allocator.ARENA_ALIGN == 0
    # the kernel was told before the first touch: the mapping may take huge pages
    assert _vma_flags(placed.data_ptr()).get("THPeligible") == "1"
    second = arena.place(big)   # shares the chunk, after the first slice
    assert second.data_ptr() >= placed.data_ptr() + big.nbytes


def test_the_arena_can_be_turned_off(monkeypatch):
    import torch

    monkeypatch.setenv("TOKENLOOM_HUGE_PAGES", "0")
    big = torch.randn(1024, 576)
    assert not allocator.huge_pages_possible()
    assert allocator.WeightArena().place(big) is big
