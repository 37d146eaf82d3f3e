"""The Triton decode attention and KV store on quantized caches (kernels/kv_quant.py) against
the torch reference (decode_attention over QuantizedCache.dequantize_blocks, and
QuantizedCache.store), on CPU under the Triton interpreter.

The one `test_` function runs this same file again in a subprocess with TRITON_INTERPRET=1
and only its `check_` functions collected: Triton picks the interpreter when it is first
imported, and the variable must not leak into the rest of the suite (as in
test_triton_attention.py). Shapes are small: the interpreter runs every program in Python.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import tokenloom.kernels.gpu.triton_attention as tk  # noqa: E402
from tokenloom.arith import cdiv  # noqa: E402
from tokenloom.kernels.attention import decode_attention  # noqa: E402
from tokenloom.kernels.kv_quant import FORMATS, QuantizedCache  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def test_quantized_kv_kernels_under_interpreter():
    path = Path(__file__)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
         "--rootdir", str(path.parent), "-o", "python_functions=check_*", str(path)],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


@pytest.fixture(autouse=True)
def _interpreted(request):
    if request.function.__name__.startswith("check_"):
        assert INTERPRETED, "run through test_quantized_kv_kernels_under_interpreter"


HEADS, KV_HEADS, HEAD_DIM, BS, NUM_BLOCKS = 9, 3, 64, 16, 96   # SmolLM2's grouping
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _empty(fmt: str, dtype: torch.dtype) -> QuantizedCache:
    return QuantizedCache(torch.zeros(NUM_BLOCKS, BS, KV_HEADS, HEAD_DIM, dtype=torch.uint8),
                          torch.zeros(NUM_BLOCKS, BS, KV_HEADS), FORMATS[fmt], dtype)


def _rows(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Rows whose magnitude varies per token and head, as real K/V do (per-row scales)."""
    mag = torch.rand(n, KV_HEADS, 1, generator=g) * 2 + 0.01
    return (torch.randn(n, KV_HEADS, HEAD_DIM, generator=g) * mag).to(dtype)


def _filled(k_fmt: str, v_fmt: str, dtype: torch.dtype, lens: list[int], seed: int):
    """Caches holding each row's context (written by QuantizedCache.store in chunks of 7
    tokens), the rows' tables (a random, non-contiguous pick of blocks) and a query."""
    g = torch.Generator().manual_seed(seed)
    kc, vc = _empty(k_fmt, dtype), _empty(v_fmt, dtype)
    width = cdiv(max(lens), BS)
    tables = torch.randperm(NUM_BLOCKS, generator=g)[: width * len(lens)].view(len(lens), width)
    for row, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[row, pos // BS] * BS + pos % BS
        for c in range(0, n, 7):
            kc.store(_rows(len(slots[c:c + 7]), dtype, g), slots[c:c + 7])
            vc.store(_rows(len(slots[c:c + 7]), dtype, g), slots[c:c + 7])
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=g).to(dtype)
    return q, kc, vc, tables.clone(), torch.tensor(lens)


def _diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    return (out.float() - ref.float()).abs().max().item()


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


# -- the encode ---------------------------------------------------------------------------

@triton.jit
def _encode(x_ptr, out_ptr, N: tl.constexpr, FMT: tl.constexpr, QMAX: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, tk._quantize(tl.load(x_ptr + i), FMT, QMAX))


def _ties(fmt) -> torch.Tensor:
    """Every code's value, the midpoints between neighbours (the ties), a float step on either
    side of each, values past the format's maximum, and signed zeros."""
    if fmt.dtype == torch.int8:
        grid = torch.arange(-127, 128, dtype=torch.float32)
    else:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        grid = fmt.decode(codes)
        grid = grid[grid.isfinite() & (grid.abs() <= fmt.qmax)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1),
                   torch.tensor([fmt.qmax * 1.02, -fmt.qmax * 3, 1e30, -1e30, 0.0, -0.0]),
                   torch.randn(500) * fmt.qmax / 4])
    n = triton.next_power_of_2(x.numel())
    return torch.cat([x, torch.zeros(n - x.numel())])


@pytest.mark.parametrize("fmt", list(FORMATS))
def check_encode_is_kvformat_encode_bit_for_bit(fmt):
    f = FORMATS[fmt]
    x = _ties(f)
    out = torch.empty(x.numel(), dtype=torch.uint8)
    _encode[(1,)](x, out, N=x.numel(), FMT=f.code + 1, QMAX=f.qmax)
    want = f.encode(x)
    bad = (out != want).nonzero().flatten()[:8]
    assert bad.numel() == 0, (x[bad].tolist(), out[bad].tolist(), want[bad].tolist())


# -- decode attention ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("fmt", list(FORMATS))
def check_decode_matches_reference(fmt, dtype):
    """Contexts of one token, one full block, partial last blocks and three partitions of
    128 tokens; every partition size also as one direct partition (no reduce)."""
    dt = DTYPES[dtype]
    q, kc, vc, tables, lens = _filled(fmt, fmt, dt, [1, 16, 37, 300], seed=len(fmt))
    ref = decode_attention(q, kc, vc, tables, lens, 300, HEAD_DIM ** -0.5)
    for partition in (128, 512):
        out = tk.paged_decode_triton(q, kc, vc, tables, lens, 300, HEAD_DIM ** -0.5,
                                     partition=partition, block_n=64)
        assert _diff(out, ref) < TOL[dt], (partition, _diff(out, ref))


def check_mixed_formats_and_promoted_layers():
    """K and V in different formats; a promoted side reads its model-dtype copy (also
    when only one side is promoted); both promoted is the plain kernel."""
    q, kc, vc, tables, lens = _filled("int8", "fp8_e5m2", torch.float32, [70, 3], seed=5)
    ref = decode_attention(q, kc, vc, tables, lens, 70, 0.125)
    assert _diff(tk.paged_decode_triton(q, kc, vc, tables, lens, 70, 0.125), ref) < 1e-5
    kc.promote()
    # The promoted copy is what reads use: change it, and the result must follow.
    kc.full.mul_(0.5)
    ref = decode_attention(q, kc, vc, tables, lens, 70, 0.125)
    assert _diff(tk.paged_decode_triton(q, kc, vc, tables, lens, 70, 0.125), ref) < 1e-5
    vc.promote()
    ref = decode_attention(q, kc, vc, tables, lens, 70, 0.125)
    assert _diff(tk.paged_decode_triton(q, kc, vc, tables, lens, 70, 0.125), ref) < 1e-5


def check_split_decode_precompile_and_capture_prep():
    """SplitDecode (what the model calls) on quantized caches equals the reference, and
    precompile / prepare_capture launch the quantized variants (a KVCache in a 1-byte mode
    hands prepare_capture QuantizedCache layers)."""
    from tokenloom.kernels.gpu.decode_split import SplitRule, Variant
    from tokenloom.kernels.kv_store import KVCache

    split = tk.SplitDecode(SplitRule(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                     sm_count=16))
    q, kc, vc, tables, lens = _filled("fp8_e4m3", "int8", torch.float32, [300, 20, 1], seed=9)
    ref = decode_attention(q, kc, vc, tables, lens, 300, 0.125)
    assert not split.variant(3, 300, capturing=False).direct
    assert _diff(split(q, kc, vc, tables, lens, 300, 0.125), ref) < 1e-5
    launched = []
    real = tk._launch

    def spy(q, k, v, *args):
        launched.append((type(k).__name__, type(v).__name__, args[-3:]))
        return real(q, k, v, *args)

    tk._launch = spy
    try:
        split.precompile({Variant(64, False), Variant(256, True)}, torch.float32, BS, "cpu",
                         FORMATS["int8"], FORMATS["fp8_e5m2"])
        kv = KVCache.allocate(1, 8, BS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cpu",
                              FORMATS["fp8_e4m3"], FORMATS["fp8_e4m3"])
        split.prepare_capture(2, 128, kv)
    finally:
        tk._launch = real
    plain, quant = ("Tensor", "Tensor"), ("QuantizedCache", "QuantizedCache")
    assert [(k, v) for k, v, _ in launched] == [plain, quant, plain, quant, plain, quant]
    assert [a for *_, a in launched[:4]] == [(64, 2, 64)] * 2 + [(256, 1, 64)] * 2


# -- the store ----------------------------------------------------------------------------

def _codes(cache: QuantizedCache) -> torch.Tensor:
    """Bytes as signed code numbers: neighbouring values of a format are one apart."""
    if cache.fmt.dtype == torch.int8:
        return cache.data.view(torch.int8).to(torch.int32)
    b = cache.data.to(torch.int32)
    return torch.where(b >= 128, -(b - 128), b)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("fmt", list(FORMATS))
def check_store_matches_quantized_cache_store(fmt, dtype):
    """Steps as the engine makes them: prefill chunks ending mid-block, decode steps with
    padded rows (slot -1), a reused block written again from offset 0, rows sliced out of a
    fused qkv tensor, all-zero rows; then a promoted layer's model-dtype copy too."""
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(3 + len(fmt))
    ref_k, ref_v = _empty(fmt, dt), _empty("int8" if fmt != "int8" else "fp8_e4m3", dt)
    tri_k = QuantizedCache(ref_k.data.clone(), ref_k.scale.clone(), ref_k.fmt, dt)
    tri_v = QuantizedCache(ref_v.data.clone(), ref_v.scale.clone(), ref_v.fmt, dt)
    steps = [torch.arange(5 * BS, 5 * BS + 37),                   # prefill chunk, 2+ blocks
             torch.arange(5 * BS + 37, 5 * BS + 45),              # next chunk, same block
             torch.tensor([5 * BS + 45, -1, 9 * BS, -1]),         # decode rows + padding
             torch.arange(6 * BS, 6 * BS + 5),                    # block 6 reused from 0
             torch.tensor([-1, -1, -1])]                          # padding only
    for i, slots in enumerate(steps * 2):
        if i == len(steps):
            ref_k.promote(), ref_v.promote()
            tri_k.full, tri_v.full = ref_k.full.clone(), ref_v.full.clone()
        fused = torch.randn(len(slots), 3 * KV_HEADS, HEAD_DIM, generator=g)
        fused *= torch.rand(len(slots), 3 * KV_HEADS, 1, generator=g) * 4
        fused[0, KV_HEADS] = 0.0                                  # an all-zero head: scale 0
        fused = fused.to(dt)
        key, value = fused[:, KV_HEADS:2 * KV_HEADS], fused[:, 2 * KV_HEADS:]
        assert not key.is_contiguous()
        ref_k.store(key, slots, has_skip=True)
        ref_v.store(value, slots, has_skip=True)
        tk.store_kv_quant_triton(key, value, tri_k, tri_v, slots)
        for ref, tri in ((ref_k, tri_k), (ref_v, tri_v)):
            assert torch.equal(tri.scale, ref.scale), (i, fmt)
            if ref.fmt.dtype == torch.int8:
                assert torch.equal(tri.data, ref.data), (i, fmt)
            else:
                assert (_codes(tri) - _codes(ref)).abs().max().item() <= 1, (i, fmt)
            if ref.full is not None:
                assert torch.equal(tri.full, ref.full), (i, fmt)
    assert (ref_k.scale == 0).any() and (ref_k.scale > 0).sum() > 60
