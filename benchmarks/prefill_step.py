"""Where a CPU prefill forward's time goes, and what each prefill kernel buys, side by side.

The default model is loaded by the offline engine exactly as it serves; one real prefill
step of a --tokens prompt is captured and the engine closed (its compute thread would hold
the cores). Then, in interleaved rounds on this thread, the same forward under:

- torch: torch's SDPA and the torch reference norms and SiLU*mul (the C++ kernels off);
- fp32 attention: the C++ layer ops, and the C++ attention in fp32 arithmetic (what bf16
  ran before the vdpbf16ps kernel; the same as `full` for an fp32 model);
- full: as the engine serves (bf16 models on an AVX512-BF16 CPU: the vdpbf16ps attention).

and, for `full`, the time of each part (projections, attention, norms, SiLU*mul, the rest)
and the minor page faults per forward. Each setting of the allocator (kernels/cpu/
allocator.py: glibc keeps freed memory, or glibc's defaults) runs in its own child process,
since it cannot be undone inside one. Medians over rounds, spread (max / min) beside them.
The table is the run's record (benchmarks/records.py); every figure goes to
benchmarks/raw/prefill_step.json.

    python benchmarks/prefill_step.py                    # bf16, 1,024 tokens, 5 rounds
    python benchmarks/prefill_step.py --mode fp32 --tokens 512
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from records import record_run, write_raw

MODES = {"bf16": dict(dtype="bfloat16"), "fp32": dict(dtype="float32")}
PARTS = {  # part: (attribute path from a layer, attribute)
    "qkv": ("self_attn.qkv_proj", "forward"), "o": ("self_attn.o_proj", "forward"),
    "gate_up": ("mlp.gate_up_proj", "forward"), "down": ("mlp.down_proj", "forward"),
    "attention": ("self_attn", "attend"), "silu_mul": ("mlp", "act_fn"),
}


def capture_prefill(options: dict, tokens: int):
    """The engine's model and the inputs of one real prefill step of `tokens` tokens."""
    from tokenloom import LLM, SamplingParams
    from tokenloom.kernels.models import decoder

    captured: dict = {}
    original = decoder.CausalLM.forward_hidden

    def spy(self, input_ids, positions, kv, meta):
        if input_ids.shape[0] == tokens:
            captured["model"] = self
            captured["args"] = (input_ids.clone(), positions.clone(), kv, meta)
        return original(self, input_ids, positions, kv, meta)

    decoder.CausalLM.forward_hidden = spy
    try:
        llm = LLM(device="cpu", quiet=True, enable_prefix_caching=False, chunking="static",
                  max_num_batched_tokens=max(2048, tokens), **options)
        try:
            prompt = [1000 + (i * 7919) % 30000 for i in range(tokens)]
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2,
                                                  ignore_eos=True))
        finally:
            llm.close()
    finally:
        decoder.CausalLM.forward_hidden = original
    return captured["model"], captured["args"]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class PartTimer:
    """Wall time per part of the forward, by wrapping the layers' callables (the engine's
    compute is sequential on this thread, so wall times add up). The C++ decode stack, which
    also serves prefill chunks, calls the same kernels without passing through those
    callables, so it is set aside while the parts are timed: the parts are the module
    path's (the Python between the kernels lands in "rest")."""

    def __init__(self, model):
        self.acc: dict[str, float] = collections.defaultdict(float)
        self.undo = []
        self.model, self.stacks = model, getattr(model, "decode_stacks", None)
        model.decode_stacks = None
        for layer in model.layers:
            for part, (path, attr) in PARTS.items():
                self._wrap(layer.get_submodule(path), attr, part)
        self._wrap(model, "add_norm_fn", "norms")

    def _wrap(self, obj, attr: str, part: str) -> None:
        fn = getattr(obj, attr)
        acc = self.acc

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[part] += time.perf_counter() - t
        object.__setattr__(obj, attr, timed)
        self.undo.append((obj, attr, fn))

    def remove(self) -> None:
        for obj, attr, fn in reversed(self.undo):
            object.__setattr__(obj, attr, fn)
        self.model.decode_stacks = self.stacks


def settings(model):
    """name -> a function that puts the model in that setting."""
    from tokenloom.kernels.cpu import layer_ops
    from tokenloom.kernels.cpu.attention import prefill_attention_cpu

    prefill_fn = model.layers[0].self_attn.prefill_fn
    fused = (model.add_norm_fn, model._norm_fn, [layer.mlp.act_fn for layer in model.layers])

    def fp32_attention(q, k, v, scale):
        return prefill_attention_cpu(q.float(), k.float(), v.float(), scale).to(q.dtype)

    def kernels(attention):
        def apply():
            model.set_fused_kernels(layer_ops.rms_norm_cpu, layer_ops.silu_mul_cpu, None)
            model.set_prefill_kernel(attention)
        return apply

    def torch_only():
        model.set_fused_kernels(None, None, None)
        model.set_prefill_kernel(None)

    def full():
        model.add_norm_fn, model._norm_fn = fused[0], fused[1]
        for layer, act in zip(model.layers, fused[2]):
            layer.mlp.act_fn = act
        model.set_prefill_kernel(prefill_fn)
    out = {"torch": torch_only, "full": full}
    if prefill_fn is not None:
        out["fp32 attention"] = kernels(fp32_attention)
    return out


def child(args) -> dict:
    """One allocator setting: every kernel setting timed in interleaved rounds."""
    model, inputs = capture_prefill(MODES[args.mode], args.tokens)
    modes = settings(model)
    times: dict[str, list[float]] = {name: [] for name in modes}
    faults: list[int] = []
    parts: dict[str, list[float]] = collections.defaultdict(list)
    with torch.inference_mode():
        for name, apply in modes.items():     # warm every setting once
            apply()
            model.forward_hidden(*inputs)
        for _ in range(args.rounds):
            for name, apply in modes.items():
                apply()
                f, t = _faults(), time.perf_counter()
                model.forward_hidden(*inputs)
                times[name].append((time.perf_counter() - t) * 1000)
                if name == "full":
                    faults.append(_faults() - f)
            modes["full"]()
            timer = PartTimer(model)
            t = time.perf_counter()
            model.forward_hidden(*inputs)
            total = time.perf_counter() - t
            timer.remove()
            for part, s in timer.acc.items():
                parts[part].append(s * 1000)
            parts["rest"].append((total - sum(timer.acc.values())) * 1000)
    return {"forward_ms": {k: statistics.median(v) for k, v in times.items()},
            "spread": {k: round(max(v) / min(v), 2) for k, v in times.items()},
            "full_parts_ms": {k: statistics.median(v) for k, v in parts.items()},
            "full_page_faults": statistics.median(faults)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="bf16", choices=list(MODES))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    results: dict = {"mode": args.mode, "tokens": args.tokens, "threads": torch.get_num_threads()}
    for allocator, env in (("kept", "1"), ("glibc default", "0")):
        cmd = [sys.executable, __file__, "--child", "--mode", args.mode, "--tokens",
               str(args.tokens), "--rounds", str(args.rounds)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                             env={**os.environ, "TOKENLOOM_KEEP_FREED_MEMORY": env})
        results[allocator] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["glibc default"]["forward_ms"]["torch"]
    print(f"{args.mode}, one {args.tokens}-token prefill forward, median of {args.rounds} "
          f"rounds (spread max/min); speedup against torch ops + glibc's allocator defaults")
    rows = []
    for allocator in ("glibc default", "kept"):
        r = results[allocator]
        for name, ms in r["forward_ms"].items():
            print(f"  allocator {allocator:13s} {name:15s} {ms:8.1f} ms ({r['spread'][name]:.2f})"
                  f"  {base / ms:5.2f}x")
            rows.append([allocator, name, ms, r["spread"][name], base / ms])
    for allocator in ("glibc default", "kept"):
        r = results[allocator]
        parts = ", ".join(f"{k} {v:.0f}" for k, v in r["full_parts_ms"].items())
        print(f"  full, allocator {allocator}: {r['full_page_faults']:.0f} page faults per "
              f"forward; parts (ms): {parts}")
    write_raw("prefill_step", results)
    columns = ["allocator", "kernels", "forward ms", "spread", "speedup vs torch + glibc"]
    summary = {f"{allocator}.{name}": speedup for allocator, name, _, _, speedup in rows
               if (allocator, name) != ("glibc default", "torch")}
    summary["full_page_faults"] = {a: results[a]["full_page_faults"]
                                   for a in ("glibc default", "kept")}
    record_run("prefill_step", summary, {"columns": columns, "rows": rows}, args)


if __name__ == "__main__":
    main()
