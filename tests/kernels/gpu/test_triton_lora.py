"""The Triton multi-LoRA kernel (kernels/gpu/triton_lora.py) against its torch reference, on
CPU under the Triton interpreter.

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

from tokenloom.kernels.gpu.triton_lora import lora_add_reference, lora_add_triton  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def test_lora_kernel_under_interpreter():
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
        assert INTERPRETED, "run through test_lora_kernel_under_interpreter"


TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
K, N = 40, 72          # not multiples of the block sizes


def _inputs(t: int, num_slots: int, rank: int, dtype: torch.dtype, seed: int):
    """x [T, K], a [S*rank, K], b [N, S*rank] (scaled so a delta is of the order of out) and
    out [T, N]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, K, generator=g).to(dtype)
    a = (torch.randn(num_slots * rank, K, generator=g) / K ** 0.5).to(dtype)
    b = (torch.randn(N, num_slots * rank, generator=g) / rank ** 0.5).to(dtype)
    out = torch.randn(t, N, generator=g).to(dtype)
    return x, a, b, out


def _check(out, x, a, b, slots, rank):
    """lora_add_triton on a copy of `out` equals lora_add_reference on another; returns the
    kernel's result."""
    dt = out.dtype
    ref = lora_add_reference(out.clone(), x, a, b, slots, rank)
    got = out.clone()
    assert lora_add_triton(got, x, a, b, slots, rank) is got
    torch.testing.assert_close(got, ref, atol=TOL[dt], rtol=TOL[dt])
    return got


def check_mixed_slots_fp32():
    """Rows of three adapters and a base-model row in one launch: each adapter's rows move,
    the base row does not."""
    slots = torch.tensor([0, -1, 2, 0, 1])
    x, a, b, out = _inputs(5, 3, 8, torch.float32, seed=0)
    got = _check(out, x, a, b, slots, 8)
    assert torch.equal(got[1], out[1])
    assert all((got[i] - out[i]).abs().max() > 1e-2 for i in (0, 2, 3, 4))


def check_rank_not_power_of_two():
    slots = torch.tensor([1, 1, 1, 1])
    x, a, b, out = _inputs(4, 2, 3, torch.float32, seed=1)
    _check(out, x, a, b, slots, 3)


def check_all_rows_base_model_unchanged():
    slots = torch.tensor([-1, -1, -1])
    x, a, b, out = _inputs(3, 2, 8, torch.float32, seed=2)
    got = out.clone()
    lora_add_triton(got, x, a, b, slots, 8)
    assert torch.equal(got, out)


def check_out_is_a_column_slice():
    """out is wide[:, 16:16+N] (row stride wider than N): the slice gets the delta, the columns
    either side stay as they were."""
    slots = torch.tensor([1, -1, 0])
    x, a, b, _ = _inputs(3, 2, 4, torch.float32, seed=3)
    wide = torch.randn(3, N + 40, generator=torch.Generator().manual_seed(30))
    before = wide.clone()
    view = wide[:, 16:16 + N]
    ref = lora_add_reference(view.clone(), x, a, b, slots, 4)
    lora_add_triton(view, x, a, b, slots, 4)
    torch.testing.assert_close(view, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(wide[:, :16], before[:, :16])
    assert torch.equal(wide[:, 16 + N:], before[:, 16 + N:])
    assert torch.equal(wide[1], before[1])


def check_bf16():
    slots = torch.tensor([2, 0, -1, 1])
    x, a, b, out = _inputs(4, 3, 8, torch.bfloat16, seed=4)
    got = _check(out, x, a, b, slots, 8)
    assert torch.equal(got[2], out[2])


def check_slots_are_the_head_of_a_longer_int32_buffer():
    """A static slot buffer longer than the batch, in int32: only its first T entries count
    (the rest would index past `a` if they were read)."""
    buf = torch.tensor([1, -1, 0, 99, 7, -5], dtype=torch.int32)
    x, a, b, out = _inputs(3, 2, 8, torch.float32, seed=5)
    _check(out, x, a, b, buf[:3], 8)
    got = out.clone()
    lora_add_triton(got, x, a, b, buf, 8)
    torch.testing.assert_close(got, lora_add_reference(out.clone(), x, a, b, buf[:3], 8),
                               atol=1e-4, rtol=1e-4)


def check_b_as_the_transpose_of_the_stacks_storage():
    """LoRAStacks keeps B transposed ([S*rank, N], rows per slot contiguous) and passes
    `.T`: the kernel honours both of b's strides."""
    slots = torch.tensor([1, -1, 0])
    x, a, b, out = _inputs(3, 2, 4, torch.float32, seed=7)
    bt = b.T.contiguous()
    _check(out, x, a, bt.T, slots, 4)
