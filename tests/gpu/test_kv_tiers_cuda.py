"""CUDA-only checks of the KV tiers (run by `make gpu-check`; skipped, with the reason, where
no CUDA GPU exists): blocks copied device -> host -> device are bit-identical, the copy
bandwidth is printed, and an engine on the GPU whose prefixes are evicted and restored
from host memory gives the same greedy tokens as recomputing them."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (none here); run `make gpu-check` on a GPU host"),
]


def test_block_copies_round_trip_on_the_device():
    from tokenloom.kernels.kv_store import KVCache, gather_blocks, scatter_blocks

    kv = KVCache.allocate(32, 512, 16, 8, 128, torch.bfloat16, "cuda")
    kv.pool.normal_()
    ids = list(range(0, 512, 4))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    rows = gather_blocks(kv.pool, ids)
    torch.cuda.synchronize()
    down = time.perf_counter() - t0
    before = kv.pool[:, :, ids].clone()
    kv.pool[:, :, ids] = 0
    t0 = time.perf_counter()
    scatter_blocks(kv.pool, ids, rows)
    torch.cuda.synchronize()
    up = time.perf_counter() - t0
    assert torch.equal(kv.pool[:, :, ids], before)
    nbytes = rows.numel()
    print(f"KV tier copies: {nbytes / 2**20:.0f} MiB device->host {nbytes / down / 1e9:.1f} GB/s, "
          f"host->device {nbytes / up / 1e9:.1f} GB/s")


def test_restored_prefixes_match_recompute_on_the_gpu(tmp_path):
    pytest.importorskip("msgspec")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from tokenloom import LLM, SamplingParams

    from tinymodel import build_tiny_model

    build_tiny_model(tmp_path / "m", "LlamaConfig", dict(num_hidden_layers=2), seed=7)
    prompts = [[5 + (i * 11 + k) % 150 for k in range(40)] for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    opts = dict(quiet=True, device="cuda", dtype="float32", cache_dir=str(tmp_path / "c"),
                block_size=8, num_blocks=24, max_num_seqs=2)
    with LLM(model=str(tmp_path / "m"), **opts) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    with LLM(model=str(tmp_path / "m"), **opts, **{"kv_tiers.enabled": True,
                                                    "kv_tiers.host_bytes": 1 << 24}) as llm:
        llm.generate(prompts, sp)
        outs = llm.generate(prompts, sp)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert any((o.outputs[0].timings.cached_tokens_by_tier or {}).get("host")
                   for o in outs)
        llm.check_integrity()
