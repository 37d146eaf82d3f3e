"""Multi-LoRA serving on the default model: what adapters cost against the base model, every
figure against a baseline measured in the same run.

    python benchmarks/lora.py [--quick] [--parts step,serve,load,peer]

Adapters: random PEFT LoRA adapters of rank --rank on all seven projections of every layer
(written by PEFT itself, tests/tinymodel.build_random_adapter).

1. serve: `tokenloom serve` (fp32, 2 threads, prefix caching off so every prompt is
   computed), 16 closed-loop streams over HTTP (the same load generator as every serving
   benchmark), 128-token prompts, 64 output tokens. Workloads: all 16 streams on the base
   model; spread over 1, 4 and 16 adapters (`model` = the adapter). Servers: LoRA off (the
   baseline), LoRA on with 16 slots (every adapter resident), and LoRA on with 4 slots (16
   adapters then churn through the slots). Rounds interleave the workloads; the best round
   is kept. Output tok/s, ITL p50/p99 and TTFT p50, each with its ratio to the baseline.
2. load: one adapter into a device slot, read from disk (parse, check, copy) and from the
   host LRU (copy only), median of repeats.
3. peer: llama.cpp's llama-server (F32 GGUF) with the same adapters converted by llama.cpp's
   own convert_lora_to_gguf.py (fetched from the llama-cpp-python sdist, as the peer build
   does) and chosen per request by its `lora` field; the same workloads (base, 1 and 4
   adapters). Needs shared/peers/build-llama-server.sh.

The serve table is the run's record (benchmarks/records.py), the other parts' ratios its
summary; every figure goes to benchmarks/raw/lora.json.
"""

from __future__ import annotations

import argparse
import json
import random
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
    tests_module,
)
from records import record_run, write_raw

STREAMS = 16
PROMPT_LEN, OUTPUT_LEN = 128, 64
LLAMA_CPP_PYTHON = "0.3.36"   # the sdist whose vendored llama.cpp the peer was built from


def make_adapters(root: Path, n: int, rank: int) -> dict[str, Path]:
    build_random_adapter = tests_module("tinymodel").build_random_adapter
    base = Path(resolve_dir("default"))
    out = {}
    for i in range(n):
        out[f"a{i}"] = build_random_adapter(base, root / f"a{i}", rank=rank, seed=100 + i,
                                            scale=0.5)
    return out


def workloads(n_prompts: int, seed: int = 0) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(PROMPT_LEN)]
               for _ in range(n_prompts)]
    return {"base": prompts}


def spread(prompts, names: list[str | None], extra=None) -> list[tuple]:
    """Each prompt with its model (cycling through `names`) and extra body fields."""
    out = []
    for i, p in enumerate(prompts):
        name = names[i % len(names)]
        out.append((name or "m", p, extra(name) if extra else {}))
    return out


def measure(url: str, items: list[tuple], tokenloom: bool = True) -> dict:
    protocol = None if tokenloom else PeerStream
    res, elapsed = run_async(run_load(url, "m", items, OUTPUT_LEN, STREAMS, 0, 1, tokenloom,
                                      protocol))
    s = summarise(res, elapsed)
    return {"output_tok_s": s["output_tokens_per_s"], "itl_p50_ms": s["itl_ms"]["p50"],
            "itl_p99_ms": s["itl_ms"]["p99"], "ttft_p50_ms": s["ttft_ms"]["p50"],
            "errors": s["errors"], "first_error": s.get("first_error")}


def best(rounds: list[dict]) -> dict:
    top = max(rounds, key=lambda r: r["output_tok_s"])
    return {**top, "rounds_output_tok_s": [round(r["output_tok_s"], 1) for r in rounds]}


def part_serve(out: dict, adapters: dict[str, Path], quick: bool) -> None:
    prompts = workloads(2 * STREAMS if quick else 3 * STREAMS)["base"]
    names = list(adapters)
    mixes = {"base": [None], "1 adapter": names[:1], "4 adapters": names[:4],
             "16 adapters": names[:16]}
    rounds = 1 if quick else 2
    modules = "{" + ", ".join(f'{k} = "{v}"' for k, v in adapters.items()) + "}"
    common = ["model.dtype=float32", "model.num_threads=2", "server.served_model_name=m",
              "cache.enable_prefix_caching=false"]
    servers = {
        "lora off": (common, ["base"]),
        "lora on, 16 slots": (common + [f"lora.modules={modules}", "lora.max_loras=16",
                                        f"lora.max_lora_rank={out['rank']}"], list(mixes)),
        "lora on, 4 slots": (common + [f"lora.modules={modules}", "lora.max_loras=4",
                                       f"lora.max_lora_rank={out['rank']}"],
                             ["4 adapters", "16 adapters"]),
    }
    rows: dict[str, dict] = {}
    for label, (settings, mix_names) in servers.items():
        server = start_tokenloom(resolve_dir("default"), settings)
        try:
            run_async(run_load(server.url, "m", spread(prompts[:4], names[:4]), 8, 4, 0, 0))
            results: dict[str, list] = {m: [] for m in mix_names}
            for _ in range(rounds):
                for m in mix_names:
                    results[m].append(measure(server.url, spread(prompts, mixes[m])))
        finally:
            server.stop()
        for m, rs in results.items():
            rows[f"{label} / {m}"] = r = best(rs)
            print(f"{label:18s} {m:12s} {r['output_tok_s']:7.1f} tok/s  ITL p50 "
                  f"{r['itl_p50_ms']:6.1f} ms p99 {r['itl_p99_ms']:6.1f} ms  TTFT p50 "
                  f"{r['ttft_p50_ms']:7.1f} ms  errors {r['errors']}", flush=True)
    base = rows["lora off / base"]
    for r in rows.values():
        r["throughput_ratio"] = r["output_tok_s"] / base["output_tok_s"]
        r["itl_p50_ratio"] = r["itl_p50_ms"] / base["itl_p50_ms"]
    out["serve"] = rows


def part_load(out: dict, adapters: dict[str, Path], quick: bool) -> None:
    from tokenloom.actors.execution.lora_cache import LoRACache
    from tokenloom.kernels.lora.stacks import LoRAStacks
    from tokenloom.kernels.models.loader import load_spec

    spec = load_spec(Path(resolve_dir("default")))
    stacks = LoRAStacks(spec, 4, out["rank"], torch.float32, "cpu")
    disk, host = [], []
    names = list(adapters)
    for i in range(3 if quick else 8):
        name = names[i % len(names)]
        cache = LoRACache(stacks, 16)
        t0 = time.perf_counter()
        cache.load(i % 4, name, str(adapters[name]))
        disk.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cache.load((i + 1) % 4, name, str(adapters[name]))
        host.append(time.perf_counter() - t0)
    size = sum(f.stat().st_size for f in adapters[names[0]].iterdir())
    out["load"] = {"adapter_bytes": size, "from_disk_ms": 1e3 * statistics.median(disk),
                   "from_host_ms": 1e3 * statistics.median(host),
                   "slot_bytes": stacks.nbytes // stacks.max_loras}
    print(f"adapter load (rank {out['rank']}, {size / 2**20:.1f} MiB file): from disk "
          f"{out['load']['from_disk_ms']:.1f} ms, from the host LRU "
          f"{out['load']['from_host_ms']:.1f} ms", flush=True)


def part_step(out: dict, adapters: dict[str, Path], quick: bool) -> None:
    """One decode step of 16 rows at a 256-token context, the forward alone (no HTTP, no
    scheduler), the modes interleaved round by round: no adapter rows, then the rows spread
    over 1, 4 and 16 adapters (grouped eager path), and 16 adapters on the static path
    (every slot, masked: what compiled programs and graphs run)."""
    from tokenloom.actors.execution.batch_inputs import build_batch_inputs
    from tokenloom.actors.messages import ExecuteBatch, ScheduledSequence
    from tokenloom.kernels.kv_store import KVCache
    from tokenloom.kernels.lora.peft_adapter import load_adapter
    from tokenloom.kernels.lora.stacks import LoRABatch, LoRAStacks
    from tokenloom.kernels.models.loader import load_model

    model, spec = load_model(Path(resolve_dir("default")), torch.float32, torch.device("cpu"),
                             max_positions=2048)
    stacks = LoRAStacks(spec, 16, out["rank"], torch.float32, "cpu")
    for i, (name, path) in enumerate(adapters.items()):
        stacks.load(i, load_adapter(name, path, spec, out["rank"]))
    model.enable_lora(stacks)
    bs, ctx, rows = 16, 256, STREAMS
    kv = KVCache.allocate(spec.num_layers, rows * ctx // bs + 1, bs, spec.num_kv_heads,
                          spec.head_dim, torch.float32, "cpu")
    per = ctx // bs

    def inputs(num_adapters: int | None, static: bool = False):
        seqs = [ScheduledSequence(request_id=str(i), token_ids=[VOCAB_LO + i],
                                  start_pos=ctx - 1,
                                  block_table=list(range(i * per, (i + 1) * per)), sample=True,
                                  lora_slot=-1 if num_adapters is None else i % num_adapters)
                for i in range(rows)]
        b = build_batch_inputs(ExecuteBatch(step=0, sequences=seqs, num_decodes=rows), bs,
                               torch.device("cpu"), with_decode_mask=False)
        if static:
            b.meta.lora = LoRABatch(b.meta.lora.token_slots, None)
        return b

    modes = {"no adapter rows": inputs(None), "1 adapter": inputs(1), "4 adapters": inputs(4),
             "16 adapters": inputs(16), "16 adapters, static path": inputs(16, True)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    with torch.inference_mode():
        for b in modes.values():   # warm-up (the CPU kernel plan is measured on the first)
            model(b.input_ids, b.positions, kv, b.meta, b.logits_indices)
        for _ in range(5 if quick else 15):
            for m, b in modes.items():
                t0 = time.perf_counter()
                model(b.input_ids, b.positions, kv, b.meta, b.logits_indices)
                times[m].append(time.perf_counter() - t0)
    # The median and the fastest fifth: on a shared machine the low quantile is the
    # steadier estimate of what a step costs; both are reported.
    def low(ts):
        return sorted(ts)[len(ts) // 5]
    base, base_low = statistics.median(times["no adapter rows"]), low(times["no adapter rows"])
    res = {}
    for m, ts in times.items():
        med = statistics.median(ts)
        res[m] = {"step_ms": 1e3 * med, "ratio": med / base, "step_p20_ms": 1e3 * low(ts),
                  "ratio_p20": low(ts) / base_low}
        print(f"decode step, 16 rows @ {ctx}: {m:26s} median {1e3 * med:6.1f} ms "
              f"({med / base:.2f}x), p20 {1e3 * low(ts):6.1f} ms ({low(ts) / base_low:.2f}x)",
              flush=True)
    out["step"] = res


def lora_converter() -> Path:
    """llama.cpp's convert_lora_to_gguf.py (with its `conversion` package and gguf-py),
    from the llama-cpp-python sdist the peer build vendors."""
    root = PEERS / "lora-convert"
    tree = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    script = tree / "convert_lora_to_gguf.py"
    if script.exists():
        return script
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d",
                    str(root)], check=True)
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp"
    subprocess.run(["tar", "xzf", f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz",
                    f"{prefix}/convert_lora_to_gguf.py", f"{prefix}/convert_hf_to_gguf.py",
                    f"{prefix}/conversion", f"{prefix}/gguf-py"], cwd=root, check=True)
    return script


def part_peer(out: dict, adapters: dict[str, Path], quick: bool) -> None:
    binary, gguf = PEERS / "llama-server", PEERS / "SmolLM2-135M-Instruct.F32.gguf"
    if not binary.exists() or not gguf.exists():
        out["peer"] = "llama-server not built (shared/peers/build-llama-server.sh)"
        print(out["peer"])
        return
    script = lora_converter()
    names = list(adapters)[:4]
    files = []
    for name in names:
        f = adapters[name] / "adapter.gguf"
        if not f.exists():
            subprocess.run([sys.executable, str(script), "--base", resolve_dir("default"),
                            "--outfile", str(f), "--outtype", "f32", str(adapters[name])],
                           check=True, capture_output=True)
        files.append(f)
    ids = {name: i for i, name in enumerate(names)}

    def lora_field(name):
        # --lora-init-without-apply: every adapter at scale 0 unless a request names it
        return {"lora": [] if name is None else [{"id": ids[name], "scale": 1.0}]}

    prompts = workloads(2 * STREAMS if quick else 3 * STREAMS)["base"]
    mixes = {"base": [None], "1 adapter": names[:1], "4 adapters": names[:4]}
    extra = ["--lora-init-without-apply"] + [a for f in files for a in ("--lora", str(f))]
    logdir = Path(tempfile.mkdtemp())
    server = start_llama_server(binary, gguf, STREAMS, STREAMS * 512, 2, logdir / "llama.log",
                                extra)
    rows = {}
    try:
        run_async(run_load(server.url, "m", spread(prompts[:4], [None], lora_field), 8, 4, 0,
                           0, False, PeerStream))
        results = {m: [] for m in mixes}
        for _ in range(1 if quick else 2):
            for m, ns in mixes.items():
                results[m].append(measure(server.url, spread(prompts, ns, lora_field), False))
    finally:
        server.stop()
    for m, rs in results.items():
        rows[m] = r = best(rs)
        print(f"llama-server       {m:12s} {r['output_tok_s']:7.1f} tok/s  ITL p50 "
              f"{r['itl_p50_ms']:6.1f} ms p99 {r['itl_p99_ms']:6.1f} ms  TTFT p50 "
              f"{r['ttft_p50_ms']:7.1f} ms  errors {r['errors']}", flush=True)
    for r in rows.values():
        r["throughput_ratio"] = r["output_tok_s"] / rows["base"]["output_tok_s"]
    serve = out.get("serve", {})
    for m in mixes:
        ours = serve.get(f"lora on, 16 slots / {m}")
        if ours:
            rows[m]["tokenloom_vs_llama"] = ours["output_tok_s"] / rows[m]["output_tok_s"]
    out["peer"] = rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--parts", default="step,serve,load,peer")
    args = ap.parse_args()
    parts = args.parts.split(",")
    out: dict = {"rank": args.rank, "streams": STREAMS, "prompt_len": PROMPT_LEN,
                 "output_len": OUTPUT_LEN}
    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = make_adapters(root, 16, args.rank)
    if "step" in parts:
        part_step(out, adapters, args.quick)
    if "serve" in parts:
        part_serve(out, adapters, args.quick)
    if "load" in parts:
        part_load(out, adapters, args.quick)
    if "peer" in parts:
        part_peer(out, adapters, args.quick)
    print(json.dumps({k: v for k, v in out.items() if k in ("serve", "peer")}, indent=1))
    write_raw("lora", out)
    columns = ["server / workload", "out tok/s", "ITL p50 ms", "ITL p99 ms", "TTFT p50 ms",
               "throughput vs lora off", "ITL p50 vs lora off", "errors"]
    rows = [[name, r["output_tok_s"], r["itl_p50_ms"], r["itl_p99_ms"], r["ttft_p50_ms"],
             r["throughput_ratio"], r["itl_p50_ratio"], r["errors"]]
            for name, r in out.get("serve", {}).items()]
    record_run("lora", summary(out), {"columns": columns, "rows": rows}, args,
               smoke=args.quick)


def summary(out: dict) -> dict:
    """Each part's ratios against its baseline: the step with no adapter rows, the server
    with LoRA off, llama-server on the same workload."""
    res: dict = {}
    if "step" in out:
        res["step_vs_no_adapter"] = {m: r["ratio"] for m, r in out["step"].items()
                                     if m != "no adapter rows"}
    if "serve" in out:
        res["serve_throughput_vs_off"] = {m: r["throughput_ratio"]
                                          for m, r in out["serve"].items()
                                          if m != "lora off / base"}
    if "load" in out:
        res["load_ms"] = {"disk": out["load"]["from_disk_ms"],
                          "host": out["load"]["from_host_ms"]}
    if isinstance(out.get("peer"), dict):
        res["vs_llama"] = {m: r["tokenloom_vs_llama"] for m, r in out["peer"].items()
                           if "tokenloom_vs_llama" in r}
    return res


if __name__ == "__main__":
    main()
