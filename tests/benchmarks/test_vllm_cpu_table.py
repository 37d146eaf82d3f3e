"""benchmarks/vllm_cpu.py's table over interleaved rounds: each figure is the median over
rounds with its spread (max / min), and the ratio is taken between medians, inverted for
times; a figure a round lacks is skipped, not counted as zero."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import vllm_cpu  # noqa: E402


def _server(prefill_ms: float, tok_s: float) -> dict:
    return {"prefill_1024_ttft_ms": {"median": prefill_ms},
            "streams": {1: {"output_tokens_per_s": tok_s, "itl_ms": {"p99": 10.0}}}}


def test_median_and_spread_over_rounds():
    rounds = [{"bf16": _server(900, 60)}, {"bf16": _server(1000, 50)},
              {"bf16": _server(800, 70)}, {"vllm": _server(1, 1)}]
    get = lambda r: r["prefill_1024_ttft_ms"]["median"]   # noqa: E731
    assert vllm_cpu.figure(rounds, "bf16", get) == (900, 1000 / 800)
    assert vllm_cpu.figure(rounds, "q4", get) == (None, None)


def test_table_ratios_are_between_medians(capsys):
    out = {"rounds": [{"bf16": _server(900, 60), "vllm": _server(1000, 30)},
                      {"bf16": _server(700, 80), "vllm": _server(800, 50)}]}
    vllm_cpu.print_table(out, [1])
    lines = {line.split("  ")[0]: line for line in capsys.readouterr().out.splitlines()}
    prefill = lines["prefill 1,024 TTFT median (ms)"].split()
    # medians: bf16 800 ms, vLLM 900 ms -> 900 / 800 = 1.12x (a time: inverted)
    assert prefill[-5:] == ["800.0", "900.0", "1.29x", "1.25x", "1.12x"]
    tok = lines["1 stream(s): out tok/s"].split()
    assert tok[-5:] == ["70.0", "40.0", "1.33x", "1.67x", "1.75x"]


def test_variant_names_a_bf16_server_with_more_settings():
    assert vllm_cpu.parse_variant("static:scheduler.chunking=static,scheduler.x=1") == (
        "static", ["scheduler.chunking=static", "scheduler.x=1"])
    for bad in ("static", "static:", "bf16:a=1", "vllm:a=1", ":a=1", "s:novalue"):
        with pytest.raises(argparse.ArgumentTypeError):
            vllm_cpu.parse_variant(bad)
