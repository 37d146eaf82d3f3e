"""What the CPU offers, detected once at start-up: the instruction sets the CPU paths care
about (AVX2, AVX-512, AVX512-BF16, AVX512-VNNI / AVX-VNNI, AMX), from the kernel's view of
the CPU (/proc/cpuinfo flags) cross-checked with torch's own dispatch level.

Nothing here decides a kernel by itself: which implementation runs is measured at start-up
(kernel_plan.py). Features only rule out paths that cannot work (no bf16 instructions: bf16
weights would be emulated) and name the machine in logs and in compile-cache keys. A CPU
lacking every feature is fine: the answer is an empty set, never an error.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
from pathlib import Path

# /proc/cpuinfo flag -> our name. Kernel flag spellings: amx_bf16, avx512_bf16, avx512_vnni...
_FLAGS = {
    "avx2": "avx2",
    "fma": "fma",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512vl": "avx512vl",
    "avx512_vnni": "avx512_vnni",
    "avx_vnni": "avx_vnni",
    "avx512_bf16": "avx512_bf16",
    "amx_tile": "amx_tile",
    "amx_bf16": "amx_bf16",
    "amx_int8": "amx_int8",
}


@dataclasses.dataclass(frozen=True)
class CpuFeatures:
    arch: str                    # platform.machine(): x86_64, aarch64...
    model_name: str              # "AMD EPYC ...", "" when unknown
    flags: frozenset[str]        # the subset of _FLAGS' values present
    torch_capability: str        # torch.backends.cpu.get_cpu_capability(): DEFAULT/AVX2/AVX512...

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags

    @property
    def avx512(self) -> bool:
        return {"avx512f", "avx512bw", "avx512vl"} <= self.flags

    @property
    def bf16(self) -> bool:
        """Native bf16 dot products (AVX512-BF16 or AMX-BF16): bf16 weights run at speed."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    @property
    def vnni(self) -> bool:
        return "avx512_vnni" in self.flags or "avx_vnni" in self.flags

    @property
    def amx(self) -> bool:
        return "amx_tile" in self.flags

    def summary(self) -> str:
        """One short line for the start-up log and cache keys, e.g.
        'x86_64 avx2 avx512 avx512_bf16 vnni (torch AVX512)'."""
        names = [n for n, on in (("avx2", self.avx2), ("avx512", self.avx512),
                                 ("avx512_bf16", "avx512_bf16" in self.flags),
                                 ("vnni", self.vnni), ("amx", self.amx)) if on]
        return " ".join([self.arch, *names]) + f" (torch {self.torch_capability})"


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, known flags) from /proc/cpuinfo text (the first processor's entry)."""
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            present = set(value.split())
            flags = frozenset(ours for kernel, ours in _FLAGS.items() if kernel in present)
    return model, flags


def _torch_capability() -> str:
    try:
        import torch
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # an old torch, or torch missing: only the flags are known
        return "unknown"


def from_torch_capability(capability: str) -> frozenset[str]:
    """What torch's dispatch level implies, for systems without /proc/cpuinfo."""
    cap = capability.upper()
    flags: set[str] = set()
    if cap.startswith("AVX2") or cap.startswith("AVX512"):
        flags |= {"avx2", "fma"}
    if cap.startswith("AVX512"):
        flags |= {"avx512f", "avx512bw", "avx512vl"}
    return frozenset(flags)


@functools.cache
def detect(cpuinfo: str = "/proc/cpuinfo") -> CpuFeatures:
    """This machine's features (cached). Never raises."""
    capability = _torch_capability()
    try:
        model, flags = parse_cpuinfo(Path(cpuinfo).read_text(errors="replace"))
    except OSError:
        model, flags = "", frozenset()
    if not flags:
        flags = from_torch_capability(capability)
    return CpuFeatures(arch=platform.machine(), model_name=model, flags=flags,
                       torch_capability=capability)
