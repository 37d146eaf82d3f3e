"""What the hybrid KV layout buys a sliding-window model: sequences held at once in the same
KV pool, and the decode step at that batch, against one block table keeping every layer's
whole context (`cache.hybrid_kv = false`), side by side in one run.

The model is Gemma-3-shaped and scaled down to fit: 12 layers at Gemma 3's 5 local : 1
global, a 1,024-token window, GQA 4 : 2 heads of 64, random weights (a tiny word-level
vocabulary; what is measured is KV and attention, not the head). For each context (4k, 16k)
the pool's bytes are the same for both layouts: room for `--fit` sequences of that context
in the one-table layout. N requests (a few more than the layout's arithmetic capacity) of
`context - max_tokens` token-id prompts arrive at once, each decoding `max_tokens` tokens,
enough that every request admitted is still decoding when the last admitted one finishes
its prefill (prefill chunks of 2,048 tokens; decodes go on every step). Measured per layout:

- held at once: the most requests between their first scheduling and their end at the same
  time (their timings count from arrival, and all arrive together), and the preemptions
  (a layout short of blocks would preempt);
- decode step: the median time between tokens over the steps after the last admitted
  prefill, while all of those requests decode (the batch they make), and tokens/s there.

The ratios (hybrid / one table) are the summary.

    python benchmarks/hybrid_kv.py                 # 4k and 16k
    python benchmarks/hybrid_kv.py --quick         # 2k, smoke test
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

from harness import tests_module
from records import record_run, write_raw

WINDOW = 1024
BLOCK = 16
SHAPE = dict(num_hidden_layers=12, hidden_size=256, intermediate_size=1024,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             query_pre_attn_scalar=64, sliding_window=WINDOW, initializer_range=0.05,
             layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2)


def build_model(path: Path, max_positions: int) -> None:
    tiny = tests_module("tinymodel")
    tiny.build_tiny_model(path, "Gemma3TextConfig",
                          {**SHAPE, "max_position_embeddings": max_positions}, seed=3)


def kv_bytes_per_token_layer() -> int:
    return 2 * SHAPE["num_key_value_heads"] * SHAPE["head_dim"] * 4   # K and V, fp32


def blocks_per_sequence(context: int, hybrid: bool) -> int:
    """Layer-blocks one sequence holds at `context` tokens (pool bytes = this x block)."""
    from tokenloom.actors.kv.groups import KVGroups

    windows = [WINDOW if t == "sliding_attention" else None for t in SHAPE["layer_types"]]
    groups = KVGroups.plan(windows) if hybrid else KVGroups.single(len(windows))
    return groups.num_slots * groups.blocks_for(context, context - 1, BLOCK)


def held_at_once(outputs) -> int:
    events = []
    for o in outputs:
        t = o.outputs[0].timings
        events += [(t.queued, 1), (t.e2e, -1)]
    held = peak = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        held += d
        peak = max(peak, held)
    return peak


def decode_steps(outputs) -> tuple[float, int]:
    """Median seconds between tokens once the last request has its first token, counting
    only the steps while every request still decodes; and that batch."""
    timings = [o.outputs[0].timings for o in outputs]
    start = max(t.first_token for t in timings)
    end = min(t.e2e for t in timings)
    # every request's token times inside (start, end]: one per step each
    times = sorted(x for x in timings[0].token_times if start < x <= end)
    gaps = [b - a for a, b in zip(times, times[1:])]
    if not gaps:   # the requests did not overlap (run with more max_tokens)
        return math.nan, 0
    alive = sum(1 for t in timings if t.e2e >= end)
    return statistics.median(gaps), alive


def run_layout(model: Path, cache_dir: str, context: int, hybrid: bool, pool_bytes: int,
               requests: int, max_tokens: int) -> dict:
    from tokenloom import LLM, SamplingParams

    llm = LLM(model=str(model), quiet=True, device="cpu", dtype="float32", cache_dir=cache_dir,
              block_size=BLOCK, kv_cache_memory_bytes=pool_bytes, max_num_seqs=256,
              max_num_batched_tokens=2048, chunking="static", enable_prefix_caching=False,
              max_model_len=context, **{"cache.hybrid_kv": hybrid})
    try:
        prompts = [[3 + (i * 7919 + j * 31) % 250 for j in range(context - max_tokens)]
                   for i in range(requests)]
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        seconds = time.perf_counter() - t0
        stats = llm.scheduler_stats()
        kv = llm.kv_stats()
        llm.check_integrity()
    finally:
        llm.close()
    # the requests admitted first, together: those decoding when the last of them started
    first = sorted(outs, key=lambda o: o.outputs[0].timings.queued)
    held = held_at_once(outs)
    step, batch = decode_steps(first[:held])
    return {"held": held, "preemptions": stats.num_preemptions, "num_blocks": kv.num_blocks,
            "step_ms": step * 1000, "batch": batch,
            "tokens_per_s": batch / step if step == step and step > 0 else math.nan,
            "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--fit", type=float, default=2.5,
                    help="one-table sequences the pool holds at each context")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.contexts = [2048]
    per_token = kv_bytes_per_token_layer() * BLOCK
    rows, summary, raw = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "gemma3-shaped"
        build_model(model, max(args.contexts) + 64)
        for context in args.contexts:
            pool = int(args.fit * blocks_per_sequence(context, False) * per_token)
            result = {}
            for label, hybrid in (("one table", False), ("hybrid", True)):
                expect = args.fit * blocks_per_sequence(context, False) \
                    / blocks_per_sequence(context, hybrid)
                requests = int(expect) + 2
                max_tokens = 8 * requests + 24   # prefill of 2,048-token chunks: 1 token a step
                print(f"context {context}, {label}: {requests} requests, "
                      f"~{expect:.1f} expected to fit", flush=True)
                result[label] = run_layout(model, tmp, context, hybrid, pool + 2 * per_token,
                                           requests, max_tokens)
                r = result[label]
                print(f"  held {r['held']} at once, {r['preemptions']} preemptions, decode "
                      f"step {r['step_ms']:.1f} ms at batch {r['batch']} "
                      f"({r['tokens_per_s']:.0f} tok/s), {r['seconds']:.0f} s", flush=True)
            one, hyb = result["one table"], result["hybrid"]
            ratio = hyb["held"] / one["held"] if one["held"] else math.nan
            tput = hyb["tokens_per_s"] / one["tokens_per_s"]
            summary[f"held_ratio_{context}"] = ratio
            summary[f"decode_tokens_per_s_ratio_{context}"] = tput
            for label, r in result.items():
                rows.append([context, label, r["held"], r["preemptions"], r["batch"],
                             r["step_ms"], r["tokens_per_s"]])
            rows.append([context, "hybrid / one table", ratio, "", "",
                         hyb["step_ms"] / one["step_ms"], tput])
            raw[context] = result
            print(f"context {context}: hybrid holds {ratio:.2f}x the sequences; decode "
                  f"tokens/s {tput:.2f}x", flush=True)
    columns = ["context", "layout", "held at once", "preemptions", "decode batch",
               "decode step ms", "decode tok/s"]
    write_raw("hybrid_kv", raw)
    record_run("hybrid_kv", summary, {"columns": columns, "rows": rows}, args,
               smoke=args.quick)


if __name__ == "__main__":
    main()
