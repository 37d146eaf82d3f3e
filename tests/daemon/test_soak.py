"""The soak test's short variant (benchmarks/soak.py runs it for as long as you like).

A real `tokenloom serve` (tiny model) gets 15 s of mixed traffic from 4 clients after a
warm-up: streams and non-streams, chat, n > 1, shared prefixes, client disconnects,
requests given up on, a slow reader, bad requests, and admin stats / flush-cache calls.
Then, once idle: every request was answered as expected or cancelled by its client, no KV
block or stream is held, RSS grew less than 64 MiB, asyncio tasks did not grow and open fds
stayed within 4 of the baseline, and the server exits 0 on SIGTERM. The latency-stability
check (p99 of the last window within 1.5x of the first) is the script's: no timing
assertions in the suite.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def _soak_module():
    if str(SCRIPT.parent) not in sys.path:     # what `python benchmarks/soak.py` would see
        sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("tokenloom_soak", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_short_soak_leaks_nothing():
    soak = _soak_module()
    fig = soak.run(duration=15, concurrency=4, seed=3, rss_bound_mib=64, latency_check=False)
    print("soak figures:", fig)
    assert fig["failures"] == []
    assert fig["requests"] >= 100
    outcomes = fig["outcomes"]
    assert outcomes.get("ok", 0) > 0 and outcomes.get("cancelled", 0) > 0
    assert outcomes.get("rejected", 0) > 0
    assert all(fig["by_kind"][k] > 0 for k in ("stream", "n_many", "shared_prefix",
                                               "disconnect", "give_up", "bad"))
    assert fig["admin_calls"] > 0
    assert fig["kv_blocks_used_idle"] == 0 and fig["streams_open_idle"] == 0
