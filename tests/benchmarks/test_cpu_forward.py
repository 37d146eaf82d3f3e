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


def test_each_round_is_priced_at_its_own_bandwidth():
    """The machine's bandwidth moves between rounds: a round's fraction of the roofline uses
    the sample taken just before it, and llama.cpp's uses its GGUF's bytes and an f16 KV."""
    kv = 30 * 2 * 3 * 64   # the default model's KV elements a token
    rounds = [{"decode_300_ms": 10.0, "decode_1100_ms": 12.0, "read_bandwidth_gbs": 50.0},
              {"decode_300_ms": 20.0, "decode_1100_ms": 24.0, "read_bandwidth_gbs": 25.0}]
    ours = cpu_forward.merge_rounds([dict(r, weight_bytes=400_000_000) for r in rounds])
    fr = cpu_forward.round_fractions(ours, 400_000_000, kv * 4, 300)
    # both rounds ran at the same fraction of their own bandwidth's roofline
    want = cpu_forward.roofline_ms(400_000_000, kv * 4, 300, 50.0) / 10.0
    assert len(fr) == 2 and all(abs(f - want) < 1e-9 for f in fr)
    peer = cpu_forward.merge_rounds([dict(r, gguf_bytes=100_000_000, startup_s=1.0,
                                          prefill_1024_tok_s=500.0, batch1_step_ms=10.0,
                                          batch16_step_ms=20.0) for r in rounds])
    ours.update(prefill_1024_tok_s=1000.0, batch1_step_ms=10.0, batch16_step_ms=20.0)
    out = {"read_bandwidth_gbs": 37.5, "threads": 2,
           "modes": {"fp32": {"tokenloom": ours, "llama": peer}}}
    text = "\n".join(cpu_forward.report(out))
    assert f"own rounds {want:.0%}-{want:.0%}" in text
    peer_want = cpu_forward.roofline_ms(100_000_000, kv * 2, 300, 50.0) / 10.0
    assert f"own rounds {peer_want:.0%}-{peer_want:.0%}" in text
