"""The allocator setting (kernels/cpu/allocator.py): once set, a forward-sized allocation
that was freed is served again without page faults."""

import os
import subprocess
import sys

import pytest

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
    # Off: 80 tensors x 3,072 pages, each faulted in again. On: nothing is handed back.
    assert on < 1_000 and off > 100_000


def test_env_switch_turns_it_off(monkeypatch):
    from tokenloom.kernels.cpu import allocator
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setenv("TOKENLOOM_KEEP_FREED_MEMORY", "0")
    assert allocator.keep_freed_memory() is False
