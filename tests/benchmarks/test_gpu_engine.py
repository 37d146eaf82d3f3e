"""The GPU check's engine part (benchmarks/gpu_engine.py), its CPU-testable pieces: interval
union, /metrics parsing, stats deltas, the NVML sampler, the profiler's busy fraction, the
verdicts, and that the modules the engine and server import are on the GPU host or
carried as wheels. Its end-to-end run on CPU is in test_gpu_check.py (--dry-run)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test",
                                                  ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ge = _load("gpu_engine")


def test_union_counts_overlaps_once():
    assert ge.union_seconds([]) == 0
    intervals = [(0, 1), (0.5, 2), (3, 4), (3.5, 3.7), (1.9, 2.1)]
    assert ge.union_seconds(intervals) == pytest.approx(3.1)
    assert ge.union_seconds([(5, 6), (0, 1)]) == 2


def test_prompts_share_a_prefix_in_the_first_half_and_avoid_special_ids():
    prompts = ge.make_prompts(6, 10, 4, vocab=50, seed=0)
    assert [len(p) for p in prompts] == [10] * 6
    assert prompts[0][:4] == prompts[1][:4] == prompts[2][:4]
    assert prompts[3][:4] != prompts[0][:4] and prompts[0][4:] != prompts[1][4:]
    assert min(min(p) for p in prompts) >= ge.FIRST_WORD_ID and max(max(p) for p in prompts) < 50
    assert prompts == ge.make_prompts(6, 10, 4, vocab=50, seed=0)


METRICS = """# HELP tokenloom:graph_steps_total Decode steps that replayed a CUDA graph.
# TYPE tokenloom:graph_steps_total counter
tokenloom:graph_steps_total{model_name="m"} 120.0
tokenloom:graph_replays_total{model_name="m"} 118.0
tokenloom:eager_steps_total{model_name="m",reason="prefill in batch"} 7.0
tokenloom:eager_steps_total{model_name="m",reason="larger than the largest bucket"} 2.0
tokenloom:graph_padding_rows_total{model_name="m"} 30.0
tokenloom:decode_batch_size_total{model_name="m",size="3"} 11.0
vllm:num_requests_running{model_name="m"} 0.0
tokenloom:step_time_ms{model_name="m",part="forward"} 3.5
tokenloom:step_time_ms{model_name="m",part="host"} 1.25
"""


def test_graph_metrics_from_the_exposition_text():
    g = ge.graph_metrics(METRICS)
    assert g["present"] and g["graph_steps"] == 120 and g["replays"] == 118
    assert g["eager_steps"] == 9
    assert g["eager_reasons"] == {"prefill in batch": 7, "larger than the largest bucket": 2}
    assert g["decode_batch_size_histogram"] == {"3": 11}
    assert ge.graph_metrics("vllm:x 1\n")["present"] is False
    assert ge.step_time_metrics(METRICS) == {"forward": 3.5, "host": 1.25}
    parsed = ge.parse_metrics('a:b{x="q\\"r",y="2"} 3e2')
    assert parsed["a:b"] == [({"x": 'q\\"r', "y": "2"}, 300.0)]


def test_stats_delta_subtracts_counters_and_recomputes_waste():
    before = {"graphs": True, "graph_steps": 10, "replays": 10, "eager_reasons": {"prefill": 2},
              "graph_real_rows": 30, "graph_padded_rows": 10, "padding_waste_fraction": 0.25,
              "capture_sizes": [1, 2], "capture_seconds": 3.0,
              "decode_batch_size_histogram": {"3": 4}}
    after = {**before, "graph_steps": 15, "replays": 15, "eager_reasons": {"prefill": 5, "x": 1},
             "graph_real_rows": 45, "graph_padded_rows": 15, "padding_waste_fraction": 0.25,
             "decode_batch_size_histogram": {"3": 9, "1": 0}}
    d = ge.stats_delta(before, after)
    assert d["graph_steps"] == 5 and d["replays"] == 5 and d["graphs"] is True
    assert d["eager_reasons"] == {"prefill": 3, "x": 1}
    assert d["decode_batch_size_histogram"] == {"3": 5}
    assert d["padding_waste_fraction"] == pytest.approx(5 / 20)
    assert d["capture_sizes"] == [1, 2] and d["capture_seconds"] == 3.0


def test_busy_sampler_averages_percent_and_reports_a_failing_probe():
    values = iter([50, 100, 0, 50] + [50] * 1000)
    s = ge.BusySampler(lambda: next(values), interval=0.01).start()
    while len(s.samples) < 4:
        time.sleep(0.01)
    out = s.stop()
    assert out["available"] and out["samples"] >= 4 and 0 <= out["fraction"] <= 1
    assert out["min"] == 0 and out["max"] == 1
    down = ge.BusySampler(ge.nvml_probe("cpu"), interval=0.01).start()
    out = down.stop()
    assert out["available"] is False and out["fraction"] is None and out["reason"]


def test_profiled_busy_on_cpu_parses_the_profilers_events():
    import torch

    a = torch.randn(256, 256)
    result, busy = ge.profiled_busy(lambda: [(a @ a).sum() for _ in range(5)], "cpu")
    assert len(result) == 5
    assert busy["events"] > 0 and busy["busy_s"] > 0 and busy["wall_s"] > 0


def test_server_command_sets_device_pool_and_its_own_admin_socket(tmp_path):
    cmd = ge.server_command(ge.GPU_PLAN, tmp_path / "m", tmp_path / "c", 1234, tmp_path / "a.sock")
    assert cmd[:4] == [sys.executable, "-m", "tokenloom.daemon", "serve"]
    sets = [cmd[i + 1] for i, c in enumerate(cmd) if c == "--set"]
    assert 'model.device="cuda"' in sets and "cache.num_blocks=8192" in sets
    assert f'admin.socket_path="{tmp_path / "a.sock"}"' in sets
    from tokenloom.daemon.__main__ import _parse_set
    parsed = _parse_set(sets)
    assert parsed["model.device"] == "cuda" and parsed["scheduler.max_num_seqs"] == 64
    from tokenloom.config.load import load_config
    load_config(None, overrides={**parsed, "model.model": str(tmp_path)})   # valid config
    env = ge.server_env(f"/x{__import__('os').pathsep}/y")
    assert env["PYTHONPATH"].split(__import__("os").pathsep)[:2] == ["/x", "/y"]


GOOD = {"checkpoint": {"seconds": 1},
        "offline": {"complete": True, "graphs": {"replays": 40}, "backend": "triton"},
        "parity": {"prompts": 5, "matched": 5, "mismatches": []},
        "http": {"load": {"requests": 100, "errors": 0}, "graphs": {"replays": 900},
                 "exit_code": 0}}


def test_failures_say_why_the_engine_part_fails():
    import copy
    assert ge.failures(GOOD, on_gpu=True) == []
    bad = copy.deepcopy(GOOD)
    bad["offline"]["graphs"]["replays"] = 0
    bad["offline"]["backend"] = "torch"
    bad["parity"].update(matched=4, mismatches=[{"prompt": 2}])
    bad["http"]["load"].update(errors=3, first_error="500 boom")
    bad["http"]["graphs"]["replays"] = 0
    bad["http"]["exit_code"] = -9
    problems = " | ".join(ge.failures(bad, on_gpu=True))
    for expected in ("offline: no CUDA graph was replayed", "1 of 5 greedy outputs differ",
                     "3 of 100 requests failed (500 boom)", "no CUDA graph was replayed during",
                     "exited with -9", "decode attention ran on 'torch', not Triton"):
        assert expected in problems, problems
    cpu = ge.failures(bad, on_gpu=False)   # no graphs on CPU: replays are not required
    assert not any("replayed" in p for p in cpu) and len(cpu) == 3
    crashed = {**GOOD, "http": {"error": "Traceback ...\nRuntimeError: the server exited"}}
    assert ge.failures(crashed, True) == ["engine http raised: RuntimeError: the server exited"]
    missing = {k: v for k, v in GOOD.items() if k != "parity"}
    assert ge.failures(missing, True) == ["engine parity: did not run"]


# Modules in this venv that a GPU host (torch, triton, transformers, tokenizers, safetensors,
# aiohttp, uvloop, hypothesis, pytest, nvidia-ml-py) does not have, unless carried as wheels.
NOT_ON_GPU_HOST = ("msgspec", "structlog", "pytest_asyncio", "zmq", "prometheus_client",
                   "xgrammar", "gguf", "accelerate", "ninja", "openai", "schemathesis",
                   "pytest_timeout", "jsonschema", "kubernetes_validate")


def test_what_the_engine_and_server_import_is_on_the_host_or_carried():
    """The engine part imports LLM in-process and starts `tokenloom serve`: every module
    they import at start-up that a GPU host lacks must be in gpu_check's carried lists."""
    gc_ = _load("gpu_check")
    carried = set(gc_.CARRIED) | set(gc_.SERVER_CARRIED)
    blocked = sorted(set(NOT_ON_GPU_HOST) - carried)
    code = (
        "import importlib.abc, sys\n"
        f"BLOCKED = {blocked!r}\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ImportError(f'{name} is not on the GPU host')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import tokenloom.actors.llm, tokenloom.actors.engine, tokenloom.daemon.__main__\n"
        "import tokenloom.daemon.app, tokenloom.daemon.lifecycle\n"
        "import tokenloom.kernels.models.random_model\n"
        "import tokenloom.graphs.capture, tokenloom.kernels.gpu.triton_attention\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
