"""oneDNN packed projections (kernels/cpu/onednn.py) against nn.Linear; the default model's
greedy parity with transformers on this path is checked by tests/e2e (the start-up choice
picks oneDNN wherever it measures faster, as on the CI machines so far)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenloom.kernels.cpu import kernel_plan, kernel_set, onednn
from tokenloom.kernels.cpu import linear as cpu_linear

pytestmark = pytest.mark.skipif(not onednn.onednn_available(),
                                reason="this torch build has no oneDNN linear")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 200])
def test_packed_linear_matches_nn_linear(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 160, bias=bias)
    packed = onednn.PackedLinear(lin)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    assert (packed.in_features, packed.out_features) == (96, 160)


def test_choose_measures_and_answers():
    layer = [nn.Linear(64, 192, bias=False), nn.Linear(64, 64, bias=False)]
    assert onednn.choose(layer, rows=(1, 8)) in (True, False)
    assert onednn.choose([]) is False


# -- per-batch-size kernels (plan + CpuLinear) ----------------------------------------------
def _weights(seed: int, shapes=((96, 64), (40, 96))):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(o, i, generator=g) * 0.1, torch.randn(o, generator=g) * 0.1)
            for o, i in shapes]


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 70])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_every_candidate_matches_the_reference(rows, act):
    """Each kernel the planner may pick computes x . W^T + b, at sizes on both sides of the
    small kernel's 4-row and 4-column blocking (K=100 leaves a 16-lane tail)."""
    (w, b), = _weights(rows, shapes=((37, 100),))
    x = torch.randn(rows, 100).to(act)
    ref = torch.nn.functional.linear(x.float(), w.to(act).float(), b.to(act).float())
    kernels = kernel_set.KernelSet(w, b, "float", act)
    assert "mkl" in kernels.names
    tol = 1e-4 if act == torch.float32 else 3e-2
    with torch.inference_mode():
        for name in kernels.names:
            y = kernels.run(name, x)
            assert y.dtype == act and y.shape == (rows, 37), name
            torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_int8_candidates_match_dequantized_weights(act):
    (w, b), = _weights(7, shapes=((50, 96),))
    q, scale = kernel_set.quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    deq = q.float() * scale[:, None]
    assert (deq - w).abs().max() <= scale.max() / 2 + 1e-6   # half a step at most
    x = torch.randn(6, 96).to(act)
    ref = torch.nn.functional.linear(x.float(), deq, b.float())
    kernels = kernel_set.KernelSet(w, b, kernel_set.INT8, act)
    assert "copy_mkl" in kernels.names
    with torch.inference_mode():
        for name in kernels.names:
            # int8pack rounds activations to bf16; bf16 activations round the output.
            tol = 1e-4 if act == torch.float32 and name != "int8pack_bf16" else 3e-2
            torch.testing.assert_close(kernels.run(name, x).float(), ref, rtol=tol, atol=tol,
                                       msg=name)


@pytest.mark.parametrize("storage", ["float", kernel_set.INT8])
def test_bf16_activations_get_an_fp32_copy_rounded_once(storage):
    """copy_fp32: x and W widened to fp32 exactly (an int8 weight: its fp32
    dequantization), fp32 sums, one rounding to bf16; offered to bf16 activations only."""
    (w, b), = _weights(11, shapes=((48, 100),))
    x = torch.randn(70, 100).to(torch.bfloat16)
    if storage == "float":
        wide = w.to(torch.bfloat16).float()
    else:
        q, scale = kernel_set.quantize_int8(w)
        wide = q.float() * scale[:, None]
    ref = torch.nn.functional.linear(x.float(), wide, b.to(torch.bfloat16).float())
    kernels = kernel_set.KernelSet(w, b, storage, torch.bfloat16)
    assert "copy_fp32" in kernels.names
    assert "copy_fp32" not in kernel_set.KernelSet(w, b, storage, torch.float32).names
    with torch.inference_mode():
        y = kernels.run("copy_fp32", x)
    assert y.dtype == torch.bfloat16 and y.shape == (70, 48)
    assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-5).all(), \
        ((y.float() - ref).abs() / ref.abs()).max()


@pytest.mark.parametrize("available_gb,storage,act,want", [
    (64, "float", torch.bfloat16, set()),
    (64, "float", torch.float32, set()),
    (1, "float", torch.bfloat16, {"copy_fp32"}),        # 4 bytes a weight do not fit
    (1, "float", torch.float32, set()),                 # fp32 models keep no copy at all
    (1, kernel_set.INT8, torch.bfloat16, {"copy_fp32"}),   # the bf16 copy fits, fp32 not
    (0, kernel_set.INT8, torch.bfloat16, kernel_set.COPY_KERNELS),
])
def test_copies_are_kept_only_where_memory_allows(monkeypatch, available_gb, storage, act,
                                                  want):
    import os
    from types import SimpleNamespace

    from tokenloom.kernels.models.decoder import CausalLM

    # 300 M weights: a bf16 copy is 0.6 GB, an fp32 one 1.2 GB; half of 2 GB is 1 GB
    weights = SimpleNamespace(numel=lambda: 150_000_000)
    layer = SimpleNamespace(parameters=lambda: [weights])
    model = SimpleNamespace(rope=None, embed_tokens=SimpleNamespace(weight=torch.empty(0,
                                                                                   dtype=act)),
                            layers=[layer], lm_head=SimpleNamespace(weight=weights))
    pages = {"SC_AVPHYS_PAGES": (2 * available_gb) * 10 ** 9 // 4096, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    assert CausalLM._copy_kernels_excluded(model, storage) == frozenset(want)


def test_plan_bands_cover_every_row_count_and_dispatch():
    weights = _weights(3)
    chosen = kernel_plan.plan(weights, "float", torch.float32, rows=(1, 4, 16))
    assert chosen.bands and chosen.bands[-1][0] == 16
    assert set(chosen.timings) == {1, 4, 16}
    his = [hi for hi, _ in chosen.bands]
    assert his == sorted(his)
    assert chosen.describe()
    w, b = weights[0]
    layer = cpu_linear.CpuLinear(w, b, "float", torch.float32, chosen)
    with torch.inference_mode():
        for rows in (1, 2, 4, 9, 16, 40):   # 40: past the last band, uses the last kernel
            x = torch.randn(rows, 64)
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w, b),
                                       rtol=1e-4, atol=1e-4)


def test_forced_plan_dispatches_by_rows(monkeypatch):
    """Bands are honoured: a call with r rows runs the kernel of the first band >= r."""
    calls = []
    weights = _weights(4)
    forced = kernel_plan.Plan(((2, "mkl"), (8, "onednn")), {})
    w, b = weights[0]
    layer = cpu_linear.CpuLinear(w, b, "float", torch.float32, forced)
    run = layer.kernels.run
    monkeypatch.setattr(layer.kernels, "run", lambda name, x: calls.append(name) or run(name, x))
    with torch.inference_mode():
        for rows in (1, 2, 3, 8, 30):
            layer(torch.randn(rows, 64))
    assert calls == ["mkl", "mkl", "onednn", "onednn", "onednn"]


# -- oneDNN's per-shape primitives stay bounded ----------------------------------------------
def test_onednn_rows_pads_at_most_an_eighth_and_bounds_the_shapes():
    """Exact up to 16 rows; above, rounded up by less than 1/8; 72 shapes up to 2,048."""
    for rows in range(1, 5000):
        padded = onednn.onednn_rows(rows)
        assert padded >= rows and (padded == rows if rows <= 16 else padded - rows < rows / 8)
        assert onednn.onednn_rows(padded) == padded        # a bucket maps to itself
    assert len({onednn.onednn_rows(r) for r in range(1, 2049)}) == 72
    for rows in (1, 2, 4, 8, 16, 64, 256):                     # the planner's ladder: unpadded
        assert onednn.onednn_rows(rows) == rows


def test_onednn_calls_at_every_row_count_build_a_bounded_set_of_primitives(monkeypatch):
    """oneDNN keeps a JIT-compiled primitive (~280 KiB of native memory) per input shape in
    its process-wide cache: a server sending every row count grew by ~0.8 KiB a request (the
    soak). Calls from 1 to 400 rows reach oneDNN at 16 + 8 per doubling distinct row counts,
    and give the same values as unpadded calls."""
    (w, b), = _weights(5, shapes=((48, 32),))
    kernels = kernel_set.KernelSet(w, b, "float", torch.float32, {"onednn"})

    def packed(x):
        return kernels.run("onednn", x)
    real = torch.ops.mkldnn._linear_pointwise
    seen = set()

    def spy(x, *args):
        seen.add(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in range(1, 401):
            x = torch.randn(rows, 32, generator=g)
            y = packed(x)
            assert y.shape == (rows, 48) and y.is_contiguous()
            torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b),
                                       rtol=1e-4, atol=1e-4)
    assert seen == {onednn.onednn_rows(r) for r in range(1, 401)}
    assert len(seen) == 16 + 8 * 4 + 5      # (16, 32], ..., (128, 256]: 8 each; 5 to 416


def test_a_remembered_plan_is_measured_again_when_a_kernel_source_changes(monkeypatch):
    """Plans are remembered per machine; one timed with an older small_gemm would keep
    choosing against the kernel that replaced it."""
    from tokenloom.kernels.cpu import cpp_build

    weights = [(torch.zeros(8, 4), None)]
    key = kernel_plan.plan_cache_key(weights, "float", torch.float32, (1, 4))
    assert key == kernel_plan.plan_cache_key(weights, "float", torch.float32, (1, 4))
    real = cpp_build.build_name
    monkeypatch.setattr(cpp_build, "build_name",
                        lambda base, source=None: real(base, source) + "-edited")
    assert key != kernel_plan.plan_cache_key(weights, "float", torch.float32, (1, 4))


def test_tile_gemm_is_built_where_the_cpu_has_avx512_bf16_or_avx2_and_fma():
    from tokenloom.kernels.cpu.features import detect

    flags = detect().flags
    module = kernel_set.tile_gemm_module()
    assert (module is not None) == ("avx512_bf16" in flags or {"avx2", "fma"} <= flags)
    if module is not None:
        assert module.tile_gemm_path() == ("dpbf16" if "avx512_bf16" in flags else "fma")
        assert module.tile_gemm_int8_built() == ({"avx2", "fma"} <= flags)


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 17, 70])
@pytest.mark.parametrize("k", [100, 99])
@pytest.mark.parametrize("bias", [False, True])
def test_tile_gemm_matches_the_reference(rows, k, bias):
    """The tiled bf16 kernel: row counts on both sides of its 8-row (vdpbf16ps) and 6-row
    (FMA) tiles, output panels in groups of 3 with a group of 1 and of 2 left over (80 and
    96 columns), an odd K (vdpbf16ps: the last pair's second weight is 0), a bias."""
    if kernel_set.tile_gemm_module() is None:
        pytest.skip("tile_gemm not built here (no AVX512-BF16, no AVX2 + FMA)")
    for n in (80, 96):
        g = torch.Generator().manual_seed(rows * 1000 + k + n)
        w = torch.randn(n, k, generator=g) * 0.1
        b = torch.randn(n, generator=g) if bias else None
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        kernels = kernel_set.KernelSet(w, b, "float", torch.bfloat16, only={"tile_gemm"})
        assert kernels.names == ("tile_gemm",)
        with torch.inference_mode():
            y = kernels.run("tile_gemm", x)
        ref = torch.nn.functional.linear(x.float(), w.to(torch.bfloat16).float(),
                                         None if b is None else b.to(torch.bfloat16).float())
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        # one bf16 rounding of an fp32 sum
        torch.testing.assert_close(y.float(), ref, rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("rows", [1, 6, 7, 9, 70])
@pytest.mark.parametrize("k", [99, 576])
def test_tile_gemm_takes_fp32_x_rounding_it_to_bf16_and_returns_unrounded_sums(rows, k):
    if kernel_set.tile_gemm_module() is None:
        pytest.skip("tile_gemm not built here (no AVX512-BF16, no AVX2 + FMA)")
    g = torch.Generator().manual_seed(rows + k)
    w, b = torch.randn(96, k, generator=g) * 0.1, torch.randn(96, generator=g)
    x = torch.randn(rows, k, generator=g)
    packed = kernel_set.tile_gemm_module().tile_gemm_pack(w.to(torch.bfloat16))
    y = torch.ops.tokenloom.tile_gemm(x, packed, b)
    ref = torch.nn.functional.linear(x.bfloat16().float(), w.bfloat16().float(), b)
    assert y.dtype == torch.float32 and y.shape == (rows, 96)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)   # fp32 sums, not rounded


def test_tile_gemm_is_offered_only_for_bf16_and_whole_panels():
    if kernel_set.tile_gemm_module() is None:
        pytest.skip("tile_gemm not built here (no AVX512-BF16, no AVX2 + FMA)")
    assert "tile_gemm" in kernel_set.KernelSet(torch.randn(32, 8), None, "float",
                                               torch.bfloat16).names
    assert "tile_gemm" not in kernel_set.KernelSet(torch.randn(40, 8), None, "float",
                                                   torch.bfloat16).names
    assert "tile_gemm" not in kernel_set.KernelSet(torch.randn(32, 8), None, "float",
                                                   torch.float32).names


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 70])
@pytest.mark.parametrize("k", [99, 576])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_tile_gemm_int8_matches_its_dequantized_weight(rows, k, act):
    """int8 panels of 16 outputs, 6-row tiles (rows on both sides), the per-output scale
    applied to the finished fp32 sum, a bias; fp32 x is used as it is, bf16 x widened."""
    if not kernel_plan._available("tile_gemm_int8"):
        pytest.skip("tile_gemm_int8 not built here (no AVX2 + FMA)")
    g = torch.Generator().manual_seed(rows * 10 + k)
    w, b = torch.randn(96, k, generator=g) * 0.1, torch.randn(96, generator=g)
    x = torch.randn(rows, k, generator=g).to(act)
    kernels = kernel_set.KernelSet(w, b, kernel_set.INT8, act, only={"tile_gemm_int8"})
    assert kernels.names == ("tile_gemm_int8",)
    with torch.inference_mode():
        y = kernels.run("tile_gemm_int8", x)
    ref = torch.nn.functional.linear(x.float(), kernels.q.float() * kernels.scale[:, None],
                                     b.to(act).float())
    assert y.dtype == act and y.shape == (rows, 96)
    tol = 1e-5 if act == torch.float32 else 8e-3   # fp32 sums; then one bf16 rounding
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)


def test_tile_gemm_int8_is_offered_only_for_whole_panels_and_rejects_a_mismatched_weight():
    if not kernel_plan._available("tile_gemm_int8"):
        pytest.skip("tile_gemm_int8 not built here (no AVX2 + FMA)")
    assert "tile_gemm_int8" in kernel_set.KernelSet(torch.randn(32, 8), None, kernel_set.INT8,
                                                    torch.float32).names
    assert "tile_gemm_int8" not in kernel_set.KernelSet(torch.randn(40, 8), None,
                                                        kernel_set.INT8, torch.float32).names
    q, scale = kernel_set.quantize_int8(torch.randn(32, 8))
    packed = kernel_set.tile_gemm_module().tile_gemm_int8_pack(q)
    with pytest.raises(RuntimeError, match="matching x"):
        torch.ops.tokenloom.tile_gemm_int8(torch.randn(2, 9), packed, scale, torch.empty(0))
    with pytest.raises(RuntimeError, match="scale"):
        torch.ops.tokenloom.tile_gemm_int8(torch.randn(2, 8), packed, scale[:16], torch.empty(0))


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 70])
@pytest.mark.parametrize("k", [99, 576])
def test_tile_gemm_f32_matches_the_reference_in_fp32(rows, k):
    """fp32 panels of 16 outputs, 6-row tiles, a bias: exact fp32 products, fp32 sums."""
    if not kernel_plan._available("tile_gemm_f32"):
        pytest.skip("tile_gemm_f32 not built here (no AVX2 + FMA)")
    g = torch.Generator().manual_seed(rows * 7 + k)
    w, b = torch.randn(96, k, generator=g) * 0.1, torch.randn(96, generator=g)
    x = torch.randn(rows, k, generator=g)
    kernels = kernel_set.KernelSet(w, b, "float", torch.float32, only={"tile_gemm_f32"})
    assert kernels.names == ("tile_gemm_f32",)
    assert "tile_gemm_f32" not in kernel_set.KernelSet(w, b, "float", torch.bfloat16).names
    assert "tile_gemm_f32" not in kernel_set.KernelSet(w[:90], b[:90], "float",
                                                       torch.float32).names
    with torch.inference_mode():
        y = kernels.run("tile_gemm_f32", x)
    assert y.dtype == torch.float32 and y.shape == (rows, 96)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_refused_onednn_reorder_is_tried_and_logged_once(monkeypatch):
    """A torch or CPU without oneDNN's primitive for a dtype (bf16 on AVX2) refuses the
    reorder: the projections after the first skip it instead of raising and logging again."""
    calls = []

    def refuse(w, rows_hint):
        calls.append(w.dtype)
        raise RuntimeError("no primitive for this dtype here")

    monkeypatch.setattr(onednn, "_ONEDNN_REFUSED", set())
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    sets = [kernel_set.KernelSet(torch.randn(32, 64), None, "float", torch.float32,
                                 only={"onednn", "mkl"}) for _ in range(3)]
    assert calls == [torch.float32]
    assert all(s.names == ("mkl",) for s in sets)
