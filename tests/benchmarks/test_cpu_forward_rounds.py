"""benchmarks/cpu_forward.py --rounds: each server's figures are medians over its rounds,
with every round kept and the spread (max / min) beside them; the table's ratios are then
between medians."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import cpu_forward  # noqa: E402


def _run(decode: float, prefill: float) -> dict:
    return {"decode_300_ms": decode, "decode_1100_ms": decode + 1, "prefill_1024_tok_s": prefill,
            "batch1_step_ms": decode - 1, "batch16_step_ms": 3 * decode,
            "weight_bytes": 1000, "startup_s": 1.0}


def test_medians_over_rounds_with_spread():
    runs = [_run(10, 900), _run(14, 700), _run(12, 1000)]
    merged = cpu_forward.merge_rounds(runs)
    assert merged["decode_300_ms"] == 12 and merged["prefill_1024_tok_s"] == 900
    assert merged["spread"]["decode_300_ms"] == 14 / 10
    assert merged["rounds"] == runs
    assert cpu_forward.merge_rounds([runs[0]]) == runs[0]   # one round: as measured


def test_a_figure_one_round_lacks_is_left_out_of_its_median():
    runs = [_run(10, 900), {**_run(20, 500), "startup_warm_s": 4.0}]
    merged = cpu_forward.merge_rounds(runs)
    assert merged["startup_warm_s"] == 4.0 and merged["decode_300_ms"] == 15


def test_report_ratios_are_between_medians():
    out = {"read_bandwidth_gbs": 30.0, "threads": 2, "rounds": 3, "modes": {"bf16": {
        "tokenloom": cpu_forward.merge_rounds([_run(10, 900), _run(14, 700), _run(12, 1000)]),
        "llama": cpu_forward.merge_rounds([_run(11, 400), _run(13, 500), _run(9, 450)])}}}
    lines = cpu_forward.report(out)
    assert "medians over 3 alternating rounds" in lines[0]
    row = next(line for line in lines if "~300 ctx" in line).split("|")
    assert [c.strip() for c in row[3:6]] == ["12.00", "11.00", "0.92x"]


def test_roofline_uses_the_median_of_the_bandwidth_samples():
    """The bandwidth is measured before every round; the report names the samples' range
    and prices the roofline at their median."""
    out = {"read_bandwidth_gbs": 30.0, "read_bandwidth_samples_gbs": [29.0, 30.0, 48.0],
           "threads": 2, "rounds": 1, "modes": {"bf16": {
               "tokenloom": _run(10, 900), "llama": _run(11, 400)}}}
    lines = cpu_forward.report(out)
    assert "read bandwidth 30.0 GB/s (median of 3 measurements, 29.0-48.0, 2 threads)" \
        in lines[0]
    row = next(line for line in lines if "~300 ctx" in line).split("|")
    roof = cpu_forward.roofline_ms(1000, 30 * 2 * 3 * 64 * 2, 300, 30.0)
    assert row[6].strip().startswith(f"{roof:.2f} ms")
