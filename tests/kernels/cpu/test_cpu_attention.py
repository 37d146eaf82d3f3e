"""The C++ CPU decode kernel against the torch reference (kernels/attention.py)."""

from __future__ import annotations

import os

import pytest
import torch

from tokenloom.arith import cdiv
from tokenloom.kernels.attention import decode_attention
from tokenloom.kernels.cpu.attention import (
    cpu_kernel_status,
    load_cpu_decode_kernel,
    paged_decode_cpu,
)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if load_cpu_decode_kernel() is None:
        pytest.fail(f"the CPU decode kernel must build on the CI machine: {cpu_kernel_status()}")


CASES = [  # (heads, kv_heads, head_dim, block_size)
    (4, 4, 64, 16),     # GQA ratio 1 (MHA)
    (9, 3, 64, 16),     # ratio 3 (SmolLM2)
    (32, 4, 128, 32),   # ratio 8
    (8, 1, 128, 16),    # MQA
    (10, 2, 80, 16),    # ratio 5: a second, partial quad of heads; 5 vectors a row
    (6, 2, 40, 16),     # head_dim not a multiple of 16: AVX2's vector path, else scalar
    (6, 2, 36, 16),     # nor of 8: the scalar loops
]


@pytest.fixture
def path(request):
    """"vector": the widest SIMD path built (AVX-512 or AVX2) where the shape allows it;
    "scalar": the plain loops, forced."""
    module = load_cpu_decode_kernel()
    module.use_vector_path(request.param == "vector")
    yield request.param
    module.use_vector_path(True)


def test_the_vector_path_built_is_the_widest_the_cpu_has():
    from tokenloom.kernels.cpu.features import detect
    flags = detect().flags
    want = ("avx512" if {"avx512f", "avx512bw"} <= flags
            else "avx2" if {"avx2", "fma"} <= flags else "scalar")
    assert load_cpu_decode_kernel().decode_vector_path() == want


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["vector", "scalar"], indirect=True)
def test_matches_reference(heads, kv_heads, head_dim, block_size, dtype, path):
    g = torch.Generator().manual_seed(heads * 1000 + head_dim)
    num_blocks = 300
    # Context lengths straddle block boundaries: 1, a full block, one past it, long ones.
    lens = torch.tensor([1, block_size, block_size + 1, 2 * block_size - 1, 777, 2000])
    batch = len(lens)
    max_blocks = cdiv(int(lens.max()), block_size)
    kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks]
                          for _ in range(batch)])
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    ref = decode_attention(q.float(), kc.float(), vc.float(), tables, lens, int(lens.max()), scale)
    out = paged_decode_cpu(q, kc, vc, tables, lens, int(lens.max()), scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref).abs().max().item() < tol


def test_padded_table_entries_are_never_read():
    """Block-table columns past a sequence's context may hold garbage (padding)."""
    kc = torch.randn(8, 16, 2, 64)
    vc = torch.randn(8, 16, 2, 64)
    tables = torch.tensor([[3, 10**9], [5, 1]])  # row 0's second entry is out of range
    lens = torch.tensor([16, 20])
    q = torch.randn(2, 4, 64)
    out = paged_decode_cpu(q, kc, vc, tables, lens, 20, 0.125)
    ref = decode_attention(q, kc, vc, torch.tensor([[3, 0], [5, 1]]), lens, 20, 0.125)
    assert torch.allclose(out, ref, atol=1e-5)


def _with_threads(n: int, fn):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(saved)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_kernel_spreads_sequences_over_torch_threads():
    """Built without OpenMP, at::parallel_for is a plain loop: the kernel then runs on one
    core whatever torch's thread count (the decode half of every step at half speed)."""
    module = load_cpu_decode_kernel()
    assert _with_threads(2, lambda: module.parallel_threads(64)) == 2
    assert _with_threads(1, lambda: module.parallel_threads(64)) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_does_not_depend_on_thread_count_or_prefetch(dtype):
    """Work items are fixed spans of a sequence (whichever thread takes one), merged in a
    fixed order: bit-identical with 1 or 2 threads. Long contexts (many blocks ahead to
    prefetch) and short ones (none) alike; bf16 takes the vdpbf16ps scores where the CPU
    has them."""
    g = torch.Generator().manual_seed(7)
    kc = torch.randn(200, 16, 3, 64, generator=g).to(dtype)
    vc = torch.randn(200, 16, 3, 64, generator=g).to(dtype)
    lens = torch.tensor([1, 15, 16, 17, 33, 700, 1500, 64])
    tables = torch.stack([torch.randperm(200, generator=g)[:94] for _ in range(len(lens))])
    q = torch.randn(len(lens), 9, 64, generator=g).to(dtype)
    run = lambda: paged_decode_cpu(q, kc, vc, tables, lens, 1500, 0.125)  # noqa: E731
    one, two = _with_threads(1, run), _with_threads(2, run)
    assert torch.equal(one, two)
    ref = decode_attention(q.float(), kc.float(), vc.float(), tables, lens, 1500, 0.125)
    assert (one.float() - ref).abs().max().item() < (1e-5 if dtype == torch.float32 else 2e-2)


def test_bf16_scores_are_fp32_accurate():
    """bf16 K and q (vdpbf16ps where the CPU has it, else widened): the products are exact
    and summed in fp32, so the attention weights match a float64 computation to fp32
    rounding, not to bf16's. A value cache of one-hot rows reads the weights back out (each
    output element is one key's softmax weight, rounded once to bf16 on the way out)."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, bs, ctx = 9, 3, 64, 16, 64
    kc = (torch.randn(8, bs, kv_heads, d, generator=g) * 3).to(torch.bfloat16)
    vc = torch.zeros(8, bs, kv_heads, d, dtype=torch.bfloat16)
    for t in range(ctx):                                  # key t's value: e_t
        vc[t // bs, t % bs, :, t] = 1
    q = torch.randn(1, heads, d, generator=g).to(torch.bfloat16)
    tables = torch.arange(4).view(1, 4)
    lens = torch.tensor([ctx])
    out = paged_decode_cpu(q, kc, vc, tables, lens, ctx, 0.125).double()
    keys = kc[:4].reshape(ctx, kv_heads, d).double()
    for h in range(heads):
        s = (keys[:, h // 3] @ q[0, h].double()) * 0.125
        w = torch.softmax(s, dim=0)
        # one bf16 rounding of the output (2^-8 relative) and fp32 noise, nothing more
        assert torch.allclose(out[0, h], w, rtol=2 ** -8, atol=1e-6), h


@pytest.mark.parametrize("k_fmt,v_fmt", [("int8", "int8"), ("fp8_e4m3", "fp8_e4m3"),
                                         ("fp8_e5m2", "fp8_e5m2"), ("fp8_e4m3", "int8")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_cache_matches_reference(k_fmt, v_fmt, dtype):
    """A 1-byte cache (kernels/kv_quant.py): the kernel decodes each format in registers
    and folds the per-token scales in; the reference dequantizes first."""
    from tokenloom.kernels.kv_quant import FORMATS
    from tokenloom.kernels.kv_store import KVCache, store_kv

    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(11)
    lens = torch.tensor([1, bs, bs + 1, 300, 777])
    kv = KVCache.allocate(1, 100, bs, kv_heads, head_dim, dtype, "cpu", FORMATS[k_fmt],
                          FORMATS[v_fmt])
    n = 100 * bs
    k = torch.randn(n, kv_heads, head_dim, generator=g)
    k[:, :, 5] *= 30                                    # an outlier channel
    store_kv(k.to(dtype), torch.randn(n, kv_heads, head_dim, generator=g).to(dtype),
             kv.key[0], kv.value[0], torch.randperm(n, generator=g))
    tables = torch.stack([torch.randperm(100, generator=g)[:cdiv(777, bs)]
                          for _ in range(len(lens))])
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    ref = decode_attention(q, kv.key[0], kv.value[0], tables, lens, 777, 0.125)
    out = paged_decode_cpu(q, kv.key[0], kv.value[0], tables, lens, 777, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (out.float() - ref.float()).abs().max().item() < tol
    # A promoted layer (model-dtype copy) goes through the plain kernel, and one promoted
    # side of two through the reference.
    kv.value[0].promote()
    out = paged_decode_cpu(q, kv.key[0], kv.value[0], tables, lens, 777, 0.125)
    assert (out.float() - ref.float()).abs().max().item() < tol
    kv.key[0].promote()
    out = paged_decode_cpu(q, kv.key[0], kv.value[0], tables, lens, 777, 0.125)
    assert (out.float() - ref.float()).abs().max().item() < tol


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 128), (10, 2, 80),
                                                      (6, 2, 40)])
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_quantized_cache_decodes_every_code(heads, kv_heads, head_dim, fmt):
    """Every finite code of each format, in every head shape: the vector path (head sizes
    that are whole 16-lane vectors: 64, 128, 80) and the scalar loops (40) decode the codes
    in their own ways and must agree with the reference's torch decode; a span's partials
    and their merge (a 2,000-token context is 32 spans) are checked on the way, and the
    result does not depend on the thread count."""
    from tokenloom.kernels.kv_quant import FORMATS
    from tokenloom.kernels.kv_store import KVCache

    f, bs, blocks = FORMATS[fmt], 16, 130
    g = torch.Generator().manual_seed(head_dim + len(fmt))
    kv = KVCache.allocate(1, blocks, bs, kv_heads, head_dim, torch.float32, "cpu", f, f)
    # fp8 e4m3's 0x7f and e5m2's 0x7c-0x7f are NaN / inf: the store never writes them.
    top = {"int8": 0x7F, "fp8_e4m3": 0x7E, "fp8_e5m2": 0x7B}[fmt]
    for cache in (kv.key[0], kv.value[0]):
        codes = torch.randint(0, 256, cache.data.shape, dtype=torch.int32, generator=g)
        sign, mag = codes & 0x80, (codes & 0x7F).clamp_(max=top)
        if fmt == "int8":
            mag = mag.clamp_(max=127)
        cache.data.copy_((sign | mag).to(torch.uint8))
        cache.scale.copy_(torch.rand(cache.scale.shape, generator=g) * 2 / f.qmax)
    lens = torch.tensor([1, 17, 300, 2000])
    tables = torch.stack([torch.randperm(blocks, generator=g)[:cdiv(2000, bs)]
                          for _ in range(len(lens))])
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    ref = decode_attention(q, kv.key[0], kv.value[0], tables, lens, 2000, head_dim ** -0.5)
    run = lambda: paged_decode_cpu(q, kv.key[0], kv.value[0], tables, lens, 2000,  # noqa: E731
                                   head_dim ** -0.5)
    one, two = _with_threads(1, run), _with_threads(2, run)
    assert torch.equal(one, two)
    assert (one - ref).abs().max().item() < 1e-5


PREFILL_CASES = [  # (queries, context, heads, kv_heads, head_dim)
    (1, 1, 4, 4, 64),       # one token, nothing before it
    (37, 37, 9, 3, 64),     # a fresh prompt, not a whole tile of rows or keys
    (64, 300, 9, 3, 64),    # a continuation chunk: 236 earlier keys
    (5, 1000, 8, 1, 128),   # a few rows (a speculative verify) at a long context, MQA
    (20, 50, 4, 2, 80),     # a head size that is not a whole number of 16-lane vectors
    (7, 30, 2, 1, 63),      # an odd head size: bf16 takes the fp32 kernel
    (9, 40, 3, 3, 72),      # a last value vector of 8 lanes (masked output store)
    (300, 300, 32, 4, 128),
]


@pytest.mark.parametrize("n,ctx,heads,kv_heads,head_dim", PREFILL_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_matches_sdpa(n, ctx, heads, kv_heads, head_dim, dtype):
    from torch.nn import functional as F

    from tokenloom.kernels.cpu.attention import prefill_attention_cpu

    g = torch.Generator().manual_seed(n * 7 + ctx)
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    # k, v as the model passes them: [KVH, ctx, D] views of [ctx, KVH, D] rows.
    k = torch.randn(ctx, kv_heads, head_dim, generator=g).to(dtype).transpose(0, 1)
    v = torch.randn(ctx, kv_heads, head_dim, generator=g).to(dtype).transpose(0, 1)
    scale = head_dim ** -0.5
    out = prefill_attention_cpu(q, k, v, scale)
    # query i at position ctx - n + i sees keys 0 .. ctx - n + i
    mask = torch.ones(n, ctx, dtype=torch.bool).tril_(ctx - n)
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float()[None],
                                         v.float()[None], attn_mask=mask, scale=scale,
                                         enable_gqa=True)[0].transpose(0, 1)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 2e-6 if dtype == torch.float32 else 2e-2   # bf16: the output's rounding
    err = (out.float() - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item())
    if dtype == torch.bfloat16:
        # No worse than torch's own bf16 SDPA (which also rounds P to bf16 before P . V).
        sdpa = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                              attn_mask=mask, scale=scale,
                                              enable_gqa=True)[0].transpose(0, 1)
        assert err <= 2 * (sdpa.float() - ref).abs().max().item() + 4e-3


@pytest.mark.parametrize("n,ctx", [(64, 300), (37, 37), (1, 2)])
def test_bf16_prefill_repacks_rows_the_same_whatever_their_strides(n, ctx):
    """Rows contiguous in head_dim (the model's views) are repacked in place; any other
    layout is made contiguous first. Bit-identical output, odd contexts (a last key pair
    with one key) included."""
    from tokenloom.kernels.cpu.attention import prefill_attention_cpu

    g = torch.Generator().manual_seed(ctx)
    q = torch.randn(n, 9, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(ctx, 3, 64, generator=g).to(torch.bfloat16).transpose(0, 1)
    v = torch.randn(ctx, 3, 64, generator=g).to(torch.bfloat16).transpose(0, 1)
    # the same values with head_dim strided: [KVH, D, ctx] storage seen as [KVH, ctx, D]
    k2 = k.transpose(1, 2).contiguous().transpose(1, 2)
    v2 = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert k.stride(2) == 1 and k2.stride(2) != 1
    assert torch.equal(prefill_attention_cpu(q, k, v, 0.125),
                       prefill_attention_cpu(q, k2, v2, 0.125))


def test_bf16_prefill_runs_the_bf16_dot_kernel_where_the_cpu_has_it():
    from tokenloom.kernels.cpu.attention import load_cpu_decode_kernel
    from tokenloom.kernels.cpu.features import detect

    module = load_cpu_decode_kernel()
    assert module.prefill_bf16_dot_built() == ("avx512_bf16" in detect().flags)


@pytest.mark.parametrize("n,start,head_dim", [(64, 0, 64), (64, 192, 64), (37, 100, 64),
                                              (1, 0, 64), (5, 27, 80), (9, 40, 63)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_reads_the_pool_as_the_gathered_context(n, start, head_dim, dtype):
    """The paged entry reads K/V rows through the block table, blocks scattered over the
    pool: bit-identical to the kernel over the gathered context, for chunks that start
    mid-block and end mid-block."""
    from tokenloom.kernels.attention import gather_context
    from tokenloom.kernels.cpu.attention import prefill_attention_cpu, prefill_attention_paged_cpu

    g = torch.Generator().manual_seed(n * 31 + start)
    bs, kvh, heads, ctx = 16, 3, 9, start + n
    kc = torch.randn(64, bs, kvh, head_dim, generator=g).to(dtype)
    vc = torch.randn(64, bs, kvh, head_dim, generator=g).to(dtype)
    table = torch.randperm(64, generator=g)[:cdiv(ctx, bs)]
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    k = gather_context(kc, table)[:ctx].transpose(0, 1)
    v = gather_context(vc, table)[:ctx].transpose(0, 1)
    gathered = prefill_attention_cpu(q, k, v, 0.125)
    assert torch.equal(prefill_attention_paged_cpu(q, kc, vc, table, start, 0.125), gathered)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_gives_later_keys_exactly_zero_weight(dtype):
    """Causality is exact, not approximate: the first m queries of a chunk come out
    bit-identical whether or not the chunk's later keys (visible only to later queries,
    here made huge) exist at all."""
    from tokenloom.kernels.cpu.attention import prefill_attention_cpu

    g = torch.Generator().manual_seed(5)
    n, before, m = 40, 70, 13
    q = torch.randn(n, 9, 64, generator=g).to(dtype)
    k = torch.randn(3, before + n, 64, generator=g).to(dtype)
    v = torch.randn(3, before + n, 64, generator=g).to(dtype)
    k[:, before + m:] *= 1000
    v[:, before + m:] *= 1000
    full = prefill_attention_cpu(q, k, v, 0.125)
    cut = prefill_attention_cpu(q[:m], k[:, :before + m], v[:, :before + m], 0.125)
    assert torch.equal(full[:m], cut)


def test_paged_prefill_rejects_a_block_outside_the_pool():
    from tokenloom.kernels.cpu.attention import prefill_attention_paged_cpu

    kc = torch.zeros(4, 16, 1, 64)
    q = torch.zeros(3, 2, 64)
    with pytest.raises(RuntimeError, match="block 9 is outside the cache"):
        prefill_attention_paged_cpu(q, kc, kc, torch.tensor([0, 9]), 20, 0.125)
    with pytest.raises(RuntimeError, match="block table covering the context"):
        prefill_attention_paged_cpu(q, kc, kc, torch.tensor([0]), 20, 0.125)


# -- a bf16 / fp16 pool under an fp32 model (cache.kv_dtype bf16 / fp16) ---------------------
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", CASES)
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["vector", "scalar"], indirect=True)
def test_an_fp32_query_over_a_two_byte_pool_reads_it_widened(heads, kv_heads, head_dim,
                                                             block_size, pool_dtype, path):
    """Exactly the fp32 kernel over the same values widened to fp32 (bf16 keys must not take
    the bf16-query dot product: the query stays fp32), vector path and scalar loops."""
    g = torch.Generator().manual_seed(heads * 7 + head_dim)
    lens = torch.tensor([1, block_size + 1, 300, 777])
    max_blocks = cdiv(int(lens.max()), block_size)
    kc = torch.randn(120, block_size, kv_heads, head_dim, generator=g).to(pool_dtype)
    vc = torch.randn(120, block_size, kv_heads, head_dim, generator=g).to(pool_dtype)
    tables = torch.stack([torch.randperm(120, generator=g)[:max_blocks] for _ in lens])
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    scale = head_dim ** -0.5
    out = paged_decode_cpu(q, kc, vc, tables, lens, int(lens.max()), scale)
    assert out.dtype == torch.float32
    assert torch.equal(out, paged_decode_cpu(q, kc.float(), vc.float(), tables, lens,
                                             int(lens.max()), scale))
    ref = decode_attention(q, kc, vc, tables, lens, int(lens.max()), scale)   # torch, widened
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("n,start,head_dim", [(64, 0, 64), (37, 100, 64), (5, 27, 80)])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
def test_fp32_prefill_over_a_two_byte_pool_reads_it_widened(n, start, head_dim, pool_dtype):
    from tokenloom.kernels.attention import prefill_attention
    from tokenloom.kernels.cpu.attention import prefill_attention_cpu, prefill_attention_paged_cpu

    g = torch.Generator().manual_seed(n + start)
    bs, ctx = 16, start + n
    kc = torch.randn(64, bs, 3, head_dim, generator=g).to(pool_dtype)
    vc = torch.randn(64, bs, 3, head_dim, generator=g).to(pool_dtype)
    table = torch.randperm(64, generator=g)[:cdiv(ctx, bs)]
    q = torch.randn(n, 9, head_dim, generator=g)
    widened = prefill_attention_paged_cpu(q, kc.float(), vc.float(), table, start, 0.125)
    assert torch.equal(prefill_attention_paged_cpu(q, kc, vc, table, start, 0.125), widened)
    # the gathered entry too (what a kernel without a paged form is given)
    assert torch.equal(prefill_attention(q, kc, vc, table, start, 0.125,
                                         kernel=lambda *a: prefill_attention_cpu(*a)), widened)
    sdpa = prefill_attention(q, kc, vc, table, start, 0.125)        # torch's SDPA, widened
    assert (sdpa - widened).abs().max().item() < 1e-5


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
def test_fp32_rows_are_rounded_into_a_two_byte_pool(pool_dtype):
    from tokenloom.kernels.kv_store import store_kv

    module = load_cpu_decode_kernel()
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(5, 3, 64, generator=g), torch.randn(5, 3, 64, generator=g)
    slots = torch.tensor([3, -1, 70, 100, 5])
    kc, vc = torch.zeros(8, 16, 3, 64, dtype=pool_dtype), torch.zeros(8, 16, 3, 64,
                                                                      dtype=pool_dtype)
    module.store_kv(k, v, kc, vc, slots)
    kt, vt = torch.zeros_like(kc), torch.zeros_like(vc)
    store_kv(k, v, kt, vt, slots, has_skip=True)                   # the torch path
    assert torch.equal(kc, kt) and torch.equal(vc, vt)
    assert torch.equal(kc.view(-1, 3, 64)[70], k[2].to(pool_dtype))
    assert kc.view(-1, 3, 64)[[0, 1, 2, 4, 6]].eq(0).all()          # slot -1 wrote nowhere


def test_a_bf16_query_over_an_fp32_pool_is_refused_by_name():
    q = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    kc = torch.zeros(2, 16, 1, 64)
    with pytest.raises(RuntimeError, match="BFloat16 query over a Float cache"):
        load_cpu_decode_kernel().paged_decode(q, kc, kc, torch.tensor([[0]]),
                                              torch.tensor([3]), 0.125)
    with pytest.raises(RuntimeError, match="fp32 rows into a bf16 or fp16 cache"):
        load_cpu_decode_kernel().store_kv(torch.zeros(1, 1, 64, dtype=torch.bfloat16),
                                          torch.zeros(1, 1, 64, dtype=torch.bfloat16), kc, kc,
                                          torch.tensor([0]))


def test_an_outlier_stays_finite_in_an_fp16_pool():
    from tokenloom.kernels.kv_store import store_kv

    k = torch.full((1, 1, 64), 1e6)
    v = torch.full((1, 1, 64), -1e6)
    kc, vc = torch.zeros(1, 16, 1, 64, dtype=torch.float16), torch.zeros(1, 16, 1, 64,
                                                                         dtype=torch.float16)
    load_cpu_decode_kernel().store_kv(k, v, kc, vc, torch.tensor([2]))
    assert kc[0, 2].eq(65504).all() and vc[0, 2].eq(-65504).all()
    kt, vt = torch.zeros_like(kc), torch.zeros_like(vc)
    store_kv(k, v, kt, vt, torch.tensor([2]))
    assert torch.equal(kt, kc) and torch.equal(vt, vc)
