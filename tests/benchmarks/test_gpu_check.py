"""The one-shot GPU check script runs its CPU-safe parts here: argument parsing, the plan
(shapes, bytes per step, bucket tables) and a smoke run of the benchmark code on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--json", str(out),
                           "--batches", "1,8,32,128,256"],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    plan = result["plan"]
    assert plan["default_capture_sizes"][:6] == [1, 2, 4, 8, 16, 24]
    assert plan["default_capture_sizes"][-1] == 256
    assert plan["padded_batches"] == {"1": 1, "8": 8, "32": 32, "128": 128, "256": 256}
    small, big = plan["shapes"]["smollm2-135m"], plan["shapes"]["llama3-8b"]
    assert 134e6 < small["parameters"] < 135e6 and 8.0e9 < big["parameters"] < 8.1e9
    assert big["kv_bytes_per_token"] == 32 * 2 * 8 * 128 * 2
    assert [r["batch"] for r in result["cpu_smoke"]] == [1, 3]
    assert "padded batch sizes" in proc.stdout


def test_make_importable_without_install(tmp_path):
    """On the GPU host nothing is installed: the script imports the checkout via a symlink.
    Simulated by removing the editable install's import hook in a subprocess."""
    code = (
        "import sys\n"
        "sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"
        "try:\n    import tokenloom\n    raise SystemExit('tokenloom still importable')\n"
        "except ImportError:\n    pass\n"
        "import importlib.util as u\n"
        f"s = u.spec_from_file_location('gc', {str(SCRIPT)!r})\n"
        "m = u.module_from_spec(s); s.loader.exec_module(m)\n"
        "p = m.make_importable()\n"
        "import tokenloom.graphs.buckets as b\n"
        "assert b.__file__.startswith(p), (b.__file__, p)\n"
        "print(b.default_capture_sizes(8))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "(1, 2, 4, 8)" in proc.stdout
