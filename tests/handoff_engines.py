"""Shared by the CPU test and the GPU check of the handoff tier between two engines
(tests/actors/kv/tiers/test_handoff_engines.py, tests/gpu/test_disagg_cuda.py): engine A
writes every computed block through to a shared handoff directory (a prefill worker),
engine B only reads it (a decode worker). B's greedy tokens for the same prompts equal A's,
B restores the prompts from the "peer" tier instead of computing them, and both pools pass
their integrity checks. Returns B's seconds per request (restore + 8 tokens; for the GPU record)."""

from __future__ import annotations

import time
from pathlib import Path


def run_handoff_between_engines(tmp_path: Path, device: str) -> list[float]:
    from tokenloom import LLM, SamplingParams
    from tokenloom.actors.kv.tiers.handoff import stored_blocks

    from tinymodel import build_tiny_model

    build_tiny_model(tmp_path / "m", "LlamaConfig", dict(num_hidden_layers=2), seed=11)
    prompts = [[5 + (i * 13 + k) % 150 for k in range(41 + 8 * i)] for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    shared = tmp_path / "handoff"
    opts = dict(quiet=True, device=device, dtype="float32", cache_dir=str(tmp_path / "c"),
                block_size=8, num_blocks=128, max_num_seqs=4)
    # always_restore: on a tiny model recomputing is as cheap as reading a file, and the
    # cost planner would (rightly) recompute; the check is about the restore.
    tiers = {"kv_tiers.enabled": True, "kv_tiers.host_bytes": 0,
             "kv_tiers.peer_path": str(shared), "kv_tiers.planner": "always_restore"}
    with LLM(model=str(tmp_path / "m"), **opts,
             **{**tiers, "kv_tiers.peer_write": "through"}) as prefill:
        want = [o.outputs[0].token_ids for o in prefill.generate(prompts, sp)]
        prefill.check_integrity()
    assert len(stored_blocks(shared)) >= sum(len(p) // 8 for p in prompts) - len(prompts)
    fetch = []
    with LLM(model=str(tmp_path / "m"), **opts,
             **{**tiers, "kv_tiers.peer_write": "off"}) as decode:
        for p, w in zip(prompts, want):
            t0 = time.perf_counter()
            (out,) = decode.generate([p], sp)
            fetch.append(time.perf_counter() - t0)
            o = out.outputs[0]
            assert o.token_ids == w
            restored = (o.timings.cached_tokens_by_tier or {}).get("peer", 0)
            assert restored >= (len(p) - 1) // 8 * 8 - 8, (len(p), o.timings)
        decode.check_integrity()
    return fetch
