"""The Triton kernels against the torch reference on CPU: paged decode attention and the KV
store (kernels/gpu/triton_attention.py, checks in triton_interpreted_checks.py) and the fused
layer kernels (kernels/gpu/triton_fused.py, checks in triton_fused_checks.py).

The checks run in a subprocess with TRITON_INTERPRET=1: Triton picks the interpreter when it
is first imported, so the variable has to be set before that, and setting it in this
process would leak into every later test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


# The interpreter is slow: whole-model checks in bf16 (the fp32 ones run the same kernels)
# are in the wide run (make test-wide).
@pytest.mark.parametrize("checks,select", [
    ("triton_interpreted_checks.py", "not wide"), ("triton_fused_checks.py", "not wide"),
    pytest.param("triton_fused_checks.py", "wide", marks=pytest.mark.wide, id="fused-wide")])
def test_triton_kernels_under_interpreter(checks, select):
    path = Path(__file__).with_name(checks)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
         "-m", select, "--rootdir", str(path.parent), str(path)],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def test_triton_still_imports_normally():
    assert os.environ.get("TRITON_INTERPRET") != "1"
    import triton  # noqa: F401
