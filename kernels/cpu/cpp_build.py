"""Build a C++ kernel of kernels/cpu/csrc with torch's cpp_extension, for this CPU.

Kernels are compiled with -march=native, so a build is only valid on a CPU with the same
features: the build's name carries a digest of them (cpu_features.summary()), and a cache
shared by machines of different kinds (a home directory on NFS, a copied container) never
hands an AVX-512 build to an AVX2 CPU, which would die of an illegal instruction.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from tokenloom.kernels.cpu import features as cpu_features

CSRC = Path(__file__).parent / "csrc"


def build_name(base: str) -> str:
    """`base` + a digest of this CPU's features and of the shared headers (csrc/*.h): torch
    rebuilds when a listed source changes, but it does not list the headers a source
    includes, so an edited header would otherwise load a stale build."""
    h = hashlib.sha256(cpu_features.detect().summary().encode())
    for header in sorted(CSRC.glob("*.h")):
        h.update(header.read_bytes())
    return f"{base}_{h.hexdigest()[:10]}"


def build(base: str, source: str):
    """Compile (or load the cached build of) csrc/`source` as module `base`_<cpu digest>.
    Raises whatever the toolchain raises; callers fall back and say why."""
    from torch.utils.cpp_extension import load

    # torch looks for `ninja` on PATH; the venv's bin holds the pip-installed one.
    venv_bin = Path(sys.executable).parent
    os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
    # -fopenmp: without it at::parallel_for compiles to a plain loop and the kernel runs on
    # one core (the libgomp it links is the one torch has loaded already).
    return load(name=build_name(base), sources=[str(CSRC / source)],
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)
