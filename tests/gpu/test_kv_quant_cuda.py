"""CUDA-only checks of the quantized KV cache (run by `make gpu-check`; skipped, with the
reason, where no CUDA GPU exists): the Triton decode over fp8/int8 caches against the
reference, its speed at 8k context against the bf16 cache (printed), the graph-safe Triton
store against the torch store, and an engine decoding through CUDA graphs from an fp8
cache without leaking a block."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (none here); run `make gpu-check` on a GPU host"),
]

HEADS, KV_HEADS, HEAD_DIM, BS = 32, 8, 128, 16


class _Spec:
    num_heads, num_kv_heads, head_dim = HEADS, KV_HEADS, HEAD_DIM


def _filled(fmt: str | None, blocks: int, seed: int = 0):
    from tokenloom.kernels.kv_quant import kv_format
    from tokenloom.kernels.kv_store import KVCache, store_kv

    f = kv_format(fmt) if fmt else None
    kv = KVCache.allocate(1, blocks, BS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda", f, f)
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = blocks * BS
    k = torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", generator=g)
    k[:, :, 3] *= 20
    v = torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", generator=g)
    store_kv(k.bfloat16(), v.bfloat16(), kv.key[0], kv.value[0],
             torch.arange(n, device="cuda"))
    return kv


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_triton_decode_matches_the_reference_and_reports_its_speed(fmt):
    from tokenloom.kernels.attention import decode_attention
    from tokenloom.kernels.gpu.triton_attention import make_decode_kernel

    ctx, batch = 8192, 16
    per_seq = ctx // BS
    kv = _filled(fmt, batch * per_seq)
    tables = torch.arange(batch * per_seq, device="cuda").view(batch, per_seq)
    lens = torch.full((batch,), ctx, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda").bfloat16()
    decode = make_decode_kernel(_Spec)
    ref = decode_attention(q, kv.key[0], kv.value[0], tables, lens, ctx, HEAD_DIM ** -0.5)
    out = decode(q, kv.key[0], kv.value[0], tables, lens, ctx, HEAD_DIM ** -0.5)
    assert (out.float() - ref.float()).abs().max().item() < 3e-2
    plain = _filled(None, batch * per_seq)

    def timed(cache) -> float:
        for _ in range(3):
            decode(q, cache.key[0], cache.value[0], tables, lens, ctx, HEAD_DIM ** -0.5)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            decode(q, cache.key[0], cache.value[0], tables, lens, ctx, HEAD_DIM ** -0.5)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 20
    t_q, t_bf16 = timed(kv), timed(plain)
    print(f"Triton decode 16 x {ctx}, {fmt} cache: {t_q * 1e6:.0f} us vs bf16 "
          f"{t_bf16 * 1e6:.0f} us ({t_bf16 / t_q:.2f}x)")


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_triton_store_matches_the_torch_store(fmt):
    from tokenloom.kernels.gpu.triton_attention import store_kv_quant_triton
    from tokenloom.kernels.kv_quant import kv_format
    from tokenloom.kernels.kv_store import KVCache, store_kv

    f = kv_format(fmt)
    a = KVCache.allocate(1, 8, BS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda", f, f)
    b = KVCache.allocate(1, 8, BS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda", f, f)
    k = torch.randn(40, KV_HEADS, HEAD_DIM, device="cuda").bfloat16()
    v = torch.randn(40, KV_HEADS, HEAD_DIM, device="cuda").bfloat16()
    slots = torch.arange(40, device="cuda") * 3 % 128
    slots[5] = -1
    store_kv(k, v, a.key[0], a.value[0], slots, has_skip=True)
    store_kv_quant_triton(k, v, b.key[0], b.value[0], slots)
    assert torch.equal(a.pool, b.pool) and torch.equal(a.scales, b.scales)


def test_engine_decodes_through_graphs_from_an_fp8_cache(tmp_path):
    pytest.importorskip("msgspec")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from tokenloom import LLM, SamplingParams

    from tinymodel import build_tiny_model

    build_tiny_model(tmp_path / "m", "LlamaConfig", dict(num_hidden_layers=2),
                     seed=7)
    prompts = [[5 + (i * 11 + k) % 150 for k in range(40)] for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    opts = dict(quiet=True, device="cuda", dtype="bfloat16", cache_dir=str(tmp_path / "c"),
                block_size=16, num_blocks=64, max_num_seqs=8, kv_dtype="fp8_e4m3",
                force_kv_dtype=True)
    with LLM(model=str(tmp_path / "m"), **opts) as llm:
        outs = llm.generate(prompts, sp)
        assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
        assert llm.graph_stats().graph_steps > 0, llm.graph_stats()
        llm.check_integrity()
        assert llm.kv_stats().used == 0
