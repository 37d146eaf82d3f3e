"""The CPU forward pass against llama.cpp, precision for precision, in one run.

For each weight mode, tokenloom (offline engine, default model) and then llama.cpp's own
`llama-server` (built natively by ../shared/peers/build-llama-server.sh; one server at a
time, the same token-id prompts, greedy, EOS ignored):

    fp32  (model.dtype float32)                          vs llama.cpp F32 GGUF
    bf16  (model.dtype bfloat16)                         vs llama.cpp F16 GGUF
    int8  (model.weight_dtype int8, bf16 activations)    vs llama.cpp Q8_0 GGUF
    q4    (model.weight_dtype q4, fp32 activations)      vs llama.cpp Q4_1 GGUF (the file
          `make serve` ships: both serve its own blocks)
    q8    (model.weight_dtype q8, fp32 activations)      vs llama.cpp Q8_0 GGUF

- batch-1 decode at ~300 and ~1,100 tokens of context: ms per token (tokenloom: the
  engine's token timestamps; llama.cpp: its own `timings.predicted_per_token_ms`);
- prefill of a 1,024-token prompt: prompt tokens/s (tokenloom: time to the first token;
  llama.cpp: `timings.prompt_per_second`);
- batch-16 decode step vs batch-1 (16 concurrent 32-token prompts, 64 tokens each);
- start-up: tokenloom cold (no C++ kernel build cache, no remembered quality gate, kernel
  plan or compiled programs) and warm; llama-server until /health answers 200;
- tokenloom eager and with compiled decode programs (graphs.cpu_compile) side by side;
- the roofline next to each decode figure: bytes streamed per token (every projection
  weight once, the tied LM head once, the KV read at that context) over the
  multi-threaded read bandwidth, measured before every round of every mode (at the median
  of those samples, and each round at its own sample, for tokenloom and for llama.cpp: its
  GGUF's bytes and an f16 KV); and the int8 quality gate (agreement, KL) beside its speed.

Prints one table of ratios (tokenloom / llama.cpp speed: > 1 is faster) and records it
(benchmarks/records.py; every figure of every round goes to benchmarks/raw/cpu_forward.json).
`--rounds N` runs tokenloom and llama.cpp alternately N times per mode and reports each
figure's median over the rounds (the raw JSON keeps every round and the spread, max / min):
on a machine whose speed drifts by tens of percent within minutes, one tokenloom run then
one llama.cpp run compares two different machines.

    python benchmarks/cpu_forward.py                 # everything (~10 min on 2 cores)
    python benchmarks/cpu_forward.py --modes fp32 --quick
    python benchmarks/cpu_forward.py --modes bf16 fp32 --rounds 3 --cpu-compile off --no-cold
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

from harness import PEERS, VOCAB_HI, VOCAB_LO, start_llama_server
from records import read_bandwidth_gbs, record_run, write_raw

GGUF = "SmolLM2-135M-Instruct.{}.gguf"
MODES = {  # name: (LLM options, llama.cpp GGUF type, KV bytes per element)
    "fp32": (dict(dtype="float32"), "F32", 4),
    "bf16": (dict(dtype="bfloat16"), "F16", 2),
    "int8": (dict(dtype="bfloat16", weight_dtype="int8"), "Q8_0", 2),
    "q4": (dict(dtype="float32", weight_dtype="q4"), "Q4_1", 4),
    "q8": (dict(dtype="float32", weight_dtype="q8"), "Q8_0", 4),
    # fp32 activations over an fp16 KV (cache.kv_dtype fp16): llama-server's own default
    # cache type; q4-kv16 is `make serve`'s mode.
    "fp32-kv16": (dict(dtype="float32", kv_dtype="fp16"), "F32", 2),
    "q4-kv16": (dict(dtype="float32", weight_dtype="q4", kv_dtype="fp16"), "Q4_1", 2),
    "q8-kv16": (dict(dtype="float32", weight_dtype="q8", kv_dtype="fp16"), "Q8_0", 2),
}
OUT = 64


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(length)] for _ in range(n)]


# -- tokenloom ---------------------------------------------------------------------------
def tokenloom_mode(mode: str, args, rng: random.Random, compiled: bool = False) -> dict:
    from tokenloom import LLM, SamplingParams

    options, _, _ = MODES[mode]
    t = time.perf_counter()
    llm = LLM(device="cpu", quiet=True, enable_prefix_caching=False, chunking="static",
              max_num_batched_tokens=2048, cpu_compile=compiled, **options)
    start_s = time.perf_counter() - t

    def gen(ps, max_tokens):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(ps, sp)
        return time.perf_counter() - t0, outs

    def itl_ms(outs) -> float:
        gaps = [b - a for o in outs for a, b in zip(o.outputs[0].timings.token_times,
                                                     o.outputs[0].timings.token_times[1:])]
        return statistics.median(gaps) * 1000

    res: dict = {"startup_in_process_s": start_s}
    try:
        gen(prompts(rng, 1, 32), 8)                                  # warm-up (kernel plans)
        for ctx in (300, 1100):
            runs = [itl_ms(gen(prompts(rng, 1, ctx - OUT), OUT)[1]) for _ in range(args.reps)]
            res[f"decode_{ctx}_ms"] = min(runs)
        runs = [gen(prompts(rng, 1, 1024), 1)[0] for _ in range(args.reps)]
        res["prefill_1024_tok_s"] = 1024 / min(runs)
        res["batch1_step_ms"] = min(itl_ms(gen(prompts(rng, 1, 32), OUT)[1])
                                    for _ in range(args.reps))
        res["batch16_step_ms"] = min(itl_ms(gen(prompts(rng, 16, 32), OUT)[1])
                                     for _ in range(max(1, args.reps - 1)))
        res["weight_bytes"] = weight_bytes(llm)
        stats = llm.graph_stats()
        res["program_steps"] = stats.replays
        res["eager_steps"] = stats.eager_steps
    finally:
        llm.close()
    return res


def weight_bytes(llm) -> int:
    """Bytes a decode step streams for weights: every projection and the head once (the
    embedding lookup reads one row: not counted), norms included."""
    model = llm.engine.runner.model_runner.model
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        # The CPU kernels' weight forms are counted once each below (CpuLinear.weight_bytes).
        if name.startswith("embed_tokens") or "rope" in name or ".kernels." in name \
                or name.startswith("lm_head.kernels"):
            continue
        total += t.numel() * t.element_size()
    from tokenloom.kernels.cpu.linear import CpuLinear
    total += sum(m.weight_bytes for m in model.modules() if isinstance(m, CpuLinear))
    if not isinstance(model.lm_head, CpuLinear) and model.spec.tie_word_embeddings:
        total += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return total


def startup_subprocess(mode: str, cold: bool, compiled: bool = False) -> float:
    """Seconds to construct LLM in a fresh process (model already converted). Cold: empty
    C++ kernel build cache and no remembered quality gate, kernel plan or compiled decode
    programs (moved aside and put back afterwards)."""
    options, _, _ = MODES[mode]
    env = dict(os.environ)
    tmp = None
    code = ("import time; t=time.perf_counter(); from tokenloom import LLM; "
            f"llm=LLM(device='cpu', quiet=True, cpu_compile={compiled!r}, **{options!r}); "
            "print(time.perf_counter()-t); llm.close()")
    gate = saved = None
    from tokenloom.config.schema import ModelConfig, resolve_cache_dir
    caches = [Path(resolve_cache_dir(ModelConfig())) / d for d in ("cpu_programs",
                                                                  "cpu_kernel_plans")]
    aside = [c.with_name(c.name + ".bench-aside") for c in caches]
    if cold:
        for c, a in zip(caches, aside):
            if c.exists():
                shutil.rmtree(a, ignore_errors=True)
                c.rename(a)
        tmp = tempfile.mkdtemp(prefix="tl-cold-")
        env["TORCH_EXTENSIONS_DIR"] = tmp
        from tokenloom.config.schema import ModelConfig, resolve_cache_dir
        gate = Path(resolve_cache_dir(ModelConfig())) / "quality_gate.json"
        saved = gate.read_bytes() if gate.exists() else None
        gate.unlink(missing_ok=True)
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True)
        return float(out.stdout.strip().splitlines()[-1])
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        if saved is not None:   # the user's remembered verdicts come back as they were
            gate.write_bytes(saved)
        if cold:
            for c, a in zip(caches, aside):
                if a.exists():
                    shutil.rmtree(c, ignore_errors=True)
                    a.rename(c)


# -- llama.cpp ---------------------------------------------------------------------------
def _completion(url: str, prompt: list[int], n_predict: int) -> dict:
    body = json.dumps(dict(prompt=prompt, n_predict=n_predict, temperature=0, ignore_eos=True,
                           cache_prompt=False)).encode()
    req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["timings"]


def llama_mode(mode: str, args, rng: random.Random, logdir: Path) -> dict:
    gguf = PEERS / GGUF.format(MODES[mode][1])
    t = time.perf_counter()
    server = start_llama_server(PEERS / "llama-server", gguf, 16, 16 * 2048, args.threads,
                                logdir / f"llama-{mode}.log")
    url = server.url
    res: dict = {"startup_s": time.perf_counter() - t, "gguf_bytes": gguf.stat().st_size}
    try:
        _completion(url, prompts(rng, 1, 32)[0], 8)
        for ctx in (300, 1100):
            res[f"decode_{ctx}_ms"] = min(
                _completion(url, prompts(rng, 1, ctx - OUT)[0], OUT)["predicted_per_token_ms"]
                for _ in range(args.reps))
        res["prefill_1024_tok_s"] = max(
            _completion(url, prompts(rng, 1, 1024)[0], 1)["prompt_per_second"]
            for _ in range(args.reps))
        res["batch1_step_ms"] = min(
            _completion(url, prompts(rng, 1, 32)[0], OUT)["predicted_per_token_ms"]
            for _ in range(args.reps))
        best16 = float("inf")
        for _ in range(max(1, args.reps - 1)):
            got: list[float] = []
            threads = [threading.Thread(target=lambda p=p: got.append(
                _completion(url, p, OUT)["predicted_per_token_ms"]))
                for p in prompts(rng, 16, 32)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            best16 = min(best16, statistics.median(got))
        res["batch16_step_ms"] = best16
    finally:
        server.stop()
    return res


def merge_rounds(runs: list[dict]) -> dict:
    """One server's runs of a mode -> its figures' medians over the runs, with every run
    under "rounds" and each figure's max / min under "spread". A figure a run lacks is
    left out of that figure's median."""
    if len(runs) == 1:
        return dict(runs[0])
    keys = dict.fromkeys(k for r in runs for k, v in r.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool))
    out: dict = {}
    spread: dict = {}
    for k in keys:
        vals = [r[k] for r in runs if isinstance(r.get(k), (int, float))]
        out[k] = statistics.median(vals)
        if min(vals) > 0:
            spread[k] = max(vals) / min(vals)
    for r in runs:   # non-numeric fields (none today) from the first run that has them
        for k, v in r.items():
            out.setdefault(k, v)
    out["spread"] = spread
    out["rounds"] = runs
    return out


# -- report ------------------------------------------------------------------------------
def roofline_ms(weight_bytes: int, kv_bytes_per_token: int, ctx: int, gbs: float) -> float:
    return (weight_bytes + kv_bytes_per_token * ctx) / gbs / 1e6


def round_fractions(side: dict, weight_bytes: float, kv_bytes_per_token: int, ctx: int
                    ) -> list[float]:
    """Each round's decode step as a fraction of its roofline at the bandwidth sampled just
    before that round (this machine's bandwidth flips between two states within minutes,
    so the run's median prices a round met in the other state wrongly)."""
    k = f"decode_{ctx}_ms"
    return [roofline_ms(weight_bytes, kv_bytes_per_token, ctx, r["read_bandwidth_gbs"]) / r[k]
            for r in side.get("rounds", [side])
            if r.get("read_bandwidth_gbs") and r.get(k)]


def _fraction_range(fr: list[float]) -> str:
    if not fr:
        return ""
    if len(fr) == 1:
        return f"; own round {fr[0]:.0%}"
    return f"; own rounds {min(fr):.0%}-{max(fr):.0%}"


COLUMNS = ["mode (vs llama.cpp)", "figure", "tokenloom", "llama.cpp", "ratio",
           "tokenloom roofline", "llama.cpp roofline"]
KV_ELEMS = 30 * 2 * 3 * 64   # SmolLM2-135M: layers x (K, V) x kv heads x head dim


def table_rows(out: dict) -> list[list[str]]:
    """The report's table: one row per figure of each mode (and compiled variant)."""
    gbs = out["read_bandwidth_gbs"]
    rows = []
    for (mode, r), variant in [(item, v) for item in out["modes"].items()
                               for v in ("tokenloom", "tokenloom_compiled")]:
        ours, peer = r.get(variant), r.get("llama")
        if not ours or not peer:
            continue
        kvb = KV_ELEMS * MODES[mode][2]
        label = f"{mode}{' compiled' if variant.endswith('compiled') else ''} (vs {MODES[mode][1]})"
        for ctx in (300, 1100):
            k = f"decode_{ctx}_ms"
            roof = roofline_ms(ours["weight_bytes"], kvb, ctx, gbs)
            mine = _fraction_range(round_fractions(ours, ours["weight_bytes"], kvb, ctx))
            theirs = ""
            if peer.get("gguf_bytes"):
                peer_roof = roofline_ms(peer["gguf_bytes"], KV_ELEMS * 2, ctx, gbs)
                theirs = (f"at {peer_roof / peer[k]:.0%}" + _fraction_range(
                    round_fractions(peer, peer["gguf_bytes"], KV_ELEMS * 2, ctx)))
            rows.append([label, f"batch-1 decode, ~{ctx} ctx (ms/token)", f"{ours[k]:.2f}",
                         f"{peer[k]:.2f}", f"{peer[k] / ours[k]:.2f}x",
                         f"{roof:.2f} ms ({ours['weight_bytes'] / 1e6:.0f} MB + KV; at "
                         f"{roof / ours[k]:.0%}{mine})", theirs])
        rows.append([label, "prefill 1,024 tokens (tok/s)", f"{ours['prefill_1024_tok_s']:.0f}",
                     f"{peer['prefill_1024_tok_s']:.0f}",
                     f"{ours['prefill_1024_tok_s'] / peer['prefill_1024_tok_s']:.2f}x", "", ""])
        rows.append([label, "batch-16 step / batch-1 step",
                     f"{ours['batch16_step_ms']:.1f} / {ours['batch1_step_ms']:.1f} ms = "
                     f"{ours['batch16_step_ms'] / ours['batch1_step_ms']:.2f}x",
                     f"{peer['batch16_step_ms']:.1f} / {peer['batch1_step_ms']:.1f} ms = "
                     f"{peer['batch16_step_ms'] / peer['batch1_step_ms']:.2f}x",
                     f"{peer['batch16_step_ms'] / ours['batch16_step_ms']:.2f}x (b16)", "", ""])
        start = (f"warm {ours['startup_warm_s']:.1f} s" if "startup_warm_s" in ours else "")
        if "startup_cold_s" in ours:
            start = f"cold {ours['startup_cold_s']:.1f} s, " + start
        rows.append([label, "start-up", start, f"{peer['startup_s']:.1f} s", "", "", ""])
        if "gate" in r and variant == "tokenloom":
            rows.append([label, "quality gate vs fp32", r["gate"], "", "", "", ""])
    return rows


def summary(out: dict) -> dict:
    """The headline ratios (llama.cpp time / tokenloom time, tokenloom / llama.cpp prefill
    speed; > 1: tokenloom faster) per mode, eager, and the run's read bandwidth."""
    res: dict = {"read_bandwidth_gbs": out["read_bandwidth_gbs"]}
    for mode, r in out["modes"].items():
        ours, peer = r.get("tokenloom"), r.get("llama")
        if ours and peer:
            res[mode] = {"decode300_x": peer["decode_300_ms"] / ours["decode_300_ms"],
                         "decode1100_x": peer["decode_1100_ms"] / ours["decode_1100_ms"],
                         "prefill_x": ours["prefill_1024_tok_s"] / peer["prefill_1024_tok_s"]}
    return res


def report(out: dict) -> list[str]:
    gbs = out["read_bandwidth_gbs"]
    samples = out.get("read_bandwidth_samples_gbs") or [gbs]
    measured = (f"median of {len(samples)} measurements, {min(samples):.1f}-"
                f"{max(samples):.1f}, " if len(samples) > 1 else "")
    lines = [f"read bandwidth {gbs:.1f} GB/s ({measured}{out['threads']} threads); "
             "ratio = tokenloom "
             "speed / llama.cpp speed (> 1: tokenloom faster); roofline = bytes per token / "
             "bandwidth (at the run's median, then each round at the bandwidth sampled just "
             "before it; llama.cpp: its GGUF + an f16 KV)"
             + (f"; medians over {out['rounds']} alternating rounds"
                if out.get("rounds", 1) > 1 else ""),
             "",
             "| " + " | ".join(COLUMNS) + " |",
             "|---|---|---:|---:|---:|---:|---:|"]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(out)]
    compiled = [(m, r) for m, r in out["modes"].items() if "tokenloom" in r
                and "tokenloom_compiled" in r]
    if compiled:
        lines += ["", "compiled decode programs / eager (same run; > 1: compiled faster):", ""]
        for mode, r in compiled:
            e, c = r["tokenloom"], r["tokenloom_compiled"]
            parts = [f"{k.replace('_ms', '')} {e[k] / c[k]:.2f}x" for k in
                     ("decode_300_ms", "decode_1100_ms", "batch1_step_ms", "batch16_step_ms")]
            lines.append(f"- {mode}: " + ", ".join(parts) + f" ({c.get('program_steps', 0)} "
                         f"program steps, {c.get('eager_steps', 0)} eager)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="tokenloom and llama.cpp alternately, this many times per mode; "
                         "medians over the rounds")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quick", action="store_true", help="one repetition, no cold start")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--cpu-compile", choices=("both", "on", "off"), default="both",
                    help="tokenloom with compiled decode programs (graphs.cpu_compile), "
                         "eager, or both side by side (default)")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.no_cold = 1, True
    rng = random.Random(0)
    # Measured again before every round of every mode (this kind of machine's bandwidth
    # moved 29 -> 48 GB/s within an hour): the roofline uses the median of the samples.
    samples = [read_bandwidth_gbs()]
    out: dict = {"threads": args.threads, "read_bandwidth_gbs": samples[0],
                 "read_bandwidth_samples_gbs": samples, "rounds": args.rounds,
                 "peers": str(PEERS), "modes": {}}
    from tokenloom.kernels.cpu.features import detect
    out["cpu"] = f"{detect().model_name}, {detect().summary()}"
    print(f"CPU {out['cpu']}; read bandwidth {out['read_bandwidth_gbs']:.1f} GB/s", flush=True)
    logdir = Path(tempfile.mkdtemp(prefix="cpu-forward-"))
    for mode in args.modes:
        r = out["modes"].setdefault(mode, {})
        variants = {"both": (False, True), "on": (True,), "off": (False,)}[args.cpu_compile]
        runs: dict[str, list[dict]] = {}
        for rnd in range(args.rounds):
            if mode != args.modes[0] or rnd > 0:
                samples.append(read_bandwidth_gbs())
                out["read_bandwidth_gbs"] = statistics.median(samples)
            for compiled in variants:
                key = "tokenloom_compiled" if compiled else "tokenloom"
                print(f"[{mode}] round {rnd + 1}/{args.rounds}: {key} ...", flush=True)
                res = tokenloom_mode(mode, args, rng, compiled)
                res["read_bandwidth_gbs"] = samples[-1]   # this round's own sample
                if rnd == 0:
                    if not args.no_cold and (compiled or mode == args.modes[-1]):
                        res["startup_cold_s"] = startup_subprocess(mode, True, compiled)
                    res["startup_warm_s"] = startup_subprocess(mode, False, compiled)
                runs.setdefault(key, []).append(res)
            print(f"[{mode}] round {rnd + 1}/{args.rounds}: llama.cpp {MODES[mode][1]} ...",
                  flush=True)
            peer = llama_mode(mode, args, rng, logdir)
            peer["read_bandwidth_gbs"] = samples[-1]
            runs.setdefault("llama", []).append(peer)
        for key, got in runs.items():
            r[key] = merge_rounds(got)
        if MODES[mode][0].get("weight_dtype") in ("int8", "q4", "q8"):
            r["gate"] = _gate_summary(MODES[mode][0]["weight_dtype"])
        print(json.dumps(r, indent=1), flush=True)
        write_raw("cpu_forward", out)
    print("\n".join(report(out)))
    write_raw("cpu_forward", out)
    record_run("cpu_forward", summary(out), {"columns": COLUMNS, "rows": table_rows(out)}, args,
               bandwidth_gbs=out["read_bandwidth_gbs"])


def _gate_summary(weight_dtype: str) -> str:
    """The remembered weight quality gate verdict of `weight_dtype` (the newest gate's
    entries are "gate2|<model digest>|<weight dtype>|..."; the memo also holds KV-cache
    verdicts and older gates' entries)."""
    from tokenloom.config.schema import ModelConfig, resolve_cache_dir
    memo = Path(resolve_cache_dir(ModelConfig())) / "quality_gate.json"
    try:
        entries = json.loads(memo.read_text())
    except (OSError, ValueError):
        return "not recorded"
    mine = [v for k, v in entries.items()
            if k.startswith("gate2|") and k.split("|")[2] == weight_dtype]
    if not mine:
        return "not recorded"
    e = mine[-1]
    return (f"agreement {e['agreement']:.3f}, mean KL {e['mean_kl']:.4f} nats, greedy "
            f"{e['greedy_match']}/{e['greedy_tokens']}")


if __name__ == "__main__":
    main()
