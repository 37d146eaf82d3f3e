"""Every CPU projection kernel on the default model's shapes, against the measured roofline.

For each weight storage (fp32, bf16, int8, q4 from the shipped Q4_1 file's own blocks, q8)
and each kernel the planner can pick for it, one decode step's projections (30 layers x
qkv, o, gate_up, down, plus the LM head) at 1, 2, 4, 8 and 16 rows, and a 256-row prefill
chunk: ms per step (best of --reps), the bytes the kernel must stream (every weight byte
once), and that time as a fraction of bytes / the machine's read bandwidth (measured in a
child process with both cores: benchmarks/records.py's read_bandwidth_gbs). > 90% of the roofline
means the kernel streams its weights as fast as the memory delivers them.

    python benchmarks/gemv_kernels.py
    python benchmarks/gemv_kernels.py --storages q4 fp32 --rows 1 16
"""

from __future__ import annotations

import argparse
import time

import torch

from records import read_bandwidth_gbs, record_run, write_raw

STORAGES = {  # name: (KernelSet storage, activation dtype)
    "fp32": ("float", torch.float32),
    "bf16": ("float", torch.bfloat16),
    "int8": ("int8", torch.bfloat16),
    "q4": ("q4", torch.float32),
    "q8": ("q8", torch.float32),
}


def model_weights():
    """The default model's fused projections per layer (dense fp32) and, for q4, the file's
    own blocks."""
    from tokenloom.config.schema import ModelConfig, resolve_cache_dir
    from tokenloom.kernels.models import gguf_blocks, loader

    d = loader.ensure_default_model(resolve_cache_dir(ModelConfig()))
    model, spec = loader.load_model(d, torch.float32, torch.device("cpu"), 64)
    names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    layers = [[layer.get_submodule(n).weight.detach() for n in names] for layer in model.layers]
    head = model.lm_head.weight.detach()
    found = gguf_blocks.fused(gguf_blocks.read(loader.default_gguf_path(), spec), spec)
    blocks = [[found.get(f"layers.{i}.{n}") for n in names] for i in range(len(layers))]
    return layers, head, blocks, found.get("lm_head")


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1000


def main() -> None:
    from tokenloom.kernels.cpu import kernel_set

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--storages", nargs="+", default=list(STORAGES), choices=list(STORAGES))
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 256])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    gbs = read_bandwidth_gbs()
    print(f"read bandwidth {gbs:.1f} GB/s ({torch.get_num_threads()} threads)", flush=True)
    layers, head, blocks, head_blocks = model_weights()
    out = {"read_bandwidth_gbs": gbs, "threads": torch.get_num_threads(), "storages": {}}
    columns = ["storage", "kernel", "MB", *(f"{r} rows: ms (roofline)" for r in args.rows)]
    rows, best = [], {}
    print(f"{'storage':8} {'kernel':16} {'MB':>6} " + " ".join(f"{r:>12}" for r in args.rows))
    with torch.inference_mode():
        for name in args.storages:
            storage, act = STORAGES[name]
            head_storage = "q8" if storage == "q4" else storage
            sets = [kernel_set.KernelSet(w, None, storage, act, blocks=b if storage == "q4"
                                         else None)
                    for ws, bs in zip(layers, blocks) for w, b in zip(ws, bs)]
            hs = kernel_set.KernelSet(head, None, head_storage, act,
                                      blocks=head_blocks if storage == "q4" else None)
            res = out["storages"][name] = {}
            for kernel in sets[0].names:
                if kernel not in hs.names:
                    continue
                forms = ("qs", "d", "m") if storage in ("q4", "q8") else (
                    ("q", "scale") if storage == "int8" else ("w",))
                if kernel.startswith("copy") or kernel in ("mkl", "onednn"):
                    forms = ("w",)
                mb = sum(getattr(k, f).numel() * getattr(k, f).element_size()
                         for k in (*sets, hs) for f in forms
                         if getattr(k, f, None) is not None) / 1e6
                row = res[kernel] = {"mb": mb}
                cells = []
                for r in args.rows:
                    xs = {w.shape[1]: torch.randn(r, w.shape[1]).to(act)
                          for ws in layers[:1] for w in ws}
                    xs[head.shape[1]] = torch.randn(r, head.shape[1]).to(act)

                    calls = [(k, xs[k_in(k)]) for k in sets] + [(hs, xs[head.shape[1]])]

                    def step(calls=calls, kernel=kernel):
                        for k, x in calls:
                            k.run(kernel, x)
                    ms = best_ms(step, args.reps if r <= 16 else 2)
                    frac = mb / 1e3 / gbs / (ms / 1e3)
                    row[str(r)] = {"ms": ms, "roofline": frac}
                    cells.append(f"{ms:6.2f}/{frac:4.0%}")
                print(f"{name:8} {kernel:16} {mb:6.1f} " + " ".join(f"{c:>12}" for c in cells),
                      flush=True)
                rows.append([name, kernel, mb, *(f"{row[str(r)]['ms']:.2f} "
                                                 f"({row[str(r)]['roofline']:.0%})"
                                                 for r in args.rows)])
                first = row[str(args.rows[0])]["roofline"]
                if first > best.get(name, (None, 0))[1]:
                    best[name] = (kernel, first)
            sets = hs = None   # free this storage's forms before the next
    write_raw("gemv_kernels", out)
    # The headline: each storage's best kernel at the first row count, as a fraction of
    # the roofline (bytes / the read bandwidth measured in this run).
    summary = {name: {"best_kernel": kernel, f"roofline_{args.rows[0]}_rows": frac}
               for name, (kernel, frac) in best.items()}
    record_run("gemv_kernels", summary, {"columns": columns, "rows": rows}, args,
               bandwidth_gbs=gbs)


def k_in(k) -> int:
    """The input width of a KernelSet (its weight's or blocks' second dimension)."""
    for f in ("w", "q", "qs"):
        t = getattr(k, f, None)
        if t is not None:
            return t.shape[1] * (2 if f == "qs" and k.storage == "q4" else 1)
    return k.packed.shape[1]


if __name__ == "__main__":
    main()
