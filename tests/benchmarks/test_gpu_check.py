"""The one-shot GPU check script runs its CPU-safe parts here: argument parsing, the plan
(shapes, bytes per step, bucket tables), a smoke run of the benchmark code on CPU, and the
engine part (benchmarks/gpu_engine.py) on CPU: LLM offline, parity against transformers,
`tokenloom serve` under a short streamed load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    # The mixed-step benchmark's code on CPU: the pieces run eagerly, equal to eager.
    mixed = result["cpu_mixed_smoke"]
    assert [r["tokens"] for r in mixed["rows"]] == [10, 34] and not mixed["captured"]
    assert all(r["piecewise_vs_eager_max_rel_diff"] < 1e-4 and r["bucket"] >= r["tokens"]
               for r in mixed["rows"])
    assert "mixed steps (decodes + one mid-prompt chunk)" in proc.stdout
    assert "padded batch sizes" in proc.stdout
    assert result["failures"] == [] and "partial" not in result

    # The engine part, on CPU with the tiny shape: every step ran, none raised.
    engine = result["engine"]
    assert engine["plan"]["device"] == "cpu" and engine["plan"]["shape"] == "tiny"
    for step in ("checkpoint", "offline", "parity", "http"):
        assert "error" not in engine[step], engine[step]
    off = engine["offline"]
    assert off["complete"] and off["output_tokens"] == off["prompts"] * off["output_len"] > 0
    assert off["tokens_per_s"] > 0
    # Graph stats of the timed call: on CPU (graphs.cpu_compile off) every step is eager,
    # each with its reason, and nothing replays.
    g = off["graphs"]
    assert g.get("replays", 0) == 0 and g["graph_steps"] == 0 and g["eager_steps"] > 0
    assert sum(g["eager_reasons"].values()) == g["eager_steps"]
    assert off["busy"]["source"].startswith("torch.profiler") and "fraction" in off["busy"]
    par = engine["parity"]
    assert par["matched"] == par["prompts"] == 3 and par["mismatches"] == []
    http = engine["http"]
    load = http["load"]
    assert load["requests"] >= http["streams"] and load["errors"] == 0
    assert load["output_tokens"] == load["requests"] * http["output_len"]
    assert load["ttft_ms"]["p50"] is not None and load["itl_ms"]["p99"] is not None
    busy = http["gpu_busy"]   # no NVML on CPU: recorded as unavailable, not a failure
    assert busy["available"] is False and busy["samples"] == 0 and "NVML" in busy["reason"]
    assert http["graphs"]["present"] and http["graphs"]["eager_steps"] > 0
    assert http["graphs"]["replays"] == 0 and http["exit_code"] == 0
    assert http["step_time_ms"]["forward"] > 0   # the server's step time, from /metrics
    assert "log_tail" not in http
    assert "http_64_streams_gpu_busy" not in result.get("targets", {})
    for text in ("engine (tiny, float32, cpu", "parity vs transformers", "http: 8 streams",
                 "http GPU busy: unavailable"):
        assert text in proc.stdout, proc.stdout[-3000:]


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
    engine = {"checkpoint": {}, "offline": {"complete": True, "graphs": {"replays": 9},
                                            "backend": "triton"},
              "parity": {"prompts": 5, "matched": 5},
              "http": {"load": {"requests": 9, "errors": 0}, "graphs": {"replays": 9},
                       "exit_code": 0}}
    good = {"mode": "gpu", "tests": {"ran": True, "ok": True, "skipped": []},
            "targets": {name: {"value": 1.0, "target": "x", "met": True} for name in gc.TARGETS},
            "decode": {"smollm2-135m": {"rows": [row]}}, "engine": engine}
    assert gc.failures(good) == []
    no_engine = {k: v for k, v in good.items() if k != "engine"}
    assert gc.failures(no_engine) == ["the engine part did not run (--skip-engine)"]
    parity_miss = json.loads(json.dumps(good))
    parity_miss["engine"]["parity"].update(matched=4, mismatches=[{"prompt": 1}])
    assert "differ from transformers" in " ".join(gc.failures(parity_miss))
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
    # Mixed steps: piecewise graphs must replay and agree with eager.
    mixed_row = {"tokens": 24, "piecewise_vs_eager_max_rel_diff": 1e-3, "piecewise_replays": 25}
    with_mixed = dict(good, mixed={"smollm2-135m": {"rows": [mixed_row]}})
    assert gc.failures(with_mixed) == []
    with_mixed["mixed"]["smollm2-135m"]["rows"] = [dict(mixed_row, piecewise_replays=0,
                                                        piecewise_vs_eager_max_rel_diff=0.3)]
    problems = " | ".join(gc.failures(with_mixed))
    assert "no piecewise graph was replayed" in problems and "differ by 3.0e-01" in problems


def test_parts_out_of_time_are_skipped_and_fail_the_run():
    """The host lends one 10-minute run: a part that no longer fits is skipped, listed, and
    the run fails saying so (instead of being killed with no table)."""
    gc = _load_script()
    result = {"mode": "gpu"}
    assert gc.has_time(result, "llama3-8b", 500.0) and "skipped_for_time" not in result
    assert not gc.has_time(result, "llama3-8b", gc.PART_SECONDS["llama3-8b"] - 1)
    assert not gc.has_time(result, "engine", 10.0)
    assert result["skipped_for_time"] == ["llama3-8b", "engine"]
    problems = gc.failures(result)
    assert "llama3-8b skipped: out of the time budget" in problems
    assert "engine skipped: out of the time budget" in problems
    assert not any("--skip-engine" in p for p in problems)   # not skipped by the flag
    assert gc.parse_args([]).time_budget < 600


def test_http_busy_target_is_met_missed_or_not_measured():
    """The issue's fourth target: GPU busy >= 80% of wall time under 64 HTTP streams, from
    NVML samples during the load; no sample (no NVML) means not measured, which fails."""
    gc = _load_script()

    def targets(busy):
        return gc.check_targets({"engine": {"http": {"gpu_busy": busy}}})

    met = targets({"available": True, "fraction": 0.85, "samples": 200})
    assert met["http_64_streams_gpu_busy"]["met"] is True
    missed = targets({"available": True, "fraction": 0.6, "samples": 200})
    assert missed["http_64_streams_gpu_busy"]["met"] is False
    assert "http_64_streams_gpu_busy" not in targets({"available": False, "fraction": None})
    problems = gc.failures({"mode": "gpu", "targets": missed})
    assert any("http_64_streams_gpu_busy missed: 0.600" in p for p in problems), problems
    problems = gc.failures({"mode": "gpu", "targets": {}})
    assert "target http_64_streams_gpu_busy was not measured" in problems


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
    target = gc.install_wheels(wheels, needed=(name,), optional=())
    assert target is not None
    import importlib
    assert importlib.import_module(name).VALUE == 42
    assert gc.install_wheels(wheels, needed=("json",), optional=()) is None  # nothing missing
    # A server-only module the wheels lack is reported, not fatal; a needed one exits.
    assert gc.install_wheels(wheels, needed=("json",), optional=("tl_absent_mod",)) is not None
    with pytest.raises(SystemExit, match="tl_absent_mod"):
        gc.install_wheels(wheels, needed=("tl_absent_mod",), optional=())


def test_out_directory_gets_json_and_table(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out),
                           "--batches", "1,8", "--skip-engine"],
                          env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["failures"] == []
    table = (out / "gpu_check.txt").read_text()
    assert "padded batch sizes" in table and "gpu check: passed" in table
    assert "engine" not in result


def test_a_check_that_raises_still_writes_its_json_and_fails(tmp_path, monkeypatch):
    """One run on the GPU host: an exception mid-check must not lose what was measured."""
    gc = _load_script()

    def broken(args, result, pythonpath, save):
        result.update(mode="dry-run", measured=42)
        save(result)
        assert json.loads(out.read_text())["partial"] is True
        raise RuntimeError("boom")

    out = tmp_path / "r.json"
    monkeypatch.setattr(gc, "dry_run", broken)
    assert gc.main(["--dry-run", "--json", str(out)]) == 1
    result = json.loads(out.read_text())
    assert result["measured"] == 42 and "partial" not in result
    assert result["failures"] == ["the check raised: RuntimeError: boom"]
