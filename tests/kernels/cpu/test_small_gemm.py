"""The C++ small-batch kernels (kernels/cpu/csrc/small_gemm_cpu.cpp) against float64 sums of
the same weights: every weight storage, row counts on both sides of the 4-row blocking, and
inner sizes that leave a tail of a vector (100, 1000) or none (576, 1536: the default
model's)."""

from __future__ import annotations

import pytest
import torch

from tokenloom.kernels.cpu.features import detect
from tokenloom.kernels.cpu.kernel_set import small_gemm_module

module = small_gemm_module()
pytestmark = pytest.mark.skipif(module is None, reason="no C++ toolchain")
KERNELS = ("small_gemm", "small_gemm_strips")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("k", [16, 100, 576, 1000, 1536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_weights_match_float64_sums(dtype, k, kernel):
    g = torch.Generator().manual_seed(k)
    w = torch.randn(37, k, generator=g).to(dtype)
    b = torch.randn(37, generator=g)
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, k, generator=g).to(dtype)
        y = getattr(module, kernel)(x, w, torch.empty(0), b)
        assert y.dtype == dtype and y.shape == (rows, 37)
        ref = x.double() @ w.double().T + b.double()
        if dtype == torch.float32:
            torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4 * k ** 0.5)
        else:
            # fp32 sums of exact products, then one rounding to bf16: within a bf16 step
            # (2^-8 relative) of the exact sum, plus the fp32 summation's error.
            err = (y.double() - ref).abs()
            assert (err <= ref.abs() * 2.0 ** -8 + 1e-4 * k ** 0.5).all(), err.max()


def test_bf16_activations_and_weights_give_the_widening_paths_sums():
    """The vdpbf16ps path (bf16 x and bf16 W) and the widening one (fp32 x, bf16 W: the same
    values) sum the same exact products in fp32: equal to fp32 rounding."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 576, generator=g).to(torch.bfloat16)
    x = torch.randn(4, 576, generator=g).to(torch.bfloat16)
    for kernel in KERNELS:
        dot = getattr(module, kernel)(x, w, torch.empty(0), torch.zeros(64))
        widen = getattr(module, kernel)(x.float(), w, torch.empty(0), torch.zeros(64))
        torch.testing.assert_close(dot.float(), widen.to(torch.bfloat16).float(),
                                   rtol=2.0 ** -7, atol=1e-3)


def test_int8_weights_apply_the_row_scale():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (40, 100), generator=g, dtype=torch.int8)
    scale = torch.rand(40, generator=g) * 0.01
    x = torch.randn(3, 100, generator=g)
    ref = x.double() @ (q.double() * scale.double()[:, None]).T
    for kernel in KERNELS:
        y = getattr(module, kernel)(x, q, scale, torch.empty(0))
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)


def test_the_bf16_dot_path_is_built_exactly_where_the_cpu_has_avx512_bf16():
    assert module.bf16_dot_build() == ("avx512_bf16" in detect().flags)


def test_bf16_results_are_rounded_as_a_separate_conversion_would_round_them():
    """bf16 outputs are rounded as they are stored: bit-identical to the fp32 result's
    .to(bfloat16) (int8 weights: the same widening sums for fp32 and bf16 x)."""
    g = torch.Generator().manual_seed(9)
    q = torch.randint(-127, 128, (70, 300), generator=g, dtype=torch.int8)
    scale = torch.rand(70, generator=g) * 0.02
    bias = torch.randn(70, generator=g)
    x = torch.randn(5, 300, generator=g).to(torch.bfloat16)
    for kernel in KERNELS:
        y = getattr(module, kernel)(x, q, scale, bias)
        ref = getattr(module, kernel)(x.float(), q, scale, bias).to(torch.bfloat16)
        assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
