"""benchmarks/cpu_forward.py's pure parts: the roofline arithmetic and the report table
(ratios are llama.cpp time / tokenloom time, so > 1 means tokenloom is faster)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import cpu_forward  # noqa: E402


def test_roofline_counts_weights_once_plus_kv():
    # 500 MB of weights + 1,000 tokens x 1 MB of KV at 50 GB/s: 1.5 GB / 50 GB/s = 30 ms.
    assert abs(cpu_forward.roofline_ms(500_000_000, 1_000_000, 1000, 50.0) - 30.0) < 1e-9


def test_report_has_ratios_and_roofline():
    ours = {"decode_300_ms": 10.0, "decode_1100_ms": 12.0, "prefill_1024_tok_s": 1200.0,
            "batch1_step_ms": 10.0, "batch16_step_ms": 20.0, "weight_bytes": 500_000_000,
            "startup_warm_s": 3.0, "startup_cold_s": 60.0}
    peer = {"decode_300_ms": 15.0, "decode_1100_ms": 12.0, "prefill_1024_tok_s": 600.0,
            "batch1_step_ms": 15.0, "batch16_step_ms": 40.0, "startup_s": 1.0}
    out = {"read_bandwidth_gbs": 50.0, "threads": 2,
           "modes": {"fp32": {"tokenloom": ours, "llama": peer}}}
    text = "\n".join(cpu_forward.report(out))
    assert "| 10.00 | 15.00 | 1.50x |" in text          # decode at ~300: 1.5x faster
    assert "| 12.00 | 12.00 | 1.00x |" in text
    assert "| 1200 | 600 | 2.00x |" in text             # prefill
    assert "20.0 / 10.0 ms = 2.00x" in text and "40.0 / 15.0 ms = 2.67x" in text
    assert "cold 60.0 s, warm 3.0 s" in text
