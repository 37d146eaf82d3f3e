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

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.arith import cdiv
from tokenloom.startup_log import startup_log as log

ROWS_HINT = 16   # the batch size oneDNN picks the packed layout for (any size works)


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


# dtypes whose oneDNN reorder this torch refused (a CPU without the primitive, e.g. bf16 on
# AVX2): not tried again, so the reason is logged once, not once per projection and plan
# trial (a six-model benchmark printed it ~200 times).
_ONEDNN_REFUSED: set[torch.dtype] = set()


def onednn_pack(w: torch.Tensor) -> torch.Tensor | None:
    """w reordered for oneDNN's linear, or None where this torch or CPU cannot."""
    if not onednn_available() or w.dtype in _ONEDNN_REFUSED:
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT)
    except RuntimeError as e:  # a torch build without the primitive for this dtype
        _ONEDNN_REFUSED.add(w.dtype)
        log.info("oneDNN linear unavailable", dtype=str(w.dtype), reason=str(e))
        return None


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
        return onednn_linear(x, self.packed, self.bias)


# oneDNN builds (JIT-compiles) a primitive for every input shape it sees and keeps it in its
# process-wide primitive cache (1,024 entries): 0.3-0.6 MiB of native memory each (measured
# on the tiny test model's shapes and SmolLM2's: benchmarks/onednn_shapes.py). A server's
# steps have every row count from 1 to the batch-token budget, so keyed by the exact count
# the cache grew by ~0.8 KiB a request under mixed traffic (the soak: ~9 MiB a minute,
# until the cache is full at 0.3-0.6 GiB). Calls are therefore made at a bounded set of row
# counts: exact up to ONEDNN_EXACT_ROWS (decode batches, where the weights' memory traffic
# dominates), above it rounded up to 1/8 of the power of two below (at most 12.5% padding
# rows, 8 shapes per doubling: 72 up to 2,048 rows).
ONEDNN_EXACT_ROWS = 16


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN call for `rows` rows is made at (>= rows)."""
    if rows <= ONEDNN_EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 4)
    return cdiv(rows, step) * step


def onednn_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x . W^T + b through oneDNN's packed weight, at a padded row count (onednn_rows)."""
    rows = x.shape[0]
    padded = onednn_rows(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out if padded == rows else out[:rows]


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
