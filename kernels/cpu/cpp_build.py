"""Build a C++ kernel of kernels/cpu/csrc with torch's cpp_extension, for this CPU.

Kernels are compiled with -march=native, so a build is only valid on a CPU with the same
features: the build's name carries a digest of them (cpu_features.summary()), and a cache
shared by machines of different kinds (a home directory on NFS, a copied container) never
hands an AVX-512 build to an AVX2 CPU, which would die of an illegal instruction.

The digest also covers the source and the shared headers, and the compiler reads a copy of
them staged under the extensions directory by that digest: torch's build (ninja) keys on
the source's path, so two installs of the same code (the checkout and an installed wheel,
two venvs) would otherwise rebuild each other's modules on every switch (five modules, ~2
minutes on 2 cores, measured in the test suite's wheel test).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from tokenloom.kernels.cpu import features as cpu_features

CSRC = Path(__file__).parent / "csrc"
# Every extension module and its source (each built on first use by the module that needs it).
KERNELS = (("tokenloom_paged_decode_cpu", "paged_decode_cpu.cpp"),
           ("tokenloom_decode_stack_cpu", "decode_stack_cpu.cpp"),
           ("tokenloom_block_gemm_cpu", "block_gemm_cpu.cpp"),
           ("tokenloom_tile_gemm_cpu", "tile_gemm_cpu.cpp"),
           ("tokenloom_small_gemm_cpu", "small_gemm_cpu.cpp"),
           ("tokenloom_layer_ops_cpu", "layer_ops_cpu.cpp"))


def build_name(base: str, source: str | None = None) -> str:
    """`base` + a digest of this CPU's features, of the shared headers (csrc/*.h) and of
    `source`: torch rebuilds when a listed source changes, but it does not list the headers
    a source includes, so an edited header would otherwise load a stale build."""
    h = hashlib.sha256(cpu_features.detect().summary().encode())
    for header in sorted(CSRC.glob("*.h")):
        h.update(header.read_bytes())
    if source is not None:
        h.update((CSRC / source).read_bytes())
    return f"{base}_{h.hexdigest()[:10]}"


def staged_sources(name: str, source: str) -> Path:
    """csrc/`source` and the shared headers copied to <extensions dir>/tokenloom-sources/
    `name` (once; a concurrent builder's copy is as good), returned as the source's path."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    stage = root / "tokenloom-sources" / name
    if not (stage / source).is_file():
        stage.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=stage.parent))
        for path in [CSRC / source, *sorted(CSRC.glob("*.h"))]:
            shutil.copy2(path, tmp / path.name)
        try:
            tmp.rename(stage)
        except OSError:        # another process staged it first
            shutil.rmtree(tmp, ignore_errors=True)
    return stage / source


def ninja_dir() -> Path | None:
    """The folder of the `ninja` binary of the pip package `ninja` (None: not installed).
    Not simply this interpreter's bin: an environment that reaches the package through
    another's site-packages (a .pth line, as the wheel test's venv does) has no ninja in its
    own bin, and the system's older ninja reads the build logs the pip one wrote as stale,
    so every module was rebuilt on each switch (measured: 1.11 against 1.13)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("ninja")
    except PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name in ("ninja", "ninja.exe") and f.parent.name in ("bin", "Scripts"):
            path = Path(str(dist.locate_file(f))).resolve()
            if path.is_file():
                return path.parent
    return None


def build(base: str, source: str):
    """Compile (or load the cached build of) csrc/`source` as module `base`_<digest>.
    Raises whatever the toolchain raises; callers fall back and say why."""
    from torch.utils.cpp_extension import load

    # torch looks for `ninja` on PATH: the pip-installed one first, wherever its package was
    # imported from, then this interpreter's bin.
    dirs = [d for d in (ninja_dir(), Path(sys.executable).parent) if d is not None]
    os.environ["PATH"] = os.pathsep.join([*map(str, dirs), os.environ.get("PATH", "")])
    name = build_name(base, source)
    # -fopenmp: without it at::parallel_for compiles to a plain loop and the kernel runs on
    # one core (the libgomp it links is the one torch has loaded already).
    return load(name=name, sources=[str(staged_sources(name, source))],
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)


def is_built(base: str, source: str) -> bool:
    """Whether the cached build of `source` for this CPU and these sources exists."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    name = build_name(base, source)
    return any(root.glob(f"*/{name}/{name}*.so"))   # (torch adds a pyXY_cpu folder)


def prebuild(jobs: int | None = None) -> list[str]:
    """Compile the kernels not built yet, `jobs` at a time in child processes (default: the
    CPUs this process may use). Each module is one source file, which one compiler process
    builds on one core: built one after another on first use, a fresh machine's six took
    ~3 minutes on 2 cores. Returns the modules whose build failed (each is retried, and its
    error logged, by the module that uses it)."""
    import subprocess

    pending = [k for k in KERNELS if not is_built(*k)]
    jobs = jobs or len(os.sched_getaffinity(0))
    code = "import sys; from tokenloom.kernels.cpu.cpp_build import build; build(*sys.argv[1:])"
    failed, running = [], []
    while pending or running:
        while pending and len(running) < jobs:
            base, source = pending.pop(0)
            running.append((base, subprocess.Popen([sys.executable, "-c", code, base, source],
                                                   stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL)))
        base, proc = running.pop(0)
        if proc.wait() != 0:
            failed.append(base)
    return failed
