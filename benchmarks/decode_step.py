"""Where a batch-1 CPU decode step's time goes: the module forward against the C++ decode
stack (kernels/cpu/decode_stack.py), side by side, and the share of the step that is not
the projections.

For each weight mode, the default model is loaded by the offline engine exactly as it
serves (same kernels per row count), one decode step at ~300 and ~1,100 tokens of context
is captured from a real request, and the engine is closed (its compute thread would hold
the cores). Then, in interleaved rounds on this thread:

- module: the eager forward with one Python call per op (decode stacks off);
- stack: the same step through the C++ stack;
- projections: every projection of the step called alone at one row (all layers' q/k/v,
  o, gate/up and down and the LM head), the floor the rest of the step sits on;

each including the LM head's row. The non-projection share is 1 - projections / step.
Medians over rounds; the spread (max/min over rounds) is printed beside each figure.

`--kv-dtypes auto fp16` loads each mode once per KV cache dtype (cache.kv_dtype) and
interleaves their rounds, printing each one's stack step over the first's (a ratio from
the same rounds, as this machine's bandwidth drifts between them).

    python benchmarks/decode_step.py                      # fp32 and q4, 7 rounds
    python benchmarks/decode_step.py --modes q4 --rounds 3
    python benchmarks/decode_step.py --modes q4 q8 --kv-dtypes auto fp16
"""

from __future__ import annotations

import argparse
import statistics

import torch

from harness import ms_per_call
from records import record_run, write_raw

MODES = {
    "fp32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "q4": dict(dtype="float32", weight_dtype="q4"),
    "q8": dict(dtype="float32", weight_dtype="q8"),
    "int8": dict(dtype="float32", weight_dtype="int8"),
}
CONTEXTS = (300, 1100)


def capture_steps(options: dict) -> tuple[object, dict[int, tuple]]:
    """The engine's model and one real decode step's inputs per context length."""
    from tokenloom import LLM, SamplingParams
    from tokenloom.kernels.models import decoder

    captured: dict = {}
    original = decoder.CausalLM.forward_hidden

    def spy(self, input_ids, positions, kv, meta):
        if input_ids.shape[0] == 1 and not meta.prefills:
            captured["model"] = self
            captured["last"] = (input_ids.clone(), positions.clone(), kv, meta)
        return original(self, input_ids, positions, kv, meta)

    decoder.CausalLM.forward_hidden = spy
    steps = {}
    try:
        llm = LLM(device="cpu", quiet=True, enable_prefix_caching=False, chunking="static",
                  max_num_batched_tokens=2048, **options)
        sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        try:
            for ctx in CONTEXTS:
                llm.generate([[1000 + i % 3000 for i in range(ctx - 4)]], sp)
                steps[ctx] = captured["last"]
        finally:
            llm.close()
    finally:
        decoder.CausalLM.forward_hidden = original
    return captured["model"], steps


def measure(variants: dict, rounds: int, n: int) -> dict:
    """{label: (model, steps)} -> {label: {ctx: row}}, the variants' rounds interleaved."""
    timers = {label: _timers(model, steps, n) for label, (model, steps) in variants.items()}
    out: dict = {label: {} for label in variants}
    with torch.inference_mode():
        for ctx in CONTEXTS:
            runs = {label: {"module": [], "stack": [], "projections": []} for label in variants}
            for _ in range(rounds):
                for label, timer in timers.items():
                    timer(ctx, runs[label])
            for label in variants:
                out[label][ctx] = _row(runs[label])
    return out


def _row(runs: dict[str, list[float]]) -> dict:
    row = {k: statistics.median(v) for k, v in runs.items() if v}
    row["spread"] = {k: round(max(v) / min(v), 2) for k, v in runs.items() if v}
    for k in ("module", "stack"):
        if k in row:
            row[f"{k}_non_projection_share"] = 1 - row["projections"] / row[k]
    if "stack" in row:
        row["stack_speedup"] = row["module"] / row["stack"]
    return row


def _timers(model, steps: dict, n: int):
    """One round of a variant at one context: module, stack and projections timed."""
    stacks = model.decode_stacks
    head_row = torch.tensor([0])
    layers = model.layers
    names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    projections = [layer.get_submodule(name) for layer in layers for name in names]
    act = model.embed_tokens.weight.dtype   # the activations' dtype (bf16 models: bf16)
    xs = [torch.randn(1, p.in_features).to(act) for p in projections]
    hx = torch.randn(1, model.spec.hidden_size).to(act)

    def step(args):
        h = model.forward_hidden(*args)
        return model.logits(h, head_row)

    def projections_only():
        for p, x in zip(projections, xs):
            p(x)
        model.lm_head(hx)

    def timer(ctx: int, runs: dict[str, list[float]]) -> None:
        args = steps[ctx]
        model.decode_stacks = None
        runs["module"].append(ms_per_call(lambda: step(args), n))
        model.decode_stacks = stacks
        if stacks is not None:
            before = stacks.steps
            runs["stack"].append(ms_per_call(lambda: step(args), n))
            assert stacks.steps > before, "the stack did not serve the step"
        runs["projections"].append(ms_per_call(projections_only, n))

    return timer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["fp32", "q4"], choices=list(MODES))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kv-dtypes", nargs="+", default=["auto"],
                    choices=["auto", "bf16", "fp16", "int8", "fp8_e4m3", "fp8_e5m2"],
                    help="cache.kv_dtype values, interleaved (the first is the baseline)")
    ap.add_argument("--steps", type=int, default=20, help="steps timed per round")
    args = ap.parse_args()
    results = {"threads": torch.get_num_threads()}
    columns = ["mode", "ctx", "module ms", "stack ms", "speedup", "proj ms",
               "non-proj (module)", "non-proj (stack)", "spread", "stack vs first kv dtype"]
    rows, summary = [], {"stack_speedup": {}, "stack_vs_first_kv_dtype": {}}
    print(f"{'mode':6s} {'ctx':>5s} {'module ms':>10s} {'stack ms':>9s} {'speedup':>8s} "
          f"{'proj ms':>8s} {'non-proj (module)':>18s} {'non-proj (stack)':>17s}  spread")
    for mode in args.modes:
        variants = {}
        for kv in args.kv_dtypes:
            label = mode if kv == "auto" else f"{mode}+kv_{kv}"
            variants[label] = capture_steps({**MODES[mode], "kv_dtype": kv})
        measured = measure(variants, args.rounds, args.steps)
        first = next(iter(measured))
        base = measured[first]
        for label, by_ctx in measured.items():
            results[label] = by_ctx
            for ctx, r in by_ctx.items():
                vs = ""
                if label != first and "stack" in r and "stack" in base[ctx]:
                    r["stack_vs_first_kv_dtype"] = base[ctx]["stack"] / r["stack"]
                    vs = f"  stack {r['stack_vs_first_kv_dtype']:.2f}x the first kv dtype"
                print(f"{label:6s} {ctx:5d} {r['module']:10.2f} "
                      f"{r.get('stack', float('nan')):9.2f} "
                      f"{r.get('stack_speedup', float('nan')):7.2f}x {r['projections']:8.2f} "
                      f"{r['module_non_projection_share']:17.0%} "
                      f"{r.get('stack_non_projection_share', float('nan')):16.0%}  {r['spread']}"
                      f"{vs}")
                rows.append([label, ctx, r["module"], r.get("stack"), r.get("stack_speedup"),
                             r["projections"], f"{r['module_non_projection_share']:.0%}",
                             f"{r['stack_non_projection_share']:.0%}"
                             if "stack_non_projection_share" in r else None,
                             " / ".join(f"{k} {v:.2f}" for k, v in r["spread"].items()),
                             r.get("stack_vs_first_kv_dtype")])
                for k in summary:
                    if k in r:
                        summary[k][f"{label}@{ctx}"] = r[k]
        del variants
    write_raw("decode_step", results)
    record_run("decode_step", summary, {"columns": columns, "rows": rows}, args)


if __name__ == "__main__":
    main()
