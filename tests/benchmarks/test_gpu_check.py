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


def _load_script():
    import importlib.util as u
    spec = u.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = u.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_failures_say_why_a_gpu_run_fails():
    """A GPU run passes only with every test run and none skipped, every target measured
    and met, graph/eager parity, and graphs replayed at every decode point."""
    gc = _load_script()
    row = {"batch": 1, "graph_vs_eager_max_rel_diff": 1e-3, "graph_replays": 25}
    good = {"mode": "gpu", "tests": {"ran": True, "ok": True, "skipped": []},
            "targets": {name: {"value": 1.0, "target": "x", "met": True} for name in gc.TARGETS},
            "decode": {"smollm2-135m": {"rows": [row]}}}
    assert gc.failures(good) == []
    bad = json.loads(json.dumps(good))
    bad["tests"]["skipped"] = ["SKIPPED [1] tests/gpu/x.py: needs a CUDA GPU"]
    bad["targets"].pop("llama8b_b1_roofline_ratio")
    bad["targets"]["graphs_speedup_135m_b1_8"]["met"] = False
    bad["decode"]["smollm2-135m"]["rows"] = [dict(row, graph_replays=0,
                                                  graph_vs_eager_max_rel_diff=0.5)]
    problems = " | ".join(gc.failures(bad))
    for expected in ("skipped on a GPU host", "llama8b_b1_roofline_ratio was not measured",
                     "graphs_speedup_135m_b1_8 missed", "differ by 5.0e-01",
                     "no CUDA graph was replayed"):
        assert expected in problems, problems
    assert "did not run" in " ".join(gc.failures({"mode": "gpu"}))


def test_carried_wheels_install_without_network(tmp_path, monkeypatch):
    """The GPU host has no network: missing modules come from a directory of wheels."""
    import zipfile
    gc = _load_script()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    name = "tl_carried_probe"
    with zipfile.ZipFile(wheels / f"{name}-1.0-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}/__init__.py", "VALUE = 42\n")
        z.writestr(f"{name}-1.0.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{name}-1.0.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr(f"{name}-1.0.dist-info/RECORD", "")
    monkeypatch.setattr(sys, "path", list(sys.path))
    target = gc.install_wheels(wheels, needed=(name,))
    assert target is not None
    import importlib
    assert importlib.import_module(name).VALUE == 42
    assert gc.install_wheels(wheels, needed=("json",)) is None   # nothing missing


def test_out_directory_gets_json_and_table(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out),
                           "--batches", "1,8"], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["failures"] == []
    table = (out / "gpu_check.txt").read_text()
    assert "padded batch sizes" in table and "gpu check: passed" in table
