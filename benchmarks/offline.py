"""Offline engine benchmark: tokenloom vs transformers `generate`, side by side, same run.

    .venv/bin/python benchmarks/offline.py                 # fp32 and bf16, full workload
    .venv/bin/python benchmarks/offline.py --quick         # smaller workload, fp32 only

Scenarios (same prompts for both engines; greedy; EOS ignored so every request produces
exactly the requested number of tokens):
  prefill      one 1,024-token prompt, 1 output token           -> prompt tokens/s
  decode_b1    one 300-token prompt, 128 output tokens          -> decode tokens/s (after TTFT)
  batch_N      N in {1, 8, 32} prompts of 64-512 tokens, 128 output tokens each
               -> output tokens/s and total (prompt + output) tokens/s.
               transformers runs them as one static left-padded batch of N.
Also measured: read bandwidth and the weight-streaming roofline for batch-1 decode.
Prints a table with ratios (ours / transformers) and records it (benchmarks/records.py;
every row in benchmarks/raw/offline.json).
Timing is wall-clock on a shared machine: read ratios, not absolute numbers, and never run
another heavy job at the same time.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

from records import read_bandwidth_gbs, record_run, write_raw


def make_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Token ids from the ordinary-text range of the vocabulary.
    return [[rng.randint(200, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


class Ours:
    def __init__(self, model_dir: Path, dtype: str):
        from tokenloom import LLM
        self.llm = LLM(model=str(model_dir), dtype=dtype, device="cpu", quiet=True)
        self.backend = self.llm.engine.info.attention_backend

    def run(self, prompts, max_tokens):
        from tokenloom import SamplingParams
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        outs = self.llm.generate(prompts, sp)
        wall = time.perf_counter() - t
        assert all(len(o.token_ids) == max_tokens for o in outs)
        return wall, outs

    def decode_rate(self, prompt, max_tokens) -> float:
        _, outs = self.run([prompt], max_tokens)
        tt = outs[0].outputs[0].timings.token_times
        return (len(tt) - 1) / (tt[-1] - tt[0])

    def close(self):
        self.llm.close()


class Transformers:
    def __init__(self, model_dir: Path, dtype: str):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)).eval()

    @torch.no_grad()
    def run(self, prompts, max_tokens):
        n, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((n, width), 2, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding, as batched generation requires
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        t = time.perf_counter()
        self.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                            min_new_tokens=max_tokens, do_sample=False, pad_token_id=2)
        return time.perf_counter() - t

    def decode_rate(self, prompt, max_tokens) -> float:
        full = self.run([prompt], max_tokens)
        first = self.run([prompt], 1)
        return (max_tokens - 1) / (full - first)

    def close(self):
        del self.model


def bench_dtype(model_dir: Path, dtype: str, quick: bool, skip_hf: bool) -> list[dict]:
    out_tokens = 32 if quick else 128
    batches = (1, 8) if quick else (1, 8, 32)
    rows: list[dict] = []
    ours = Ours(model_dir, dtype)
    hf = None if skip_hf else Transformers(model_dir, dtype)
    warm = make_prompts(2, 16, 32, seed=1)
    ours.run(warm, 4)
    if hf:
        hf.run(warm[:1], 4)

    def row(name, unit, a, b, **extra):
        r = {"dtype": dtype, "scenario": name, "unit": unit, "tokenloom": a, "transformers": b,
             "ratio": (a / b) if b else None, **extra}
        rows.append(r)
        print(f"  {dtype:9s} {name:12s} {unit:18s} tokenloom {a:9.1f}   transformers "
              f"{b if b is not None else float('nan'):9.1f}   "
              f"ratio {r['ratio'] or float('nan'):5.2f}",
              flush=True)

    # Prefill of a 1,024-token prompt.
    prompt = make_prompts(1, 1024, 1024, seed=2)[0]
    w, _ = ours.run([prompt], 1)
    hw = hf.run([prompt], 1) if hf else None
    row("prefill_1024", "prompt tok/s", 1024 / w, 1024 / hw if hw else None)

    # Batch-1 decode at a 300-token context.
    prompt = make_prompts(1, 300, 300, seed=3)[0]
    row("decode_b1", "decode tok/s", ours.decode_rate(prompt, out_tokens),
        hf.decode_rate(prompt, out_tokens) if hf else None, context=300)

    # Mixed-length batches.
    for n in batches:
        prompts = make_prompts(n, 64, 512, seed=10 + n)
        total_in = sum(len(p) for p in prompts)
        w, _ = ours.run(prompts, out_tokens)
        hw = hf.run(prompts, out_tokens) if hf else None
        row(f"batch_{n}", "output tok/s", n * out_tokens / w,
            n * out_tokens / hw if hw else None, prompt_tokens=total_in)
        row(f"batch_{n}", "total tok/s", (total_in + n * out_tokens) / w,
            (total_in + n * out_tokens) / hw if hw else None)
    backend = ours.backend
    ours.close()
    if hf:
        hf.close()
    for r in rows:
        r["attention_backend"] = backend
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtypes", nargs="+", default=None, choices=["float32", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter scenarios")
    ap.add_argument("--skip-hf", action="store_true", help="tokenloom only")
    args = ap.parse_args(argv)
    dtypes = args.dtypes or (["float32"] if args.quick else ["float32", "bfloat16"])

    from tokenloom.config.schema import ModelConfig, resolve_cache_dir
    from tokenloom.kernels.models.loader import load_spec, resolve_model_dir
    model_dir = resolve_model_dir(args.model, resolve_cache_dir(ModelConfig()))
    spec = load_spec(model_dir)
    bw = read_bandwidth_gbs()
    print(f"model {model_dir.name}; torch threads {torch.get_num_threads()}; "
          f"read bandwidth {bw:.1f} GB/s")
    from safetensors import safe_open
    n_params = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                n_params += _numel(sf.get_slice(k).get_shape())
    lm_head = 0 if not spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size
    rows: list[dict] = []
    rooflines = {}
    for dtype in dtypes:
        elem = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
        # Per decode step every weight is read once (the tied LM head counts again).
        bytes_per_step = (n_params + lm_head) * elem
        rooflines[dtype] = {"weight_bytes_per_step": bytes_per_step,
                            "max_b1_decode_tok_s": bw * 1e9 / bytes_per_step}
        print(f"{dtype}: weights read per decode step {bytes_per_step / 2**20:.0f} MiB -> "
              f"roofline {rooflines[dtype]['max_b1_decode_tok_s']:.1f} tok/s at batch 1")
        rows += bench_dtype(model_dir, dtype, args.quick, args.skip_hf)

    print("\n| dtype | scenario | unit | tokenloom | transformers | ratio |")
    print("|---|---|---|---:|---:|---:|")
    for r in rows:
        hf = f"{r['transformers']:.1f}" if r["transformers"] else "-"
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        print(f"| {r['dtype']} | {r['scenario']} | {r['unit']} | {r['tokenloom']:.1f} | {hf} "
              f"| {ratio} |")
    scale = {}
    for dtype in dtypes:
        by = {(r["scenario"], r["unit"]): r["tokenloom"] for r in rows if r["dtype"] == dtype}
        if ("batch_32", "output tok/s") in by:
            scale[dtype] = by[("batch_32", "output tok/s")] / by[("decode_b1", "decode tok/s")]
            print(f"{dtype}: our 32-request output rate / our batch-1 decode rate = "
                  f"{scale[dtype]:.2f}x")
    write_raw("offline", {"read_bandwidth_gbs": bw, "rooflines": rooflines, "rows": rows,
                          "scaling_32_vs_1": scale, "argv": sys.argv[1:]})
    columns = ["dtype", "scenario", "unit", "tokenloom", "transformers", "ratio"]
    table = [[r["dtype"], r["scenario"], r["unit"], r["tokenloom"], r["transformers"],
              r["ratio"]] for r in rows]
    summary = {dtype: {f"{r['scenario']}_{r['unit'].split()[0]}": r["ratio"]
                       for r in rows if r["dtype"] == dtype and r["ratio"]} for dtype in dtypes}
    for dtype, x in scale.items():   # ours alone: 32 requests' output rate / batch-1 decode
        summary[dtype]["batch_32_over_decode_b1"] = x
    record_run("offline", summary, {"columns": columns, "rows": table}, args, bandwidth_gbs=bw)
    return 0


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    sys.exit(main())
