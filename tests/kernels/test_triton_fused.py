"""The fused Triton kernels (kernels/triton_fused.py) against the torch reference on CPU,
under the Triton interpreter, in a subprocess (see test_triton_attention.py for why)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
_CHECKS = Path(__file__).with_name("triton_fused_checks.py")


def test_fused_triton_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
         "--rootdir", str(_CHECKS.parent), str(_CHECKS)],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
