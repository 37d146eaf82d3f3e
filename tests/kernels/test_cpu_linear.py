"""oneDNN packed projections (kernels/cpu_linear.py) against nn.Linear; the default model's
greedy parity with transformers on this path is checked by tests/e2e (the start-up choice
picks oneDNN wherever it measures faster, as on the CI machines so far)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenloom.kernels import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_available(),
                                reason="this torch build has no oneDNN linear")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 200])
def test_packed_linear_matches_nn_linear(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 160, bias=bias)
    packed = cpu_linear.PackedLinear(lin)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    assert (packed.in_features, packed.out_features) == (96, 160)


def test_choose_measures_and_answers():
    layer = [nn.Linear(64, 192, bias=False), nn.Linear(64, 64, bias=False)]
    assert cpu_linear.choose(layer, rows=(1, 8)) in (True, False)
    assert cpu_linear.choose([]) is False
