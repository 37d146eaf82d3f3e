"""What bounding oneDNN's row counts costs and saves, side by side in one run.

kernels/cpu/onednn.py calls oneDNN's packed linear at a bounded set of row counts
(`onednn_rows`: exact up to 16, above rounded up by less than 1/8), because oneDNN keeps a
JIT-compiled primitive per input shape in a process-wide cache. On SmolLM2-135M's four
projection shapes (576x960 qkv, 576x576 o, 576x3072 gate_up, 1536x576 down), fp32:

- memory: every row count from 1 to --max-rows once, exact vs padded, each in a fresh
  child process: growth of glibc's malloc in-use bytes and of RSS;
- time: per row count in --rows, the four projections called exact vs padded, warm (the
  primitive already built), interleaved, best of --reps; the ratio is padded / exact (> 1:
  padding costs that much). A bucket's own size (e.g. 18, 104) is the control: ~1.0.

The time table is the run's record (benchmarks/records.py), the memory figures its summary.

    python benchmarks/onednn_shapes.py
    python benchmarks/onednn_shapes.py --max-rows 600 --rows 17 33 100 129 300 513
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time

import torch

from tokenloom.kernels.cpu import onednn

from records import record_run

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))   # (out, in)


def _malloc_in_use() -> int:
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd "
                                                     "usmblks fsmblks uordblks fordblks "
                                                     "keepcost").split()]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    return libc.mallinfo2().uordblks


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _packed():
    g = torch.Generator().manual_seed(0)
    return [(torch.ops.mkldnn._reorder_linear_weight(torch.randn(o, i, generator=g) * 0.05,
                                                     onednn.ROWS_HINT), i)
            for o, i in SHAPES]


def _call(x, packed, padded: bool):
    if padded:
        return onednn.onednn_linear(x, packed, None)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def memory_child(max_rows: int, padded: bool) -> dict:
    """Run in a child process: every row count once, the growth it leaves behind."""
    torch.set_num_threads(torch.get_num_threads())
    weights = _packed()
    with torch.inference_mode():
        for p, i in weights:                  # oneDNN's own first-use allocations
            _call(torch.randn(1, i), p, padded)
        in_use, rss = _malloc_in_use(), _rss()
        for rows in range(1, max_rows + 1):
            for p, i in weights:
                _call(torch.randn(rows, i), p, padded)
    shapes = len({onednn.onednn_rows(r) if padded else r for r in range(1, max_rows + 1)})
    return {"row_counts_reaching_onednn": shapes,
            "malloc_in_use_growth_mib": round((_malloc_in_use() - in_use) / 2**20, 1),
            "rss_growth_mib": round((_rss() - rss) / 2**20, 1)}


def timing(rows_list, reps: int) -> list[dict]:
    """Exact and padded calls interleaved rep by rep (a shared machine's slow spells hit
    both alike), best of `reps` each."""
    weights = _packed()
    xs = {rows: [torch.randn(rows, i) for _, i in weights] for rows in rows_list}
    best: dict[tuple[int, bool], float] = {}
    with torch.inference_mode():
        for rows in rows_list:                # build the primitives first
            for padded in (False, True):
                for (p, _), x in zip(weights, xs[rows]):
                    _call(x, p, padded)
        for _ in range(reps):
            for rows in rows_list:
                for padded in (False, True):
                    t = time.perf_counter()
                    for (p, _), x in zip(weights, xs[rows]):
                        _call(x, p, padded)
                    dt = (time.perf_counter() - t) * 1000
                    best[rows, padded] = min(best.get((rows, padded), float("inf")), dt)
    return [{"rows": rows, "padded_rows": onednn.onednn_rows(rows),
             "exact_ms": round(best[rows, False], 3), "padded_ms": round(best[rows, True], 3),
             "ratio": round(best[rows, True] / best[rows, False], 3)} for rows in rows_list]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-rows", type=int, default=400)
    p.add_argument("--rows", type=int, nargs="+",
                   default=[17, 18, 100, 104, 129, 144, 300, 320, 513, 576])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--child", choices=["exact", "padded"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if not onednn.onednn_available():
        print("this torch build has no oneDNN linear")
        return 1
    if args.child:
        print(json.dumps(memory_child(args.max_rows, args.child == "padded")))
        return 0
    memory = {}
    for mode in ("exact", "padded"):
        res = subprocess.run([sys.executable, __file__, "--child", mode, "--max-rows",
                              str(args.max_rows)], capture_output=True, text=True, check=True)
        memory[mode] = json.loads(res.stdout.strip().splitlines()[-1])
    times = timing(args.rows, args.reps)
    print(f"memory after row counts 1..{args.max_rows} on {len(SHAPES)} projections:")
    for mode, m in memory.items():
        print(f"  {mode:<7} {m['row_counts_reaching_onednn']:4d} row counts  malloc in use "
              f"+{m['malloc_in_use_growth_mib']:.1f} MiB  RSS +{m['rss_growth_mib']:.1f} MiB")
    print("time of the four projections (ms, best of %d):" % args.reps)
    print(f"  {'rows':>5} {'padded':>6} {'exact':>8} {'padded':>8} {'ratio':>6}")
    for t in times:
        print(f"  {t['rows']:5d} {t['padded_rows']:6d} {t['exact_ms']:8.3f} "
              f"{t['padded_ms']:8.3f} {t['ratio']:6.3f}")
    columns = ["rows", "padded rows", "exact ms", "padded ms", "padded / exact"]
    rows = [[t["rows"], t["padded_rows"], t["exact_ms"], t["padded_ms"], t["ratio"]]
            for t in times]
    summary = {mode: {"row_counts": m["row_counts_reaching_onednn"],
                      "malloc_growth_mib": m["malloc_in_use_growth_mib"],
                      "rss_growth_mib": m["rss_growth_mib"]} for mode, m in memory.items()}
    summary["worst_padded_over_exact"] = max(t["ratio"] for t in times)
    record_run("onednn_shapes", summary, {"columns": columns, "rows": rows}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
