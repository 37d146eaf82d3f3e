"""The C++ CPU attention kernels with a layer's options, a sliding window and soft-capped
scores, against the torch reference (kernels/attention.py).

Every case gives the kernel a hybrid KV layout's block tables: the entries of blocks wholly
behind the window point at block 0, filled with NaN. The reference reads the same tables
over a pool whose block 0 is finite; the kernel must match it, which it can only do if it
never touches a key behind the window (a NaN times a zero weight is still NaN).
"""

from __future__ import annotations

import pytest
import torch

from tokenloom.arith import cdiv
from tokenloom.kernels.attention import decode_attention, gather_context, prefill_attention
from tokenloom.kernels.cpu.attention import (
    cpu_kernel_status,
    load_cpu_decode_kernel,
    paged_decode_cpu,
    prefill_attention_cpu,
    prefill_attention_paged_cpu,
)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if load_cpu_decode_kernel() is None:
        pytest.fail(f"the CPU decode kernel must build on the CI machine: {cpu_kernel_status()}")


@pytest.fixture
def path(request):
    """"vector": the widest SIMD path built where the shape allows it; "scalar": the plain
    loops, forced."""
    module = load_cpu_decode_kernel()
    module.use_vector_path(request.param == "vector")
    yield request.param
    module.use_vector_path(True)


BS = 16
# (window, softcap): windows that are not a multiple of the block size, one longer than a
# vector-path span (64 keys, so a window holds several spans, the first one unaligned), a
# window of the query's own key only; caps that bite on scores ~ N(0, 1) (2.0: both of
# tanh's ranges in the kernels) and one that barely does.
OPTIONS = [(24, None), (37, None), (200, None), (1, None), (None, 2.0), (37, 2.0),
           (200, 30.0)]
# (query dtype, pool dtype): a bf16 pool under an fp32 model is widened as it is read.
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float32, torch.bfloat16)]


def _ids(options):
    window, softcap = options
    return f"w{window}-cap{softcap}"


def behind_window(tables: torch.Tensor, first_keys) -> torch.Tensor:
    """`tables` with each row's entries of blocks wholly before its first visible key
    pointed at block 0 (a hybrid layout's null block)."""
    out = tables.clone()
    for row, first in enumerate(first_keys):
        out[row, : first // BS] = 0
    return out


def poisoned(cache: torch.Tensor) -> torch.Tensor:
    """A copy of the pool whose block 0 is NaN."""
    out = cache.clone()
    out[0] = float("nan")
    return out


DECODE_CASES = [  # (heads, kv_heads, head_dim)
    (8, 2, 64),     # GQA 4: a whole quad of heads per kv head
    (9, 3, 64),     # GQA 3: a partial quad
    (6, 2, 40),     # not whole 16-lane vectors: AVX2's vector path, else the scalar loops
    (6, 2, 36),     # nor 8-lane ones: the scalar loops
]
# Contexts shorter than, equal to and past each window; past a block boundary; long ones.
LENS = [1, 16, 23, 24, 25, 37, 38, 100, 300, 777]


@pytest.mark.parametrize("heads,kv_heads,head_dim", DECODE_CASES)
@pytest.mark.parametrize("q_dtype,pool_dtype", DTYPES)
@pytest.mark.parametrize("options", OPTIONS, ids=_ids)
@pytest.mark.parametrize("path", ["vector", "scalar"], indirect=True)
def test_decode_matches_reference(heads, kv_heads, head_dim, q_dtype, pool_dtype, options,
                                  path):
    window, softcap = options
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    lens = torch.tensor(LENS)
    num_blocks = 200
    kc = torch.randn(num_blocks, BS, kv_heads, head_dim, generator=g).to(pool_dtype)
    vc = torch.randn(num_blocks, BS, kv_heads, head_dim, generator=g).to(pool_dtype)
    nb = cdiv(max(LENS), BS)
    tables = torch.stack([torch.randperm(num_blocks - 1, generator=g)[:nb] + 1 for _ in LENS])
    if window is not None:
        tables = behind_window(tables, [max(0, c - window) for c in LENS])
    q = torch.randn(len(LENS), heads, head_dim, generator=g).to(q_dtype)
    scale = head_dim ** -0.5
    ref = decode_attention(q.float(), kc.float(), vc.float(), tables, lens, max(LENS), scale,
                           window=window, softcap=softcap)
    out = paged_decode_cpu(q, poisoned(kc), poisoned(vc), tables, lens, max(LENS), scale,
                           window=window, softcap=softcap)
    assert out.dtype == q_dtype and out.shape == q.shape
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    assert (out.float() - ref).abs().max().item() < tol


@pytest.mark.parametrize("options", [(24, None), (None, 2.0), (37, 2.0)], ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_decode_does_not_depend_on_thread_count(options, dtype):
    """Spans start at each sequence's first visible key, a fixed split whatever the thread
    count: bit-identical with 1 or 2 threads."""
    window, softcap = options
    g = torch.Generator().manual_seed(8)
    kc = torch.randn(120, BS, 3, 64, generator=g).to(dtype)
    vc = torch.randn(120, BS, 3, 64, generator=g).to(dtype)
    lens = torch.tensor([1, 40, 700, 1500, 64])
    tables = torch.stack([torch.randperm(120, generator=g)[:94] for _ in range(len(lens))])
    q = torch.randn(len(lens), 9, 64, generator=g).to(dtype)

    def run():
        return paged_decode_cpu(q, kc, vc, tables, lens, 1500, 0.125, window=window,
                                softcap=softcap)

    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, two)


@pytest.mark.parametrize("k_fmt,v_fmt", [("int8", "int8"), ("fp8_e4m3", "int8")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [(24, None), (37, 2.0), (None, 2.0), (200, None)],
                         ids=_ids)
def test_quantized_decode_matches_reference(k_fmt, v_fmt, dtype, options):
    """A 1-byte pool: the vector path when K and V share a format, the scalar loops
    (decode_kernel_q) otherwise. Block 0's scales are NaN."""
    from tokenloom.kernels.kv_quant import FORMATS
    from tokenloom.kernels.kv_store import KVCache, store_kv

    window, softcap = options
    heads, kv_heads, head_dim, blocks = 9, 3, 64, 100
    g = torch.Generator().manual_seed(21)
    kv = KVCache.allocate(1, blocks, BS, kv_heads, head_dim, dtype, "cpu", FORMATS[k_fmt],
                          FORMATS[v_fmt])
    n = blocks * BS
    store_kv(torch.randn(n, kv_heads, head_dim, generator=g).to(dtype),
             torch.randn(n, kv_heads, head_dim, generator=g).to(dtype),
             kv.key[0], kv.value[0], torch.randperm(n, generator=g))
    lens = torch.tensor([1, 23, 24, 25, 300, 777])
    tables = torch.stack([torch.randperm(blocks - 1, generator=g)[:cdiv(777, BS)] + 1
                          for _ in range(len(lens))])
    if window is not None:
        tables = behind_window(tables, [max(0, c - window) for c in lens.tolist()])
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    ref = decode_attention(q, kv.key[0], kv.value[0], tables, lens, 777, 0.125, window=window,
                           softcap=softcap)
    kv.key[0].scale[0] = float("nan")
    kv.value[0].scale[0] = float("nan")
    out = paged_decode_cpu(q, kv.key[0], kv.value[0], tables, lens, 777, 0.125, window=window,
                           softcap=softcap)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (out.float() - ref.float()).abs().max().item() < tol


PREFILL_CASES = [  # (queries, start position, heads, kv_heads, head_dim)
    (16, 0, 8, 2, 64),      # a fresh prompt, cut by the window from its 25th token
    (100, 0, 8, 2, 64),     # a long fresh prompt: tiles with different first keys
    (40, 30, 9, 3, 64),     # a chunk straddling the window's edge (24: its keys 7..)
    (16, 16, 8, 2, 64),     # a chunk starting on a block boundary
    (7, 100, 4, 1, 63),     # MQA, an odd head size (bf16 takes the fp32 kernel), far past
    (64, 200, 6, 2, 80),    # a head size of 5 vectors, blocks behind the window
    (1, 300, 4, 2, 64),     # one row (a decode-sized chunk)
]


@pytest.mark.parametrize("n,start,heads,kv_heads,head_dim", PREFILL_CASES)
@pytest.mark.parametrize("q_dtype,pool_dtype", DTYPES)
@pytest.mark.parametrize("options", OPTIONS, ids=_ids)
def test_prefill_matches_reference(n, start, heads, kv_heads, head_dim, q_dtype, pool_dtype,
                                   options):
    """The paged entry over the poisoned pool against the torch reference; the gathered
    entry (the context copied out first, as a kernel without a paged form is given it)
    bit-identical to the paged one."""
    window, softcap = options
    g = torch.Generator().manual_seed(n * 31 + start)
    ctx = start + n
    kc = torch.randn(64, BS, kv_heads, head_dim, generator=g).to(pool_dtype)
    vc = torch.randn(64, BS, kv_heads, head_dim, generator=g).to(pool_dtype)
    table = torch.randperm(63, generator=g)[:cdiv(ctx, BS)] + 1
    if window is not None:
        table = behind_window(table[None], [max(0, start - window + 1)])[0]
    q = torch.randn(n, heads, head_dim, generator=g).to(q_dtype)
    scale = head_dim ** -0.5
    ref = prefill_attention(q.float(), kc.float(), vc.float(), table, start, scale,
                            window=window, softcap=softcap)
    out = prefill_attention_paged_cpu(q, poisoned(kc), poisoned(vc), table, start, scale,
                                      window=window, softcap=softcap)
    assert out.shape == q.shape and out.dtype == q_dtype
    tol = 2e-6 if q_dtype == torch.float32 else 2e-2   # bf16: the output's rounding
    assert (out.float() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())
    k = gather_context(kc, table)[:ctx].transpose(0, 1)
    v = gather_context(vc, table)[:ctx].transpose(0, 1)
    assert torch.equal(prefill_attention_cpu(q, k, v, scale, window=window, softcap=softcap),
                       out)


@pytest.mark.parametrize("start", [0, 30])
@pytest.mark.parametrize("options", [(24, None), (None, 2.0), (37, 2.0)], ids=_ids)
def test_model_path_hands_the_options_to_the_kernel(start, options):
    """kernels.attention.prefill_attention with the C++ kernel: a fresh chunk attends to its
    own K/V (the gathered entry), a continuation reads the pool (the paged entry); both
    take the layer's options and match the torch path."""
    window, softcap = options
    g = torch.Generator().manual_seed(start + 5)
    n, heads, kv_heads, d = 40, 8, 2, 64
    ctx = start + n
    kc = torch.randn(16, BS, kv_heads, d, generator=g)
    vc = torch.randn(16, BS, kv_heads, d, generator=g)
    table = torch.randperm(16, generator=g)[:cdiv(ctx, BS)]
    q = torch.randn(n, heads, d, generator=g)
    rows = gather_context(kc, table)[start:ctx], gather_context(vc, table)[start:ctx]
    local = rows if start == 0 else None
    ref = prefill_attention(q, kc, vc, table, start, 0.125, local, window=window,
                            softcap=softcap)
    out = prefill_attention(q, kc, vc, table, start, 0.125, local, kernel=prefill_attention_cpu,
                            window=window, softcap=softcap)
    assert (out - ref).abs().max().item() < 2e-6 * max(1.0, ref.abs().max().item())
    assert set(paged_decode_cpu.options) == set(prefill_attention_cpu.options) \
        == set(prefill_attention_cpu.paged.options) == {"window", "softcap"}


def test_compiled_programs_call_the_windowed_kernel():
    """The dispatcher op a compiled decode program calls (graphs/cpu_compile.py) takes the
    options too, with the same result as the eager kernel."""
    from tokenloom.graphs.cpu_compile import paged_decode_op

    g = torch.Generator().manual_seed(4)
    kc = torch.randn(40, BS, 2, 64, generator=g)
    vc = torch.randn(40, BS, 2, 64, generator=g)
    lens = torch.tensor([5, 100, 300])
    tables = torch.stack([torch.randperm(40, generator=g)[:19] for _ in range(3)])
    q = torch.randn(3, 8, 64, generator=g)
    for window, softcap in [(None, None), (24, None), (None, 2.0), (37, 2.0)]:
        want = paged_decode_cpu(q, kc, vc, tables, lens, 300, 0.125, window=window,
                                softcap=softcap)
        got = paged_decode_op(q, kc, vc, tables, lens, 300, 0.125, window=window,
                              softcap=softcap)
        assert torch.equal(got, want)
    assert set(paged_decode_op.options) == {"window", "softcap"}
