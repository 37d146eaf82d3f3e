"""The CPU decode step's C++ layer ops (kernels/cpu/layer_ops.py): residual add + RMSNorm and
SiLU(gate) * up equal the torch reference (bf16: rounded where the reference rounds), update
the residual in place as the fused-kernel contract says, and leave compiled programs on the
reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.kernels.cpu import layer_ops
from tokenloom.kernels.models.layers import silu_and_mul

needs_kernel = pytest.mark.skipif(layer_ops.module() is None, reason="no C++ toolchain")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm_with_and_without_residual(rows):
    torch.manual_seed(rows)
    x, r, w = torch.randn(rows, 96), torch.randn(rows, 96), torch.randn(96)
    torch.testing.assert_close(layer_ops.rms_norm_cpu(x, w, 1e-5),
                               F.rms_norm(x, (96,), w, 1e-5), rtol=1e-5, atol=1e-5)
    residual = r.clone()
    y = layer_ops.rms_norm_cpu(x, w, 1e-6, residual)
    torch.testing.assert_close(residual, r + x, rtol=0, atol=0)       # updated in place
    torch.testing.assert_close(y, F.rms_norm(r + x, (96,), w, 1e-6), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 17])
def test_silu_mul_matches_the_reference(rows):
    g = torch.randn(rows, 2 * 80) * 4
    torch.testing.assert_close(layer_ops.silu_mul_cpu(g), silu_and_mul(g), rtol=1e-5,
                               atol=1e-5)


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the last place of bf16 (same-sign values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_bf16_rounds_where_the_reference_rounds(rows):
    torch.manual_seed(rows)
    x, r = torch.randn(rows, 576).bfloat16(), (torch.randn(rows, 576) * 3).bfloat16()
    w = torch.randn(576).bfloat16()
    residual = r.clone()
    y = layer_ops.rms_norm_cpu(x, w, 1e-5, residual)
    h = r + x
    hf = h.float()
    expected = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert torch.equal(residual, h)              # the residual's sum is rounded as torch does
    # The mean of squares is summed in another order than torch's: a last-bit difference
    # in fp32 can move a rounding to bf16 by one place, rarely.
    ulps = _bf16_ulps(y, expected)
    assert ulps.max().item() <= 1 and (ulps > 0).float().mean().item() < 0.01
    assert torch.equal(layer_ops.rms_norm_cpu(h, w, 1e-5), y)   # no residual: norm(x)
    # exp differs from torch's in the last fp32 bit now and then: SiLU(gate) rounds to the
    # other bf16 neighbour (measured on 0.1% of values), and the product by up to 2 places.
    g = (torch.randn(rows, 2 * 1536) * 4).bfloat16()
    ulps = _bf16_ulps(layer_ops.silu_mul_cpu(g), silu_and_mul(g))
    assert ulps.max().item() <= 2 and (ulps > 0).float().mean().item() < 0.01


def test_bf16_weight_of_another_dtype_takes_the_reference():
    x = torch.randn(2, 64).bfloat16()
    w = torch.randn(64)        # fp32 weight: the reference promotes, the kernel would refuse
    xf = x.float()
    expected = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert torch.equal(layer_ops.rms_norm_cpu(x, w, 1e-5), expected)
