"""The CPU decode step's C++ layer ops (kernels/cpu/layer_ops.py): residual add + RMSNorm and
SiLU(gate) * up equal the torch reference, update the residual in place as the fused-kernel
contract says, and leave bf16 and compiled programs on the reference."""

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


def test_bf16_keeps_the_reference_arithmetic():
    x, r = torch.randn(2, 64).bfloat16(), torch.randn(2, 64).bfloat16()
    w = torch.randn(64).bfloat16()
    residual = r.clone()
    y = layer_ops.rms_norm_cpu(x, w, 1e-5, residual)
    h = (r + x)
    hf = h.float()
    expected = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert torch.equal(residual, h) and torch.equal(y, expected)
    g = torch.randn(2, 32).bfloat16()
    assert torch.equal(layer_ops.silu_mul_cpu(g), silu_and_mul(g))
