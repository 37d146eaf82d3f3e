"""One-shot GPU check: every CUDA test, the real engine and the decode benchmarks, in one
run of under 10 minutes.

    python benchmarks/gpu_check.py                    # on a GPU host (make gpu-check)
    python benchmarks/gpu_check.py --json out.json    # also write the results there
    python benchmarks/gpu_check.py --dry-run          # CPU: plan, bucket tables, smoke runs

No network, no checkpoints and no install of this project (the repository is made
importable as `tokenloom` from a temporary directory). Needs the GPU host's torch, triton,
transformers, tokenizers, safetensors, aiohttp and uvloop; what it lacks comes from
--wheels (`make gpu-wheels`). Models are random, generated on the machine, in bf16, of two
shapes: SmolLM2-135M and Llama-3-8B (plus a tiny fp32 one for parity).

1. CUDA tests: `pytest tests/gpu` in a subprocess (skipped, with a note, if pytest is absent).
2. The real engine (benchmarks/gpu_engine.py; `--skip-engine` leaves it out): `LLM` offline
   and `tokenloom serve` under 64 streams, over a random checkpoint of the SmolLM2-135M
   shape written on the machine, plus greedy parity against transformers (tiny model).
3. Copy bandwidth: device-to-device copy of 2 GiB, (read + write bytes) / time.
4. Decode benchmark per shape: step time and tokens/s at batch 1, 8, 32, 128, 256, with
   CUDA graphs vs eager, side by side; graph-vs-eager logits difference per batch; the
   memory roofline = (weight bytes + KV bytes read per step) / copy bandwidth. Then mixed
   steps on the same model (benchmarks/gpu_mixed.py): 8 decodes plus one mid-prompt chunk
   of 16, 128 or 512 tokens, eager vs piecewise graphs, side by side, with their parity.
5. Triton decode kernel at 8k context (Llama-3-8B layer shape): achieved bandwidth as a
   fraction of copy bandwidth, with the torch reference as the baseline.
Prints a table, checks the issue's targets, writes JSON (default benchmarks/raw/); the
JSON is rewritten after each part, so a run cut short keeps what it measured, and a part
that no longer fits --time-budget is skipped (a failure) rather than killed. A GPU run ends
with its record (benchmarks/records.py): the decode table and the targets.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
BATCHES = (1, 8, 32, 128, 256)
SHAPE_NAMES = ("smollm2-135m", "llama3-8b")
BLOCK_SIZE = 16
TARGETS = {
    "graphs_speedup_135m_b1_8": 2.0,        # graphs >= 2x eager at batch 1-8 (135M shape)
    "llama8b_b1_roofline_ratio": 1.3,       # 8B batch-1 step within 1.3x of its roofline
    "triton_8k_fraction_of_copy_bw": 0.70,  # Triton decode >= 70% of copy bandwidth at 8k
    "http_64_streams_gpu_busy": 0.80,       # tokenloom serve, 64 streams: GPU busy (NVML)
}


def make_importable() -> str:
    """Import `tokenloom` from this checkout, installed or not; returns the sys.path entry."""
    try:
        import tokenloom  # noqa: F401
        return str(Path(tokenloom.__file__).resolve().parent.parent)
    except ImportError:
        pass
    tmp = tempfile.mkdtemp(prefix="tokenloom-path-")
    os.symlink(ROOT, os.path.join(tmp, "tokenloom"))
    sys.path.insert(0, tmp)
    return tmp


# What the engine and its tests import that a bare GPU host (its own torch, triton,
# transformers, aiohttp, uvloop, hypothesis, pytest) lacks: carried as wheels (`make
# gpu-wheels`) and installed with --no-index into a temporary directory.
CARRIED = ("msgspec", "structlog", "pytest_asyncio", "zmq")
# Needed only by `tokenloom serve` (daemon/metrics.py): without it the engine part's HTTP
# step fails, with the reason, and the rest of the check still runs.
SERVER_CARRIED = ("prometheus_client",)


def install_wheels(wheels: Path, needed=CARRIED, optional=SERVER_CARRIED) -> str | None:
    """Install the wheels in `wheels` when a module of `needed` or `optional` is missing;
    returns the directory added to sys.path (None when nothing was missing). Exits when a
    `needed` module is still missing afterwards; a missing `optional` one is only printed."""
    import importlib.util
    missing = [m for m in (*needed, *optional) if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    files = sorted(str(w) for w in Path(wheels).glob("*.whl"))
    if not files:
        raise SystemExit(f"missing {', '.join(missing)} and no wheels in {wheels} "
                         f"(run `make gpu-wheels` where pip can download)")
    target = tempfile.mkdtemp(prefix="tokenloom-wheels-")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                    "--no-deps", "--target", target, *files], check=True)
    sys.path.insert(0, target)
    importlib.invalidate_caches()
    still = [m for m in missing if importlib.util.find_spec(m) is None]
    if any(m in needed for m in still):
        raise SystemExit(f"the wheels in {wheels} do not provide {', '.join(still)}")
    if still:
        print(f"warning: the wheels in {wheels} do not provide {', '.join(still)} "
              f"(`tokenloom serve` needs it: the engine part's HTTP step will fail)")
    return target


def _sibling(stem: str):
    """benchmarks/<stem>.py, imported by path (this script is not always run from
    benchmarks/, e.g. when the tests load it)."""
    import importlib.util
    name = f"tokenloom_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module    # before exec: dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def gpu_engine():
    """The engine part (benchmarks/gpu_engine.py)."""
    return _sibling("gpu_engine")


def gpu_mixed():
    """Mixed prefill+decode steps, eager vs piecewise graphs (benchmarks/gpu_mixed.py)."""
    return _sibling("gpu_mixed")


def records():
    """The run record (benchmarks/records.py)."""
    return _sibling("records")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU needed: print the plan and bucket tables, run a CPU smoke step")
    p.add_argument("--json", type=Path, default=None, help="where to write the JSON results")
    p.add_argument("--wheels", type=Path, default=None,
                   help="a directory of wheels to install (--no-index) when "
                        f"{', '.join(CARRIED)} are missing")
    p.add_argument("--out", type=Path, default=None,
                   help="a directory for gpu_check.json and gpu_check.txt (the printed tables)")
    p.add_argument("--shapes", default=",".join(SHAPE_NAMES),
                   help=f"comma-separated model shapes (from {', '.join(SHAPE_NAMES)}, tiny)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)),
                   help="comma-separated decode batch sizes")
    p.add_argument("--context", type=int, default=512,
                   help="tokens already in each sequence's context during the decode benchmark")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per point")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--kernel-context", type=int, default=8192,
                   help="context length for the Triton kernel bandwidth test")
    p.add_argument("--skip-tests", action="store_true", help="do not run pytest tests/gpu")
    p.add_argument("--skip-engine", action="store_true",
                   help="do not run the engine part (LLM offline, tokenloom serve; debugging "
                        "only: a GPU run without it fails)")
    p.add_argument("--test-timeout", type=int, default=240)
    p.add_argument("--time-budget", type=float, default=560.0,
                   help="seconds the whole GPU run may take (the host lends one 10-minute "
                        "run): a later part with less than its usual time left is skipped, "
                        "and the run fails saying so, instead of being killed mid-part")
    args = p.parse_args(argv)
    args.shape_list = [s for s in args.shapes.split(",") if s]
    args.batch_list = sorted({int(b) for b in args.batches.split(",") if b})
    if not args.batch_list or args.batch_list[0] < 1:
        p.error("--batches must be positive integers")
    return args


# -- pieces that run anywhere ----------------------------------------------------------------
def plan(args) -> dict:
    """Shapes, bytes and bucket tables: what the run will do (no GPU needed)."""
    from tokenloom.graphs.buckets import PaddedSizeTable, default_capture_sizes
    from tokenloom.kernels.models.random_model import SHAPES, num_parameters

    max_b = max(args.batch_list)
    out = {"batches": args.batch_list, "context": args.context,
           "default_capture_sizes": list(default_capture_sizes(max_b)),
           "padded_batches": {b: PaddedSizeTable(default_capture_sizes(max_b)).padded(b)
                              for b in args.batch_list},
           "shapes": {}}
    for name in args.shape_list:
        spec = SHAPES[name]
        params = num_parameters(spec)
        kv_tok = spec.kv_bytes_per_token(2)
        out["shapes"][name] = {
            "parameters": params, "weight_bytes_bf16": 2 * params, "kv_bytes_per_token": kv_tok,
            "kv_pool_bytes": max_b * (args.context + BLOCK_SIZE) * kv_tok,
            "bytes_per_step": {b: 2 * params + b * (args.context + 1) * kv_tok
                               for b in args.batch_list},
        }
    return out


def seqs_for(batch: int, context: int, blocks_per_seq: int, vocab: int):
    """`batch` decode rows, each at position `context` in its own blocks (block 0 unused)."""
    n_blocks = context // BLOCK_SIZE + 1
    return [SimpleNamespace(request_id=f"r{i}", token_ids=[(7 * i + 3) % vocab], start_pos=context,
                            block_table=[1 + i * blocks_per_seq + j for j in range(n_blocks)],
                            sample=True) for i in range(batch)]


def build(shape: str, device: str, max_batch: int, context: int, dtype):
    """Random model + KV pool + static buffers; Triton kernels on CUDA."""

    from tokenloom.arith import cdiv
    from tokenloom.graphs.buffers import DecodeBuffers
    from tokenloom.graphs.capture import DecodeGraphs
    from tokenloom.kernels.kv_store import KVCache
    from tokenloom.kernels.models.random_model import SHAPES, random_model

    spec = SHAPES[shape]
    max_len = context + BLOCK_SIZE
    model = random_model(spec, dtype, device, max_positions=max_len)
    if device == "cuda":
        from tokenloom.kernels.gpu.triton_attention import make_decode_kernel, store_kv_triton
        model.set_decode_kernel(make_decode_kernel(spec))
        model.set_kv_store_kernel(store_kv_triton)
    bps = cdiv(max_len, BLOCK_SIZE)
    kv = KVCache.allocate(spec.num_layers, max_batch * bps + 1, BLOCK_SIZE, spec.num_kv_heads,
                          spec.head_dim, dtype, device)
    for k, v in zip(kv.key, kv.value):
        k.normal_()
        v.normal_()
    buffers = DecodeBuffers(max_batch, bps, BLOCK_SIZE, spec.vocab_size, device)
    return SimpleNamespace(spec=spec, model=model, kv=kv, graphs=DecodeGraphs(model, kv, buffers),
                           bps=bps)


def eager_step(m, seqs, device):
    import torch

    from tokenloom.actors.execution.batch_inputs import build_batch_inputs

    inputs = build_batch_inputs(SimpleNamespace(sequences=seqs, num_decodes=len(seqs)),
                                BLOCK_SIZE, torch.device(device))
    return m.model(inputs.input_ids, inputs.positions, m.kv, inputs.meta, inputs.logits_indices)


def time_steps(fn, steps: int, warmup: int, sync) -> float:
    """Median wall seconds of one step (each step ends with a device sync, as sampling does)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_decode(m, batches, context, steps, warmup, device) -> list[dict]:
    """Per batch: eager and graph (replay on CUDA; static-buffer eager on CPU) step times."""
    import torch

    from tokenloom.graphs.buckets import PaddedSizeTable

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    table = PaddedSizeTable(sorted(batches))
    rows = []
    for b in batches:
        seqs = seqs_for(b, context, m.bps, m.spec.vocab_size)
        replays_before = m.graphs.num_replays
        with torch.inference_mode():
            eager_logits = eager_step(m, seqs, device).float()
            graph_logits = m.graphs.run(seqs, table.padded(b))[:b].float()
            diff = (eager_logits - graph_logits).abs().max().item()
            rel = diff / max(1e-6, eager_logits.abs().max().item())
            t_eager = time_steps(lambda: eager_step(m, seqs, device), steps, warmup, sync)
            t_graph = time_steps(lambda: m.graphs.run(seqs, table.padded(b)), steps, warmup, sync)
        rows.append({"batch": b, "eager_ms": 1e3 * t_eager, "graph_ms": 1e3 * t_graph,
                     "eager_tok_s": b / t_eager, "graph_tok_s": b / t_graph,
                     "speedup": t_eager / t_graph, "graph_vs_eager_max_rel_diff": rel,
                     # counted by DecodeGraphs.run (0 on CPU, or when no bucket was captured)
                     "graph_replays": m.graphs.num_replays - replays_before})
    return rows


def dry_run(args, result: dict, pythonpath: str, save) -> None:
    """Plan + a CPU smoke run of the benchmark code on the tiny shape (no graphs on CPU),
    and the engine part on CPU (tiny shape, a short HTTP load, no NVML)."""
    import torch

    result.update(mode="dry-run", plan=plan(args))
    m = build("tiny", "cpu", 4, 40, torch.float32)
    rows = bench_decode(m, [1, 3], 40, steps=2, warmup=1, device="cpu")
    result["cpu_smoke"] = rows   # parity checked by failures()
    # The mixed-step benchmark's code, the pieces run eagerly (nothing captured on CPU).
    result["cpu_mixed_smoke"] = gpu_mixed().bench_mixed(m, "cpu", time_steps, decodes=2,
                                                        chunks=(8, 32), context=40, steps=2,
                                                        warmup=1)
    save(result)
    if not args.skip_engine:
        engine = gpu_engine()
        result["engine"] = engine.run(engine.DRY_PLAN, pythonpath)


# -- GPU-only pieces -------------------------------------------------------------------------
def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write."""
    import torch

    a = torch.empty(1 << 30, dtype=torch.int16, device="cuda")  # 2 GiB
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * (2 << 30) / best


def kernel_bandwidth(context: int, copy_bw: float) -> list[dict]:
    """Triton decode vs torch reference on one Llama-3-8B layer at `context` tokens."""
    import torch

    from tokenloom.arith import cdiv
    from tokenloom.kernels.attention import decode_attention
    from tokenloom.kernels.gpu.triton_attention import make_decode_kernel
    from tokenloom.kernels.models.random_model import SHAPES

    heads, kvh, d = 32, 8, 128
    nb = cdiv(context, BLOCK_SIZE)
    rows = []
    fn = make_decode_kernel(SHAPES["llama3-8b"])   # the split sized per call by the SMs
    for b in (1, 8, 32):
        kc = torch.randn(b * nb + 1, BLOCK_SIZE, kvh, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        tables = (1 + torch.randperm(b * nb, device="cuda")).view(b, nb)
        lens = torch.full((b,), context, device="cuda")
        q = torch.randn(b, heads, d, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * b * context * kvh * d * 2

        def timed(f, n=20):
            for _ in range(3):
                f()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(n):
                f()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / 1e3 / n

        t_tri = timed(lambda: fn(q, kc, vc, tables, lens, context, d ** -0.5))
        t_ref = timed(lambda: decode_attention(q, kc, vc, tables, lens, context, d ** -0.5), n=5)
        ref = decode_attention(q.float(), kc.float(), vc.float(), tables, lens, context, d ** -0.5)
        err = (fn(q, kc, vc, tables, lens, context, d ** -0.5).float() - ref).abs().max().item()
        rows.append({"batch": b, "context": context, "bytes": nbytes,
                     "triton_us": t_tri * 1e6, "torch_ref_us": t_ref * 1e6,
                     "triton_gb_s": nbytes / t_tri / 1e9,
                     "fraction_of_copy_bw": nbytes / t_tri / copy_bw,
                     "speedup_vs_ref": t_ref / t_tri, "max_abs_err": err})
        kc = vc = None   # not `del`: the lambdas above close over these names
        torch.cuda.empty_cache()
    return rows


def run_tests(pythonpath: str, timeout: int) -> dict:
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"ran": False, "note": "pytest is not installed on this machine"}
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [pythonpath, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-s", "-o", "addopts=",
           "-p", "no:cacheprovider", "--import-mode=importlib", str(ROOT / "tests" / "gpu")]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {"ran": True, "ok": False, "note": f"timed out after {timeout}s",
                "tail": (e.stdout or "")[-3000:] if isinstance(e.stdout, str) else ""}
    tail = (proc.stdout + proc.stderr)[-4000:]
    print(tail)
    # (-rs lists each skip with its reason; on a GPU host none may be skipped)
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    return {"ran": True, "ok": proc.returncode == 0, "returncode": proc.returncode,
            "skipped": skipped,
            "seconds": time.perf_counter() - t, "summary": proc.stdout.strip().splitlines()[-1:],
            "tail": tail}


# Seconds a part usually needs on one H200 (rough, generous to the part): with less than
# this left of --time-budget it is skipped (see `has_time`).
PART_SECONDS = {"engine": 150, "smollm2-135m": 40, "llama3-8b": 75, "tiny": 10, "kernel": 15}


def has_time(result: dict, part: str, seconds_left: float) -> bool:
    """Whether `part` fits in what is left; if not, it is listed in result["skipped_for_time"]
    (a failure: its numbers are missing) and the run moves on to write what it has."""
    if seconds_left >= PART_SECONDS.get(part, 30):
        return True
    result.setdefault("skipped_for_time", []).append(part)
    print(f"== {part}: skipped, {seconds_left:.0f}s left of the time budget")
    return False


def gpu_run(args, result: dict, pythonpath: str, save) -> None:
    """Every part in turn into `result`, saved after each (`save(result)`), within
    --time-budget seconds from now."""
    import torch

    deadline = time.monotonic() + args.time_budget
    left = lambda: deadline - time.monotonic()  # noqa: E731
    result.update(mode="gpu", plan=plan(args), device=torch.cuda.get_device_name(),
                  torch=torch.__version__)
    import triton
    result["triton"] = triton.__version__
    if not args.skip_tests:
        print("== CUDA tests (tests/gpu)")
        # The tests may not eat the engine part's time.
        reserve = 0 if args.skip_engine else PART_SECONDS["engine"]
        timeout = int(min(args.test_timeout, max(30, left() - reserve)))
        result["tests"] = run_tests(pythonpath, timeout)
        save(result)
    if not args.skip_engine and has_time(result, "engine", left()):
        engine = gpu_engine()   # the real engine before the synthetic benchmarks
        result["engine"] = engine.run(engine.GPU_PLAN, pythonpath)
        result["targets"] = check_targets(result)
        save(result)
    bw = copy_bandwidth()
    result["copy_bandwidth_gb_s"] = bw / 1e9
    print(f"== copy bandwidth: {bw / 1e9:.0f} GB/s (read + write)")
    result["decode"] = {}
    for shape in args.shape_list:
        if not has_time(result, shape, left()):
            continue
        print(f"== decode benchmark: {shape} (bf16, random weights, context {args.context})")
        t0 = time.perf_counter()
        m = build(shape, "cuda", max(args.batch_list), args.context, torch.bfloat16)
        build_s = time.perf_counter() - t0
        m.graphs.capture(tuple(args.batch_list), memory_budget_bytes=16 << 30, progress=False)
        rows = bench_decode(m, args.batch_list, args.context, args.steps, args.warmup, "cuda")
        plan_shape = result["plan"]["shapes"][shape]
        for r in rows:
            r["roofline_ms"] = 1e3 * plan_shape["bytes_per_step"][r["batch"]] / bw
            r["graph_vs_roofline"] = r["graph_ms"] / r["roofline_ms"]
        result["decode"][shape] = {"build_seconds": build_s,
                                   "capture_seconds": m.graphs.capture_seconds,
                                   "capture_bytes": m.graphs.capture_bytes, "rows": rows}
        save(result)
        print(f"== mixed steps: {shape} (8 decodes + one mid-prompt chunk), eager vs piecewise")
        result["mixed"] = {**result.get("mixed", {}), shape: gpu_mixed().bench_mixed(
            m, "cuda", time_steps, context=args.context, steps=args.steps,
            warmup=args.warmup)}
        del m
        torch.cuda.empty_cache()
        result["targets"] = check_targets(result)
        save(result)
    if has_time(result, "kernel", left()):
        print(f"== Triton decode kernel at {args.kernel_context} context")
        result["kernel"] = kernel_bandwidth(args.kernel_context, bw)
    result["targets"] = check_targets(result)


def check_targets(result: dict) -> dict:
    out = {}
    busy = result.get("engine", {}).get("http", {}).get("gpu_busy", {})
    if busy.get("available"):
        v = busy["fraction"]
        out["http_64_streams_gpu_busy"] = {"value": v, "target": ">= 0.80",
                                           "met": v >= TARGETS["http_64_streams_gpu_busy"]}
    small = result.get("decode", {}).get("smollm2-135m")
    if small:
        worst = min((r["speedup"] for r in small["rows"] if r["batch"] <= 8), default=None)
        if worst is not None:
            out["graphs_speedup_135m_b1_8"] = {"value": worst, "target": ">= 2.0",
                                              "met": worst >= TARGETS["graphs_speedup_135m_b1_8"]}
    big = result.get("decode", {}).get("llama3-8b")
    if big:
        r1 = next((r for r in big["rows"] if r["batch"] == 1), None)
        if r1:
            v = r1["graph_vs_roofline"]
            out["llama8b_b1_roofline_ratio"] = {"value": v, "target": "<= 1.3",
                                               "met": v <= TARGETS["llama8b_b1_roofline_ratio"]}
    if result.get("kernel"):
        best = max(r["fraction_of_copy_bw"] for r in result["kernel"])
        out["triton_8k_fraction_of_copy_bw"] = {
            "value": best, "target": ">= 0.70",
            "met": best >= TARGETS["triton_8k_fraction_of_copy_bw"]}
    return out


# Graph replay against eager logits, bf16 (the same kernels; only accumulation order differs).
PARITY_MAX_REL_DIFF = 2e-2


def failures(result: dict) -> list[str]:
    """Why this run must fail (empty: it passes). A GPU run fails on a failed or skipped
    CUDA test, a target missed or not measured, a graph-vs-eager parity miss, a decode
    point that replayed no graph, or the engine part's failures (gpu_engine.failures:
    a step that raised, greedy parity against transformers, HTTP errors, no replays) or
    its absence; a dry run on its CPU smoke parity and the engine part's failures on CPU.
    Either fails when the check itself raised."""
    out = []
    if result.get("error"):
        out.append(f"the check raised: {result['error'].strip().splitlines()[-1]}")
    if result.get("mode") == "dry-run":
        out += [f"CPU smoke parity: batch {r['batch']} differs by "
                f"{r['graph_vs_eager_max_rel_diff']:.1e}" for r in result.get("cpu_smoke", ())
                if r["graph_vs_eager_max_rel_diff"] >= 1e-4]
        out += [f"CPU mixed-step smoke parity: {r['tokens']} tokens differ by "
                f"{r['piecewise_vs_eager_max_rel_diff']:.1e}"
                for r in result.get("cpu_mixed_smoke", {}).get("rows", ())
                if r["piecewise_vs_eager_max_rel_diff"] >= 1e-4]
        if "engine" in result:
            out += gpu_engine().failures(result["engine"], on_gpu=False)
        return out
    out += [f"{part} skipped: out of the time budget"
            for part in result.get("skipped_for_time", ())]
    if "engine" in result:
        out += gpu_engine().failures(result["engine"], on_gpu=True)
    elif "engine" not in result.get("skipped_for_time", ()):
        out.append("the engine part did not run (--skip-engine)")
    tests = result.get("tests")
    if tests is None or not tests.get("ran"):
        out.append(f"CUDA tests did not run: {(tests or {}).get('note', 'skipped (--skip-tests)')}")
    else:
        if not tests.get("ok"):
            out.append(f"CUDA tests failed: {tests.get('summary')}")
        if tests.get("skipped"):
            out.append(f"CUDA tests skipped on a GPU host: {tests['skipped']}")
    targets = result.get("targets", {})
    for name in TARGETS:
        t = targets.get(name)
        if t is None:
            out.append(f"target {name} was not measured")
        elif not t["met"]:
            out.append(f"target {name} missed: {t['value']:.3f} (want {t['target']})")
    for shape, d in result.get("decode", {}).items():
        for r in d["rows"]:
            if r["graph_vs_eager_max_rel_diff"] > PARITY_MAX_REL_DIFF:
                out.append(f"{shape} batch {r['batch']}: graph vs eager logits differ by "
                           f"{r['graph_vs_eager_max_rel_diff']:.1e}")
            if r.get("graph_replays", 0) == 0:
                out.append(f"{shape} batch {r['batch']}: no CUDA graph was replayed")
    for shape, d in result.get("mixed", {}).items():
        for r in d["rows"]:
            where = f"{shape} mixed step of {r['tokens']} tokens"
            if r["piecewise_vs_eager_max_rel_diff"] > PARITY_MAX_REL_DIFF:
                out.append(f"{where}: piecewise vs eager logits differ by "
                           f"{r['piecewise_vs_eager_max_rel_diff']:.1e}")
            if r.get("piecewise_replays", 0) == 0:
                out.append(f"{where}: no piecewise graph was replayed")
    return out


def print_tables(result: dict) -> None:
    plan_ = result.get("plan")
    if plan_ is None:   # the check raised before it planned anything
        return
    print(f"\nbuckets (default up to {max(plan_['batches'])}): {plan_['default_capture_sizes']}")
    print(f"padded batch sizes: {plan_['padded_batches']}")
    for name, s in plan_["shapes"].items():
        print(f"{name}: {s['parameters'] / 1e6:.1f}M params, "
              f"{s['weight_bytes_bf16'] / 2**30:.2f} GiB bf16 weights, "
              f"{s['kv_bytes_per_token']} KV bytes/token, KV pool "
              f"{s['kv_pool_bytes'] / 2**30:.2f} GiB")
    for shape, d in result.get("decode", {}).items():
        print(f"\n{shape}: capture {d['capture_seconds']:.1f}s, "
              f"{d['capture_bytes'] / 2**20:.0f} MiB")
        print(f"{'batch':>6} {'eager ms':>9} {'graph ms':>9} {'speedup':>8} {'eager tok/s':>12} "
              f"{'graph tok/s':>12} {'roofline ms':>12} {'x roofline':>10} {'rel diff':>9}")
        for r in d["rows"]:
            print(f"{r['batch']:>6} {r['eager_ms']:>9.3f} {r['graph_ms']:>9.3f} "
                  f"{r['speedup']:>8.2f} {r['eager_tok_s']:>12.0f} {r['graph_tok_s']:>12.0f} "
                  f"{r.get('roofline_ms', 0):>12.3f} {r.get('graph_vs_roofline', 0):>10.2f} "
                  f"{r['graph_vs_eager_max_rel_diff']:>9.1e}")
    for shape, d in result.get("mixed", {}).items():
        gpu_mixed().print_mixed(shape, d)
    if "cpu_mixed_smoke" in result:
        gpu_mixed().print_mixed("tiny (CPU smoke)", result["cpu_mixed_smoke"])
    if result.get("kernel"):
        print(f"\nTriton decode kernel (Llama-3-8B layer, bf16), copy bandwidth "
              f"{result['copy_bandwidth_gb_s']:.0f} GB/s")
        print(f"{'batch':>6} {'context':>8} {'triton us':>10} {'GB/s':>8} {'of copy':>8} "
              f"{'torch ref us':>13} {'speedup':>8} {'max err':>8}")
        for r in result["kernel"]:
            print(f"{r['batch']:>6} {r['context']:>8} {r['triton_us']:>10.1f} "
                  f"{r['triton_gb_s']:>8.0f} {r['fraction_of_copy_bw']:>8.2f} "
                  f"{r['torch_ref_us']:>13.1f} {r['speedup_vs_ref']:>8.2f} "
                  f"{r['max_abs_err']:>8.1e}")
    if "engine" in result:
        gpu_engine().print_tables(result["engine"])
    for name, t in result.get("targets", {}).items():
        print(f"target {name}: {t['value']:.2f} (want {t['target']}) -> "
              f"{'MET' if t['met'] else 'NOT MET'}")
    if "tests" in result:
        t = result["tests"]
        print(f"CUDA tests: {'ok' if t.get('ok') else 'FAILED' if t.get('ran') else t.get('note')}")
    if "cpu_smoke" in result:
        print(f"CPU smoke (tiny, static-buffer path vs eager): {result['cpu_smoke']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    pythonpath = make_importable()
    if args.wheels is not None:
        carried = install_wheels(args.wheels)
        if carried:   # the CUDA tests and the server run in subprocesses: they need them too
            pythonpath = os.pathsep.join([pythonpath, carried])
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (use --dry-run for the CPU-safe parts)")
        return 2
    stamp = f"gpu_check{'_dry' if args.dry_run else ''}_{dt.datetime.now():%Y%m%d_%H%M%S}"
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "gpu_check.json"
    else:
        path = args.json or records().RAW / f"{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def save(partial: dict) -> None:   # after each part: a run cut short keeps its numbers
        path.write_text(json.dumps({**partial, "partial": True}, indent=2, default=str))

    started = time.perf_counter()
    result: dict = {"host": platform.node()}
    try:
        (dry_run if args.dry_run else gpu_run)(args, result, pythonpath, save)
    except Exception:   # one run on the GPU host: keep what was measured, and say why
        import traceback
        result["error"] = traceback.format_exc()
        print(result["error"], file=sys.stderr)
    result["seconds"] = time.perf_counter() - started
    result["failures"] = failures(result)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_tables(result)
        for problem in result["failures"]:
            print(f"FAIL: {problem}")
        print("gpu check: " + ("FAILED" if result["failures"] else "passed"))
    print(buf.getvalue(), end="")
    if args.out is not None:
        (args.out / "gpu_check.txt").write_text(buf.getvalue())
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwrote {path} ({result['seconds']:.0f}s)")
    if result.get("mode") == "gpu":
        record(result, args)
    return 1 if result["failures"] else 0


def record(result: dict, args) -> None:
    """A GPU run's record: the decode table (every shape and batch) and the targets."""
    columns = ["shape", "batch", "eager ms", "graph ms", "speedup", "eager tok/s",
               "graph tok/s", "roofline ms", "x roofline", "rel diff"]
    rows = [[shape, r["batch"], r["eager_ms"], r["graph_ms"], r["speedup"], r["eager_tok_s"],
             r["graph_tok_s"], r.get("roofline_ms"), r.get("graph_vs_roofline"),
             f"{r['graph_vs_eager_max_rel_diff']:.1e}"]
            for shape, d in result.get("decode", {}).items() for r in d["rows"]]
    targets = result.get("targets", {})
    summary = {"targets": {k: t["value"] for k, t in targets.items()},
               "targets_met": f"{sum(t['met'] for t in targets.values())}/{len(TARGETS)}",
               "copy_bandwidth_gb_s": result.get("copy_bandwidth_gb_s"),
               "failures": len(result["failures"])}
    records().record_run("gpu_check", summary, {"columns": columns, "rows": rows}, args)


if __name__ == "__main__":
    sys.exit(main())
