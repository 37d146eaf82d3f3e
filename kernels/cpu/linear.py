"""The CPU projection: `CpuLinear` runs each call with the kernel its measured `Plan` chose
for the call's row count.

The pieces live by concern: kernels/cpu/onednn.py (oneDNN with prepacked weights),
kernel_set.py (a weight in the forms its kernels need, the kernels by name),
kernel_plan.py (timing the candidates at start-up, bands of rows, the remembered plan).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.kernels.cpu import blocks as blk
from tokenloom.kernels.cpu.kernel_plan import Plan, band_kernel
from tokenloom.kernels.cpu.kernel_set import BLOCK_STORAGES, INT8, NOT_TRACEABLE, KernelSet


class CpuLinear(nn.Module):
    """A projection whose kernel depends on the call's row count (a measured Plan). Same
    contract as nn.Linear for 2-D inputs [rows, in_features] -> [rows, out_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, storage: str,
                 act_dtype: torch.dtype, chosen: Plan, blocks: "blk.Blocks | None" = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.storage = storage
        # What a decode call streams: the weight once (int8: plus its fp32 scales; q4/q8:
        # the blocks with their fp16 scales and mins).
        element = 1 if storage == INT8 else torch.tensor([], dtype=act_dtype).element_size()
        self.weight_bytes = (self.out_features * self.in_features * element
                             + (4 * self.out_features if storage == INT8 else 0))
        # Compiled decode programs (graphs/cpu_compile.py) cannot call oneDNN's packed
        # weights: while tracing, the fastest other kernel for the row count is used.
        traced = chosen.excluding(NOT_TRACEABLE)
        self.kernels = KernelSet(weight, bias, storage, act_dtype,
                                 chosen.kernels | traced.kernels, blocks=blocks)
        if storage in BLOCK_STORAGES:
            self.weight_bytes = sum(t.numel() * t.element_size()
                                    for t in (self.kernels.qs, self.kernels.d, self.kernels.m)
                                    if t is not None)
        self._bands = chosen.bands
        self._traced_bands = traced.bands
        self.kernel_names = tuple(name for _, name in chosen.bands)
        self.traced_kernel_names = tuple(name for _, name in traced.bands)

    def kernel_for(self, rows: int) -> str:
        """The kernel an eager call with `rows` rows runs."""
        return band_kernel(self._bands, rows)

    def traced_kernel_for(self, rows: int) -> str:
        """The kernel a compiled program with `rows` rows runs."""
        return band_kernel(self._traced_bands, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        bands = self._traced_bands if torch.compiler.is_compiling() else self._bands
        for hi, name in bands:
            if rows <= hi:
                return self.kernels.run(name, x)
        return self.kernels.run(bands[-1][1], x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"storage={self.storage}, kernels={self.kernel_names}")
