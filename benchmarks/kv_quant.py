"""KV-cache quantization on the default model: what each `cache.kv_dtype` costs and saves,
every figure against the model-dtype cache measured in the same run (the 1-byte formats
with their default rotation; bf16 and fp16 as two bytes under the fp32 model, unrotated).

    python benchmarks/kv_quant.py [--quick] [--json out.json] [--md out.md]
                                  [--parts quality,capacity,decode,kernel,check,peer]

The table (and --md) is the run's record (benchmarks/records.py); every figure goes to
benchmarks/raw/kv_quant.json (and to --json).

1. quality: per mode, teacher-forced over the start-up gate's texts: greedy agreement, mean
   and p99 KL against the model-dtype cache, perplexity and its change (the gate's own
   measure, kernels/models/kv_quality_gate.py); with llama.cpp's `llama-perplexity` on the
   same passage with -ctk/-ctv f16 (its default) and q8_0, when shared/peers built it.
2. capacity: bytes per token, blocks in a 1 GiB pool and how many 1,024-token sequences
   fit (the runtime check's reserve for one promotable layer included, as `make serve`
   would size it).
3. decode: one decode step of 16 sequences at 1,024 and 4,096 tokens of context (K/V
   reads dominate there), the C++ kernels, median of --steps: tokens/s and the ratio to
   the model-dtype cache.
4. kernel: decode attention alone, 16 x 1,024, the modes interleaved round by round.
5. check: the runtime quality check on every decode step of a clean run (alarms: the
   false-alarm rate) and with a wrong K scale injected into one layer (steps until it is
   caught at the default fraction).
6. peer (not in the default parts: see docs/kv-quantization.md): 16 streams over HTTP
   with 1,024-token prompts and 64 output tokens, same load
   generator, one server at a time: tokenloom fp32 with the fp32 / int8 cache against
   llama-server (F32 GGUF, flash attention on) with -ctk/-ctv f16 and q8_0; decode speed
   as 16 / ITL p50. Needs shared/peers/build-llama-server.sh.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness import (
    PEERS,
    VOCAB_HI,
    VOCAB_LO,
    PeerStream,
    resolve_dir,
    run_async,
    run_load,
    start_llama_server,
    start_tokenloom,
    summarise,
)
from records import record_run, write_raw

MODES = ["auto", "bf16", "fp16", "int8", "fp8_e4m3", "fp8_e5m2"]
HALF = ("bf16", "fp16")   # 2-byte caches: no scales, no rotation, no runtime check


def load(max_positions: int):
    from tokenloom.kernels.models.loader import load_model
    model, spec = load_model(Path(resolve_dir("default")), torch.float32, torch.device("cpu"),
                             max_positions=max_positions)
    return model, spec


def fmt(mode):
    from tokenloom.kernels.kv_quant import kv_format
    return kv_format(mode)


def storage(mode) -> torch.dtype:
    """The pool dtype a mode allocates under the fp32 model (a 1-byte format: fp32, its
    QuantizedCaches hold the bytes)."""
    from tokenloom.kernels.kv_quant import HALF_DTYPES
    return HALF_DTYPES.get(mode, torch.float32)


def part_quality(model, tokenizer, out: dict) -> None:
    from tokenloom.kernels.models import kv_quality_gate as g
    from tokenloom.kernels.models.quality_gate import HELD_OUT_TEXT
    from tokenloom.kernels.models.weights import held_out_ids

    gate_ids = held_out_ids(tokenizer, model.spec.vocab_size, 256)
    ppl_ids = list(tokenizer(g.PERPLEXITY_TEXT)["input_ids"])[:256]
    from tokenloom.kernels.kv_quant import hadamard
    rows = {}
    for mode in MODES[1:]:
        for rotation in ("none",) if mode in HALF else ("none", "hadamard"):
            model.set_kv_rotation(hadamard(model.spec.head_dim, torch.float32, "cpu")
                                  if rotation == "hadamard" else None)
            name = mode if rotation == "none" else f"{mode}+hadamard"
            r = g.measure(model, gate_ids, ppl_ids, fmt(mode), fmt(mode), name,
                          storage(mode) if mode in HALF else None)
            rows[name] = {"agreement": r.agreement, "mean_kl": r.mean_kl, "p99_kl": r.p99_kl,
                          "ppl": r.ppl_quantized, "ppl_reference": r.ppl_reference,
                          "ppl_change": r.ppl_increase, "passed": r.passed}
            print(f"quality {name}: {r.summary()}", flush=True)
    model.set_kv_rotation(None)
    out["quality"] = rows
    ppl = PEERS / "llama-perplexity"
    if not ppl.exists():
        out["quality_llama_cpp"] = "llama-perplexity not built (shared/peers)"
        return
    text = Path(tempfile.mkstemp(suffix=".txt")[1])
    text.write_text(HELD_OUT_TEXT + "\n\n" + g.PERPLEXITY_TEXT)
    peer = {}
    for cache in ("f16", "q8_0"):
        cmd = [str(ppl), "-m", str(PEERS / "SmolLM2-135M-Instruct.F32.gguf"), "-f", str(text),
               "-c", "128", "-b", "128", "-t", "2", "-fa", "on", "-ctk", cache, "-ctv", cache]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        final = [ln for ln in res.stderr.splitlines() + res.stdout.splitlines()
                 if "Final estimate: PPL" in ln]
        peer[cache] = float(final[-1].split("=")[1].split("+/-")[0]) if final else None
        print(f"llama.cpp perplexity, cache {cache}: {peer[cache]}", flush=True)
    if peer.get("f16") and peer.get("q8_0"):
        peer["q8_0_change"] = peer["q8_0"] / peer["f16"] - 1
    out["quality_llama_cpp"] = peer


def part_capacity(spec, out: dict) -> None:
    from tokenloom.actors.engine import kv_block_bytes
    from tokenloom.config.load import load_config

    rows = {}
    for mode in MODES:
        cfg = load_config(overrides={"cache.kv_dtype": mode}, env=None)
        per_block, per_token = kv_block_bytes(cfg, spec, torch.float32)
        blocks = (1 << 30) // per_block
        rows[mode] = {"bytes_per_token": per_token, "budget_bytes_per_block": per_block,
                      "blocks_1gib": blocks, "seqs_1k": blocks * 16 // 1024}
    base = rows["auto"]["seqs_1k"]
    for mode, r in rows.items():
        r["capacity_ratio"] = r["seqs_1k"] / base
        print(f"capacity {mode}: {r['bytes_per_token']} bytes/token, {r['seqs_1k']} sequences "
              f"of 1,024 tokens in 1 GiB ({r['capacity_ratio']:.2f}x)", flush=True)
    out["capacity"] = rows


def decode_step_seconds(model, spec, mode: str, ctx: int, batch: int, steps: int) -> float:
    from tokenloom.kernels.forward_context import AttentionMetadata
    from tokenloom.kernels.kv_store import KVCache, store_kv

    bs = 16
    per_seq = ctx // bs + 1
    kv = KVCache.allocate(spec.num_layers, batch * per_seq, bs, spec.num_kv_heads,
                          spec.head_dim, storage(mode), "cpu", fmt(mode), fmt(mode))
    g = torch.Generator().manual_seed(0)
    n = batch * per_seq * bs
    for layer in range(spec.num_layers):
        for start in range(0, n, 8192):   # realistic magnitudes: an outlier channel in K
            m = min(8192, n - start)
            k = torch.randn(m, spec.num_kv_heads, spec.head_dim, generator=g)
            k[:, :, 7] *= 10
            store_kv(k, torch.randn(m, spec.num_kv_heads, spec.head_dim, generator=g),
                     kv.key[layer], kv.value[layer], torch.arange(start, start + m))
    tables = torch.arange(batch * per_seq).view(batch, per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int64)
    slots = tables[:, (ctx - 1) // bs] * bs + (ctx - 1) % bs
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=batch, decode_block_tables=tables,
                             decode_context_lens=lens, decode_max_context=ctx, prefills=[])
    ids = torch.randint(VOCAB_LO, VOCAB_HI, (batch,))
    pos = lens - 1
    rows = torch.arange(batch)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        model(ids, pos, kv, meta, rows)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def part_decode(model, spec, out: dict, steps: int, contexts: list[int]) -> None:
    from tokenloom.kernels.cpu.attention import load_cpu_decode_kernel, paged_decode_cpu
    from tokenloom.kernels.kv_quant import hadamard
    if load_cpu_decode_kernel() is not None:
        model.set_decode_kernel(paged_decode_cpu)
    rows = {}
    for ctx in contexts:
        base = None
        for mode in MODES:
            # As served by default: a quantized cache with its rotation.
            model.set_kv_rotation(None if mode == "auto" or mode in HALF else
                                  hadamard(spec.head_dim, torch.float32, "cpu"))
            s = decode_step_seconds(model, spec, mode, ctx, 16, steps)
            base = base or s
            rows[f"{mode}@{ctx}"] = {"step_ms": s * 1e3, "tokens_per_s": 16 / s,
                                     "speed_ratio": base / s}
            print(f"decode 16 x {ctx} {mode}: {s * 1e3:.1f} ms/step, {16 / s:.0f} tok/s "
                  f"({base / s:.2f}x the fp32 cache)", flush=True)
    model.set_kv_rotation(None)
    out["decode"] = rows


def part_kernel(spec, out: dict, rounds: int) -> None:
    """Decode attention alone (the C++ kernel, 16 x 1,024, 8 layers a call), the modes
    interleaved round by round so that the machine's drift hits them all alike."""
    from tokenloom.kernels.cpu.attention import load_cpu_decode_kernel, paged_decode_cpu
    from tokenloom.kernels.kv_store import KVCache, store_kv
    if load_cpu_decode_kernel() is None:
        out["kernel"] = "the C++ kernel did not build"
        return
    batch, ctx, bs, layers = 16, 1024, 16, 8
    per = ctx // bs
    kvh, d = spec.num_kv_heads, spec.head_dim
    caches = {}
    for mode in MODES:
        kv = KVCache.allocate(layers, batch * per, bs, kvh, d, storage(mode), "cpu", fmt(mode),
                              fmt(mode))
        n = batch * per * bs
        for layer in range(layers):
            store_kv(torch.randn(n, kvh, d), torch.randn(n, kvh, d), kv.key[layer],
                     kv.value[layer], torch.arange(n))
        caches[mode] = kv
    tables = torch.arange(batch * per).view(batch, per)
    lens = torch.full((batch,), ctx)
    q = torch.randn(batch, spec.num_heads, d)
    times = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode, kv in caches.items():
            t0 = time.perf_counter()
            for layer in range(layers):
                paged_decode_cpu(q, kv.key[layer], kv.value[layer], tables, lens, ctx, 0.125)
            times[mode].append((time.perf_counter() - t0) / layers)
    base = statistics.median(times["auto"])
    rows = {}
    for mode, ts in times.items():
        m = statistics.median(ts)
        kv_bytes = batch * ctx * 2 * kvh * (d * 4 if mode == "auto" else
                                            d * 2 if mode in HALF else d + 4)
        rows[mode] = {"ms_per_layer": m * 1e3, "speed_ratio": base / m,
                      "gb_per_s": kv_bytes / m / 1e9}
        print(f"kernel 16 x {ctx} {mode}: {m * 1e3:.2f} ms a layer ({base / m:.2f}x fp32, "
              f"{kv_bytes / m / 1e9:.1f} GB/s of KV)", flush=True)
    out["kernel"] = rows


def part_check(out: dict, quick: bool) -> None:
    from tokenloom import LLM, SamplingParams
    from tokenloom.kernels import kv_quant

    prompts = [[VOCAB_LO + (i * 37 + k * 11) % (VOCAB_HI - VOCAB_LO) for k in range(64 + 8 * i)]
               for i in range(8)]
    tokens = 64 if quick else 256
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=tokens, ignore_eos=True)
    res = {}
    for mode in ("int8", "fp8_e4m3"):
        with LLM(model=resolve_dir("default"), quiet=True, device="cpu", dtype="float32",
                 kv_dtype=mode, kv_check_fraction=1.0) as llm:
            llm.generate(prompts, sp)
            s = llm.engine.runner.model_runner.kv_check.stats
            res[f"clean_{mode}"] = {"checked_steps": s.checks, "layer_comparisons": s.layer_checks,
                                    "alarms": s.alarms, "max_kl": s.max_kl,
                                    "max_error": s.max_error}
            print(f"check clean {mode}: {s.checks} steps x {s.layer_checks // max(1, s.checks)} "
                  f"layers compared, {s.alarms} alarms (max KL {s.max_kl:.4f}, max error "
                  f"{s.max_error:.3f})", flush=True)
    store = kv_quant.quantize_into

    def faulty(cache, x, slots):
        store(cache, x, slots)
        if getattr(cache, "faulty", False):
            cache.scale.view(-1, cache.scale.shape[-1])[slots] *= 1.25
    kv_quant.quantize_into = faulty
    try:
        caught = []
        for seed in range(3 if quick else 5):
            with LLM(model=resolve_dir("default"), quiet=True, device="cpu", dtype="float32",
                     kv_dtype="int8", seed=seed) as llm:
                llm.engine.kv.key[7].faulty = True
                llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=120,
                                                         ignore_eos=True))
                s = llm.engine.runner.model_runner.kv_check.stats
                caught.append({"first_alarm_step": s.first_alarm_step,
                               "promoted": list(s.promoted), "steps": s.steps})
                print(f"check injected (layer 7 K scale x1.25, fraction "
                      f"{llm.engine.config.cache.kv_check_fraction}): caught at decode step "
                      f"{s.first_alarm_step}, promoted {list(s.promoted)}", flush=True)
    finally:
        kv_quant.quantize_into = store
    res["injected"] = caught
    out["check"] = res


def part_peer(out: dict, quick: bool) -> None:
    binary = PEERS / "llama-server"
    gguf = PEERS / "SmolLM2-135M-Instruct.F32.gguf"
    if not binary.exists() or not gguf.exists():
        out["peer"] = "llama-server not built (shared/peers/build-llama-server.sh)"
        print(out["peer"])
        return
    import random
    rng = random.Random(0)
    n = 16 if quick else 32
    prompts = [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(1024)] for _ in range(n)]
    rows = {}
    logdir = Path(tempfile.mkdtemp())

    def measure(name, server, tokenloom):
        try:
            protocol = None if tokenloom else PeerStream
            run_async(run_load(server.url, "m", prompts[:4], 8, 4, 0, 0, tokenloom, protocol))
            res, elapsed = run_async(run_load(server.url, "m", prompts, 64, 16, 0, 1, tokenloom,
                                              protocol))
            s = summarise(res, elapsed)
            itl = s["itl_ms"]["p50"]
            rows[name] = {"itl_p50_ms": itl, "itl_p99_ms": s["itl_ms"]["p99"],
                          "decode_tok_s": 16 / itl * 1e3, "output_tok_s": s["output_tokens_per_s"],
                          "ttft_p50_ms": s["ttft_ms"]["p50"], "errors": s["errors"]}
            print(f"peer {name}: ITL p50 {itl:.1f} ms -> {16 / itl * 1e3:.0f} decode tok/s, "
                  f"{s['output_tokens_per_s']:.0f} output tok/s", flush=True)
        finally:
            server.stop()

    for mode in ("auto", "int8"):
        server = start_tokenloom(resolve_dir("default"), [
            "model.dtype=float32", "model.num_threads=2", f"cache.kv_dtype={mode}",
            "cache.enable_prefix_caching=false", "server.served_model_name=m"])
        measure(f"tokenloom_{mode}", server, True)
    for cache in ("f16", "q8_0"):
        server = start_llama_server(binary, gguf, 16, 16 * 1200, 2, logdir / f"{cache}.log",
                                    ("-fa", "on", "-ctk", cache, "-ctv", cache))
        measure(f"llama_{cache}", server, False)
    for name in ("int8",):
        rows[f"tokenloom_{name}"]["vs_llama_q8_0"] = (
            rows[f"tokenloom_{name}"]["decode_tok_s"] / rows["llama_q8_0"]["decode_tok_s"])
    rows["tokenloom_auto"]["vs_llama_f16"] = (
        rows["tokenloom_auto"]["decode_tok_s"] / rows["llama_f16"]["decode_tok_s"])
    out["peer"] = rows


COLUMNS = ["mode", "bytes/token", "1k-token seqs in 1 GiB", "agreement", "mean KL",
           "perplexity change", "decode 16x1k tok/s", "decode 16x4k tok/s"]


def table_rows(out: dict) -> list[list[str]]:
    rows = []
    for mode in MODES:
        cap = out.get("capacity", {}).get(mode, {})
        q = out.get("quality", {}).get(mode if mode == "auto" or mode in HALF
                                       else f"{mode}+hadamard", {})
        d1 = out.get("decode", {}).get(f"{mode}@1024", {})
        d4 = out.get("decode", {}).get(f"{mode}@4096", {})

        def cell(d):
            return f"{d['tokens_per_s']:.0f} ({d['speed_ratio']:.2f}x)" if d else "-"
        rows.append([mode, str(cap.get("bytes_per_token", "-")),
                     f"{cap.get('seqs_1k', '-')} ({cap.get('capacity_ratio', 0):.2f}x)",
                     f"{q.get('agreement', 1.0):.3f}", f"{q.get('mean_kl', 0.0):.5f}",
                     f"{100 * q.get('ppl_change', 0.0):+.2f}%", cell(d1), cell(d4)])
    return rows


def markdown(out: dict) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(out)]
    return "\n".join(lines) + "\n"


def summary(out: dict) -> dict:
    """Per mode: capacity and decode speed (16 x 1k) against the model-dtype cache, and the
    mean KL of its quality."""
    res = {}
    for mode in MODES[1:]:
        q = out.get("quality", {}).get(mode if mode in HALF else f"{mode}+hadamard", {})
        res[mode] = {k: v for k, v in (
            ("capacity_x", out.get("capacity", {}).get(mode, {}).get("capacity_ratio")),
            ("decode_1k_x", out.get("decode", {}).get(f"{mode}@1024", {}).get("speed_ratio")),
            ("mean_kl", q.get("mean_kl"))) if v is not None}
    res = {mode: d for mode, d in res.items() if d}
    peer = out.get("peer")
    if isinstance(peer, dict):   # decode speed against llama-server, same-size caches
        res["vs_llama"] = {"fp32_vs_f16": peer["tokenloom_auto"]["vs_llama_f16"],
                           "int8_vs_q8_0": peer["tokenloom_int8"]["vs_llama_q8_0"]}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", default="quality,capacity,decode,kernel,check")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    out: dict = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    from transformers import AutoTokenizer
    model, spec = load(4200)
    if "quality" in parts:
        part_quality(model, AutoTokenizer.from_pretrained(resolve_dir("default")), out)
    if "capacity" in parts:
        part_capacity(spec, out)
    if "decode" in parts:
        part_decode(model, spec, out, 2 if args.quick else args.steps,
                    [256] if args.quick else [1024, 4096])
    if "kernel" in parts:
        part_kernel(spec, out, 3 if args.quick else 15)
    del model
    if "check" in parts:
        part_check(out, args.quick)
    if "peer" in parts:
        part_peer(out, args.quick)
    table = markdown(out)
    print("\n" + table)
    write_raw("kv_quant", out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if args.md:
        Path(args.md).write_text(table)
    record_run("kv_quant", summary(out), {"columns": COLUMNS, "rows": table_rows(out)}, args,
               smoke=args.quick)


if __name__ == "__main__":
    sys.exit(main())
