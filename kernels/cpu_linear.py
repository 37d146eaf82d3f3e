"""fp32 projections on CPU through oneDNN with prepacked weights, when it measures faster.

torch's default CPU matmul (MKL) streams a decode batch's weights at a fraction of the
memory bandwidth; oneDNN's inner-product primitive on a weight reordered once into its
blocked layout (`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`, the
path torch's own CPU inductor uses) streams them far better. Measured on a 2-core AVX2
machine, SmolLM2-135M's 30 layers of projections: 20 -> 12 ms at 1 row, 32 -> 11 ms at
4, 41 -> 15 ms at 16, 44 -> 18 ms for a 256-token chunk of one gate_up projection x10;
the 49k-vocabulary head 6.8 -> 2.7 ms at 1 row.

Which is faster depends on the CPU (ISA, caches, core count), so the choice is made by
measuring on this machine at start-up (`choose`), never by a constant. Results differ from
MKL's only in the rounding of the sums (as they do between batch sizes).
"""

from __future__ import annotations

import statistics
import time

import structlog
import torch
from torch import nn

log = structlog.get_logger("tokenloom.startup", logger_name="tokenloom.startup")

ROWS_HINT = 16   # the batch size oneDNN picks the packed layout for (any size works)


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """A Linear whose weight is reordered once for oneDNN (CPU, fp32). Same contract as
    nn.Linear for 2-D inputs [rows, in_features] -> [rows, out_features]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _median_ms(fn, reps: int = 5) -> float:
    fn()  # warm-up (first call allocates)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def choose(linears: list[nn.Linear], rows: tuple[int, ...] = (1, 16, 128)) -> bool:
    """Whether oneDNN with packed weights beats the current layout on these projections
    (e.g. one decoder layer's), summed over decode- and prefill-sized batches."""
    if not onednn_available() or not linears:
        return False
    try:
        packed = [PackedLinear(lin) for lin in linears]
    except RuntimeError as e:  # a torch build without the primitive
        log.info("oneDNN linear unavailable; using MKL", reason=str(e))
        return False
    with torch.inference_mode():
        mkl = onednn = 0.0
        for n in rows:
            xs = [torch.randn(n, lin.in_features) for lin in linears]
            mkl += _median_ms(lambda: [lin(x) for lin, x in zip(linears, xs)])
            onednn += _median_ms(lambda: [p(x) for p, x in zip(packed, xs)])
    use = onednn < mkl
    log.info(f"CPU projections: {'oneDNN packed' if use else 'MKL'} (measured {onednn:.2f} ms "
             f"oneDNN vs {mkl:.2f} ms MKL for one layer at {', '.join(map(str, rows))} rows)",
             onednn_ms=round(onednn, 3), mkl_ms=round(mkl, 3))
    return use
